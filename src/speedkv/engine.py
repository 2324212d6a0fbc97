"""The decoder loop: layer-major prefill driven by a method's policy, batched decode steps,
sampling, streaming.

Prefill runs one layer at a time over the rows of the residual stream that the policy says
are computed there (SPEED drops its shallow tokens at `lcut`; nothing is computed for them
above it). Within a layer, rows go through in chunks of `chunk_size` queries, so activation
memory does not grow with the prompt and attention never materialises an N x N matrix.
Each layer's K/V is written straight into that layer's cache buffer, which is sized for the
entries the layer keeps plus the tokens still to be generated.

Decode steps batch every running sequence through the projections and MLPs together; each
sequence attends over its own cache, so sequences of different lengths and different methods
share a step.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .attention import decode_attention, prefill_attention
from .cache import KVCache, LayerKV
from .errors import UserError
from .models import LoadedModel
from .policy import Policy, PromptInfo, Stream, make_policy
from .sampling import Sampler, SamplingParams
from .textio import Detokenizer, encode_prompt, find_stop


@dataclass
class Request:
    """One sequence to generate: prompt ids, the method bound to the model, sampling."""

    ids: list[int]
    policy: Policy
    sampling: SamplingParams = field(default_factory=SamplingParams)
    header_tokens: int | None = None  # chat generation-header length, for `deep=header`


@dataclass
class Generation:
    """What one request produced, with its timings and KV accounting."""

    method: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    ttft_s: float  # from the start of the call to the first new token
    tpot_s: float  # mean time per new token after the first (0 if only one)
    kv_bytes: int  # KV held when the first new token is produced
    kv_bytes_final: int  # KV held when generation ends
    kv_allocated_bytes: int  # buffers that existed, including room reserved for decode
    layer_lengths: list[int]  # cache entries per layer when the first token is produced


@dataclass
class TokenEvent:
    """One new token of request `index`; `text` is the printable delta (may be empty)."""

    index: int
    token_id: int
    text: str
    finished: Generation | None = None  # set on the request's last event


class _Sequence:
    """A running request: its cache, sampler and bookkeeping."""

    def __init__(self, index: int, request: Request, policy: Policy, tokenizer, t0: float):
        self.index = index
        self.request = request
        self.policy = policy
        self.sampler = Sampler(request.sampling)
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.t0 = t0
        self.cache: KVCache | None = None
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.t_first = self.t_last = 0.0
        self.kv_first = 0
        self.lengths_first: list[int] = []

    @property
    def next_pos(self) -> int:
        """Absolute position of the last sampled token, the next one to feed."""
        return len(self.request.ids) + len(self.output) - 1

    def result(self) -> Generation:
        steps = len(self.output) - 1
        return Generation(
            method=self.policy.spec(),
            prompt_ids=list(self.request.ids),
            output_ids=list(self.output),
            text=self.text,
            finish_reason=self.finish_reason or "length",
            ttft_s=self.t_first,
            tpot_s=(self.t_last - self.t_first) / steps if steps > 0 else 0.0,
            kv_bytes=self.kv_first,
            kv_bytes_final=self.cache.nbytes(),
            kv_allocated_bytes=self.cache.allocated_bytes(),
            layer_lengths=self.lengths_first,
        )


class Engine:
    """Runs prefill and decode for a loaded model under any registered method."""

    def __init__(self, model: LoadedModel, chunk_size: int = 1024):
        self.model = model
        self.backbone = model.backbone
        self.shape = model.shape
        self.tokenizer = model.tokenizer
        self.chunk_size = chunk_size
        self.eos_ids = model.eos_token_ids()

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    # -- the two phases ----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        ids: list[int] | torch.Tensor,
        policy: Policy,
        spare: int = 0,
        header_tokens: int | None = None,
    ) -> tuple[KVCache, torch.Tensor]:
        """Run the prompt under `policy`; return its cache and the last position's logits.

        `spare` reserves room in every layer for that many decode-phase tokens.
        """
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).flatten()
        n = ids.numel()
        policy.begin(PromptInfo(ids, header_tokens))
        pos = torch.arange(n, device=self.device)
        h = self.backbone.embed(ids)
        layers = []
        for layer in range(self.shape.num_layers):
            rows = policy.computed(layer, Stream(h, pos))
            if rows is not None:
                h, pos = h[rows], pos[rows]
            h, kv = self._prefill_layer(layer, h, pos, policy, spare)
            layers.append(kv)
        if pos.numel() == 0 or int(pos[-1]) != n - 1:
            raise RuntimeError(
                f"method {policy.spec()} did not run the last prompt token to the top"
            )
        logits = self.backbone.logits(self.backbone.final_norm(h[-1:]))[0]
        return KVCache(layers), logits

    def _prefill_layer(
        self, layer: int, h: torch.Tensor, pos: torch.Tensor, policy: Policy, spare: int
    ) -> tuple[torch.Tensor, LayerKV]:
        bb, shape = self.backbone, self.shape
        rows = h.shape[0]
        kv = LayerKV(shape.num_kv_heads, rows + spare, shape.head_dim, bb.dtype, self.device)
        cos, sin = bb.rope(pos)
        out = torch.empty_like(h)
        for start in range(0, rows, self.chunk_size):
            end = min(start + self.chunk_size, rows)
            x = bb.input_norm(layer, h[start:end])
            q, k, v = bb.qkv(layer, x, cos[start:end], sin[start:end])
            kv.extend(k, v, pos[start:end])
            mask = policy.visible(layer, pos[start:end], pos[:end])
            if mask is not None:
                mask = mask & (pos[None, :end] <= pos[start:end, None])
            o = prefill_attention(q, kv.k[:, :end], kv.v[:, :end], mask)
            out[start:end] = bb.mlp_block(layer, h[start:end] + bb.attn_out(layer, o))
        keep = policy.kept(layer, pos)
        if keep is not None:
            kv.keep(keep.nonzero()[:, 0] if keep.dtype == torch.bool else keep)
        return out, kv

    @torch.inference_mode()
    def decode_step(
        self, caches: list[KVCache], policies: list[Policy], tokens: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Feed one token per sequence through every layer; return logits [B, vocab]."""
        bb = self.backbone
        batch = len(tokens)
        h = bb.embed(torch.tensor(tokens, device=self.device))[:, None, :]  # [B, 1, H]
        pos = torch.tensor(positions, device=self.device)
        cos, sin = bb.rope(pos)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        for layer in range(self.shape.num_layers):
            q, k, v = bb.qkv(layer, bb.input_norm(layer, h), cos, sin)  # [B, heads, 1, D]
            outs = []
            for b in range(batch):
                kv = caches[b].layers[layer]
                kv.write_next(k[b], v[b], positions[b])
                live = kv.length + 1
                outs.append(decode_attention(q[b], kv.k[:, :live], kv.v[:, :live]))
                if policies[b].keeps_decode_kv(layer):
                    kv.commit()
            o = torch.stack(outs)
            h = bb.mlp_block(layer, h + bb.attn_out(layer, o))
        return bb.logits(bb.final_norm(h[:, -1]))

    # -- generation --------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[TokenEvent]:
        """Generate for every request, yielding each new token as it is produced.

        Prompts are prefilled one after another; their decode steps then run as one batch.
        """
        t0 = time.perf_counter()
        for request in requests:
            self.check_request(request)
        running: list[_Sequence] = []
        for index, request in enumerate(requests):
            seq = _Sequence(index, request, copy.copy(request.policy), self.tokenizer, t0)
            seq.cache, logits = self.prefill(
                request.ids, seq.policy, request.sampling.max_new_tokens - 1, request.header_tokens
            )
            seq.kv_first = seq.cache.nbytes()
            seq.lengths_first = seq.cache.lengths()
            yield from self._accept(seq, seq.sampler(logits), first=True)
            if seq.finish_reason is None:
                running.append(seq)
        while running:
            logits = self.decode_step(
                [s.cache for s in running],
                [s.policy for s in running],
                [s.output[-1] for s in running],
                [s.next_pos for s in running],
            )
            for seq, row in zip(running, logits, strict=False):
                yield from self._accept(seq, seq.sampler(row), first=False)
            running = [s for s in running if s.finish_reason is None]

    def generate(self, requests: list[Request]) -> list[Generation]:
        results: list[Generation | None] = [None] * len(requests)
        for event in self.run(requests):
            if event.finished is not None:
                results[event.index] = event.finished
        return results  # type: ignore[return-value]

    def check_request(self, request: Request) -> None:
        request.sampling.validate()
        n = len(request.ids)
        if n == 0:
            raise UserError("the prompt is empty")
        if n > self.shape.max_positions:
            raise UserError(
                f"the prompt has {n} tokens, more than the model's context of "
                f"{self.shape.max_positions}"
            )

    def _accept(self, seq: _Sequence, token: int, first: bool) -> Iterator[TokenEvent]:
        now = time.perf_counter() - seq.t0
        if first:
            seq.t_first = now
        seq.t_last = now
        seq.output.append(token)
        params = seq.request.sampling
        delta = ""
        if seq.detok is not None and token not in self.eos_ids:
            delta = seq.detok.push(token)
            before = len(seq.text)
            seq.text += delta
            at = find_stop(seq.text, params.stop, before) if params.stop else None
            if at is not None:
                delta = seq.text[before:at] if at > before else ""
                seq.text = seq.text[:at]
                seq.finish_reason = "stop"
        if token in self.eos_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif seq.finish_reason is None and len(seq.output) >= params.max_new_tokens:
            seq.finish_reason = "length"
        yield TokenEvent(seq.index, token, delta, seq.result() if seq.finish_reason else None)

    # -- text conveniences -----------------------------------------------------------------
    def request(
        self,
        prompt: str,
        method: str | Policy = "full",
        chat: bool = True,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """A request from prompt text, through the chat template unless chat=False."""
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer; pass token ids instead of text")
        encoded = encode_prompt(self.tokenizer, prompt, chat=chat)
        policy = method if isinstance(method, Policy) else make_policy(method, self.shape)
        return Request(encoded.ids, policy, sampling or SamplingParams(), encoded.header_tokens)

    def generate_text(
        self, prompt: str, method: str | Policy = "full", chat: bool = True, **sampling
    ) -> Generation:
        req = self.request(prompt, method, chat, SamplingParams(**sampling))
        return self.generate([req])[0]
