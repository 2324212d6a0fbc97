"""The engine: prefill (see prefill.py) and batched decode steps under a method's policy,
sampling, streaming and continuous batching.

Decode steps batch every running sequence through the projections and MLPs together; each
sequence attends over its own layer-asymmetric cache, so sequences of different lengths and
different methods share a step. `Batch` lets requests join after their prefill and leave
between steps; `Engine.run` and `Engine.generate` are built on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from speedkv.core.cache import KVCache, LayerKV
from speedkv.core.flops import decode_flops, prefill_flops
from speedkv.core.graph_decode import GraphDecode, why_not
from speedkv.core.policy import Policy, PromptInfo, decode_plan, own_cache_only
from speedkv.core.prefill import Chunks, Prefill, PrefillRun
from speedkv.core.prefix import CachedPrefix, PrefixCache, common_prefix
from speedkv.core.registry import MethodSpec, make_policy, method_class, method_names
from speedkv.core.sampling import Sampler, SamplingParams
from speedkv.errors import UserError
from speedkv.hf import loading
from speedkv.hf.loading import LoadedModel, wrap_model
from speedkv.hf.text import Detokenizer, encode_messages, encode_prompt, find_stop
from speedkv.kernels.attention import batch_decode_attention, native_decode_takes
from speedkv.kernels.tuning import engine_config
from speedkv.log import log

# Prefill rows per chunk. On a CPU the weight products of longer chunks run faster (oneDNN
# blocks them better): SmolLM2 in bfloat16 prefilled 2048 and 8128 tokens in 0.88-1.03x the
# time (three of four cells under 0.93x) with chunks of 2048 as with 1024, turn about in one
# process, on an Intel Xeon with AMX (speedkv measure prefill-chunks).
# On a GPU, chunks of 8192 rows took 2-6 % off Llama-3.1-8B's TTFT on an H200 against 1024
# (docs/gpu.md, the `+chunk8192` rows).
CPU_CHUNK, CHUNK = 2048, 8192
# Queries per call where a layer attends through an explicit mask (a visibility rule, a
# window, entries out of order). The mask holds queries x keys entries, so on a GPU its
# chunk stays small while the row chunk grows: at 128K keys, 1024 queries make a 128 Mi-entry
# mask, 8192 would make a 1 Gi-entry one.
CPU_MASK_CHUNK, MASK_CHUNK = CPU_CHUNK, 1024
# When decode steps run as a recorded CUDA graph (core/graph_decode.py): "auto" on a GPU,
# "always" on any device (elsewhere the same fixed-shape step runs eagerly, for checks),
# "never". SPEEDKV_RECORDED_DECODE sets the default.
RECORDED_DECODE = ("auto", "always", "never")
# How a recorded step attends: flash attention with device lengths, the whole batch in one
# call per layer, where it matches the masked matrix products on the batch's own cache (a
# half-precision cache on a GPU; faster alone on the H200, 204 against 324 us a layer at
# 128K); else, or asked for, two masked matrix products per sequence.
# SPEEDKV_RECORDED_ATTENTION sets the default.
RECORDED_ATTENTION = ("flash", "matmul")
# A recording took 45-98 ms on an H200 at Llama-3.1-8B's shape, 4-8 of its steps, and saved
# 5-32 ms a step against launching each kernel from the host
# (benchmarks/gpu/h200/1-recorded-steps/efficiency.json, record_s): a batch records only when
# it will take at least this many steps unchanged.
MIN_RECORDED_STEPS = 16


@dataclass
class Request:
    """One sequence to generate: prompt ids, the method bound to the model, sampling."""

    ids: list[int]
    policy: Policy
    sampling: SamplingParams = field(default_factory=SamplingParams)
    header_tokens: int | None = None  # chat generation-header length, for `deep=header`
    turn_tokens: int | None = None  # the last chat message through the header, for `deep=turn`
    prefix: CachedPrefix | None = None  # a cache `ids` extend: only the rest is prefilled


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
    flops_prefill: int  # analytic: layer-token matmuls plus attention over what was computed
    flops_decode: int  # the same for every decode step, summed
    reused_tokens: int = 0  # prompt tokens taken from a cached prefix instead of prefilled


@dataclass
class TokenEvent:
    """One new token of the request with key `key`; `text` is the printable delta (may be
    empty)."""

    key: object
    token_id: int
    text: str
    finished: Generation | None = None  # set on the request's last event


class _Sequence:
    """A running request: its cache, sampler and bookkeeping."""

    def __init__(
        self,
        key: object,
        request: Request,
        policy: Policy,
        tokenizer,
        t0: float,
        shape,
        eos_ids: Iterable[int] = (),
    ):
        self.key = key
        self.shape = shape
        self.request = request
        self.policy = policy
        self.sampler = Sampler(request.sampling, request.ids, eos_ids)
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.t0 = t0
        self.cache: KVCache | None = None
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.t_first = self.t_last = 0.0
        self.kv_first = 0
        self.lengths_first: list[int] = []
        self.flops_prefill = 0
        self.first_position = len(request.ids)
        self.reused = 0  # prompt tokens taken from a cached prefix instead of prefilled

    @property
    def next_pos(self) -> int:
        """Absolute position of the last sampled token, the next one to feed."""
        return self.first_position + len(self.output) - 1

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
            flops_prefill=self.flops_prefill,
            flops_decode=decode_flops(self.shape, self.cache.decode_reads(), steps),
            reused_tokens=self.reused,
        )


class Engine:
    """Runs prefill and decode for a loaded model under any registered method.

    `prepack=True` decodes on a copy of the weights packed for one-row products, as the CLI
    does by default: about twice as fast per token on a CPU, for a second copy of the linear
    weights in memory. Left as None, the model's current setting (plain weights) is kept.

    `recorded_decode` (one of RECORDED_DECODE; default SPEEDKV_RECORDED_DECODE, else "auto"):
    on a GPU, a batch whose sequences only append to their own caches decodes through one
    recorded CUDA graph per step instead of ~30 kernel launches per layer, once it will run
    at least MIN_RECORDED_STEPS steps unchanged (core/graph_decode.py; docs/gpu.md).
    `recorded_attention` (RECORDED_ATTENTION; default SPEEDKV_RECORDED_ATTENTION, else
    "flash" where it agrees with "matmul"): how such a step attends."""

    def __init__(
        self,
        model: LoadedModel,
        chunk_size: int | None = None,
        depth: int | None = None,
        prefix_cache: PrefixCache | None = None,
        prepack: bool | None = None,
        recorded_decode: str | None = None,
        recorded_attention: str | None = None,
    ):
        self.recorded_decode = _choice(
            "recorded decode", recorded_decode, "SPEEDKV_RECORDED_DECODE", RECORDED_DECODE
        )
        self.recorded_attention = _choice(
            "recorded attention", recorded_attention, "SPEEDKV_RECORDED_ATTENTION",
            RECORDED_ATTENTION,
        )  # fmt: skip
        self.model = model
        if prepack is not None:  # decode on prepacked weights (docs/engine.md)
            model.backbone.prepack_decode(prepack)
        # with a prefix cache, every prompt under a reusable method starts from the longest
        # cached prefix it extends, and leaves its own cache there (automatic prefix caching)
        self.prefix_cache = prefix_cache
        self.backbone = model.backbone
        self.shape = model.shape
        # depth < L runs only the first layers, then the final norm and head (an early-exit
        # speculator made of the model itself)
        self.depth = depth or model.shape.num_layers
        self.tokenizer = model.tokenizer
        on_cpu = self.device.type == "cpu"
        rows = chunk_size or (CPU_CHUNK if on_cpu else CHUNK)
        # a chunk size given by the caller bounds the masked calls too, never beyond it
        self.chunks = Chunks(rows, min(rows, CPU_MASK_CHUNK if on_cpu else MASK_CHUNK))
        self.eos_ids = model.eos_token_ids()
        self._companions: dict[str, Engine] = {}
        if self.device.type == "cpu":  # built now if need be, not in the first request's decode
            model.backbone.use_kernels(engine_config())

    @classmethod
    def from_hf(
        cls, model: torch.nn.Module, tokenizer: object | None = None, **engine_kwargs: Any
    ) -> Engine:
        """An engine for a transformers causal LM you already have, without our loader. The
        model is put in eval mode without gradients; without a tokenizer, requests take token
        ids. `engine_kwargs` are Engine's (chunk_size, ...)."""
        return cls(wrap_model(model, tokenizer), **engine_kwargs)

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def records_graphs(self) -> bool:
        """Whether this engine's device records CUDA graphs (what `auto` records on)."""
        return self.device.type == "cuda"

    def with_depth(self, depth: int) -> Engine:
        """The same model cut after its first `depth` layers (final norm and head on top):
        an early-exit probe or speculator that shares every weight."""
        return Engine(
            self.model,
            self.chunks.rows,
            depth,
            recorded_decode=self.recorded_decode,
            recorded_attention=self.recorded_attention,
        )

    def companion(self, name_or_path: str) -> Engine:
        """An engine for another model a method needs (SpecPrefill's speculator): an embedded
        name, an HF directory or a GGUF file, in this engine's dtype and on its device.
        Loaded on first use and kept for this engine's lifetime."""
        if name_or_path not in self._companions:
            model = loading.load_model(
                name_or_path, dtype=self.backbone.dtype, device=self.device, progress=False
            )
            self._companions[name_or_path] = Engine(model, self.chunks.rows)
        return self._companions[name_or_path]

    # -- the two phases ----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_ids(
        self,
        ids: list[int] | torch.Tensor,
        policy: Policy,
        spare: int = 0,
        header_tokens: int | None = None,
        turn_tokens: int | None = None,
        base: KVCache | None = None,
        start: int = 0,
    ) -> Prefill:
        """Run the prompt under `policy`: its cache, the last computed position's logits, and
        the work done. `spare` reserves room in every layer for that many decode tokens.

        With `base`, the prompt extends a cached one: `ids` are its tokens from position
        `start` on, and they attend to `base`'s entries at positions before `start` (which
        are copied, never written)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).flatten()
        self.backbone.check_weights()  # fuse anew if the model's weights were replaced
        if base is not None:
            positions = torch.arange(start, start + ids.numel(), device=self.device)
            prompt = PromptInfo(ids, header_tokens, positions, start + ids.numel(), turn_tokens)
            policy.begin(prompt)
            run = PrefillRun(self.backbone, policy, self.depth, self.chunks, spare, base, start)
            return run.run(prompt, prompt.end)
        prompt = PromptInfo(ids, header_tokens, turn_tokens=turn_tokens)
        next_position = prompt.n
        selection = policy.select_prompt(prompt, self)
        if selection is not None:
            prompt = PromptInfo(
                ids[selection.indices.to(self.device)],
                header_tokens,
                selection.positions.to(self.device),
                prompt.n,
                turn_tokens,
            )
            next_position = selection.next_position
        policy.begin(prompt)
        run = PrefillRun(self.backbone, policy, self.depth, self.chunks, spare)
        return run.run(prompt, next_position)

    @torch.inference_mode()
    def decode_step(
        self, caches: list[KVCache], policies: list[Policy], tokens: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Feed one token per sequence through every layer; return logits [B, vocab].

        Projections and MLPs run batched; each sequence attends over its own cache (in one
        kernel call for the batch where the native kernel runs), so sequences of different
        lengths and methods share a step. Where every piece is native and every sequence only
        appends to its layers' caches, each layer is one native call.
        """
        bb = self.backbone
        h = bb.embed(torch.tensor(tokens, device=self.device))[:, None, :]  # [B, 1, H]
        cos, sin = bb.rope(torch.tensor(positions, device=self.device), bound=max(positions) + 1)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        plans = [decode_plan(p, self.depth) for p in policies]
        if self._layers_in_one_call(caches, policies, h, positions):
            for layer in range(self.depth):
                h = self._layer_in_one_call(layer, h, cos, sin, caches, plans, positions)
        else:
            h = self._layers_in_parts(h, cos, sin, caches, policies, plans, positions)
        return bb.logits(bb.final_norm(h[:, -1]))

    def record_decode(
        self, caches: list[KVCache], policies: list[Policy], positions: list[int], steps: int
    ) -> GraphDecode | None:
        """The next `steps` decode steps of this batch as a recorded step, or None where the
        engine does not record here (`recorded_decode`), the batch will not run long enough
        to repay the recording, or a sequence's method does more than append to its caches."""
        mode = self.recorded_decode
        if mode == "never" or (mode == "auto" and not self.records_graphs):
            return None
        if steps < (1 if mode == "always" else MIN_RECORDED_STEPS):
            return None
        if any(why_not(self, p, c, steps) for p, c in zip(policies, caches)):
            return None
        try:
            flash = self.recorded_attention == "flash"
            return GraphDecode(self, caches, policies, positions, steps, flash=flash)
        except RuntimeError as error:  # a model whose step cannot be recorded
            if mode == "always":
                raise
            log(f"decode steps cannot be recorded here, so they run kernel by kernel: {error}")
            self.recorded_decode = "never"
            return None

    def _layers_in_one_call(
        self,
        caches: list[KVCache],
        policies: list[Policy],
        h: torch.Tensor,
        positions: list[int],
    ) -> bool:
        """Whether this step runs each layer as one native call (Backbone.decode_layer): the
        backbone's native pieces take every layer for this batch, the native decode attention
        takes its heads, and every sequence only writes its tokens into each layer's own cache
        (as full attention's, as many KV heads as the model)."""
        heads = self.shape.num_kv_heads
        return (
            self.backbone.layers_in_one_call(h.shape[0])
            and native_decode_takes(self.backbone.native_ops, h.dtype, self.shape.head_dim)
            and all(own_cache_only(p, self.depth) is None for p in policies)
            and all(kv.k.shape[0] == heads for cache in caches for kv in cache.layers)
            and self._windows_are_runs(caches, positions)
        )

    def _windows_are_runs(self, caches: list[KVCache], positions: list[int]) -> bool:
        """Whether every sliding window this step applies is a run of slots (the entries are
        in position order), which the one native call reads as a narrower buffer."""
        return all(
            cache.layers[layer].in_order()
            for layer in range(self.depth)
            if (window := self.shape.window(layer)) is not None
            for cache, position in zip(caches, positions)
            if position >= window
        )

    def _window(self, kv: LayerKV, layer: int, position: int) -> tuple[int, int | None]:
        """For a decode query at `position` in `layer`: the first slot it reads, and the
        first position it sees where its sliding window leaves out earlier entries (None
        where it sees every entry: no window, or one that reaches position 0). Entries that
        fell out of the window stay in the cache; attention skips them."""
        window = self.shape.window(layer)
        if window is None or position < window:
            return 0, None
        first = position - window + 1
        start = kv.window_start(first)
        return (0, first) if start is None else (start, None)

    def _layer_in_one_call(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[KVCache],
        plans: list[list[tuple[int, tuple[int, int] | None, bool]]],
        positions: list[int],
    ) -> torch.Tensor:
        layers = [cache.layers[layer] for cache in caches]
        for kv in layers:
            kv.make_room()
        # a sliding window is a run of slots here (`_windows_are_runs`): the call gets the
        # buffers from its first slot on, and writes the token at the same slot as before
        starts = [self._window(kv, layer, p)[0] for kv, p in zip(layers, positions)]
        buffers = (
            [kv.k[:, s:] for kv, s in zip(layers, starts)],
            [kv.v[:, s:] for kv, s in zip(layers, starts)],
            [kv.pos[:, s:] for kv, s in zip(layers, starts)],
            [kv.length - s for kv, s in zip(layers, starts)],
        )
        h = self.backbone.decode_layer(layer, h, cos, sin, buffers, positions)
        for kv, plan, start in zip(layers, plans, starts):
            kv.reads += kv.length + 1 - start
            if plan[layer][2]:
                kv.commit()
        return h

    def _layers_in_parts(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[KVCache],
        policies: list[Policy],
        plans: list[list[tuple[int, tuple[int, int] | None, bool]]],
        positions: list[int],
    ) -> torch.Tensor:
        """Every layer of a decode step, piece by piece: any method, any kernels."""
        bb = self.backbone
        sources = {ki[0] for plan in plans for _, ki, _ in plan if ki is not None}
        saved: dict[int, torch.Tensor] = {}
        for layer in range(self.depth):
            if layer in sources:
                saved[layer] = h
            q, k, v = bb.before_attention(layer, h, cos, sin)  # [B, heads, 1, D]
            layers = [cache.layers[layer] for cache in caches]
            keys, values, visible = [], [], []
            for b, (plan, kv) in enumerate(zip(plans, layers)):
                owner, kv_input, _ = plan[layer]
                live = kv.length
                start, first = self._window(kv, layer, positions[b])
                if owner == layer:
                    kb, vb = k[b], v[b]
                    if kv_input is not None:  # K/V from an earlier layer's residual (SwiftKV)
                        x = bb.input_norm(kv_input[1], saved[kv_input[0]][b])
                        kb, vb = bb.kv(layer, x, cos[b], sin[b])
                    kv.write_next(kb, vb, positions[b])
                    live += 1
                kv.reads += live - start
                keys.append(kv.k[:, start:live])
                values.append(kv.v[:, start:live])
                # entries out of position order: the window is a mask by position
                visible.append(None if first is None else kv.pos[:, :live] >= first)
            o = batch_decode_attention(q, keys, values, visible)
            for b, (plan, kv) in enumerate(zip(plans, layers)):
                owner, _, keep = plan[layer]
                if owner == layer and keep:
                    kv.commit()
                policies[b].after_decode(layer, q[b], kv)
            h = bb.after_attention(layer, h, o)
        return h

    # -- generation --------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[TokenEvent]:
        """Generate for every request, yielding each new token as it is produced.

        Prompts are prefilled one after another; their decode steps then run as one batch.
        """
        start = time.perf_counter()  # every TTFT counts from the call
        for request in requests:
            self.check_request(request)
        batch = Batch(self)
        for index, request in enumerate(requests):
            yield from batch.add(index, request, since=start)
        while batch:
            yield from batch.step()

    @overload
    def generate(self, requests: list[Request]) -> list[Generation]: ...
    @overload
    def generate(
        self, requests: CachedPrefix, question: str | list[int], **sampling: Any
    ) -> Generation: ...
    def generate(self, requests, question=None, **sampling):
        """Generate for a list of requests; or, given a cached prefix (`prefill`) and a
        question, continue the cached prompt with it (the next user message of a chat prompt,
        or text appended to a raw one), taking `generate_text`'s sampling arguments."""
        if isinstance(requests, CachedPrefix):
            if question is None:
                raise UserError("continuing a cached prefix needs a question")
            params = SamplingParams.from_generate_args(**sampling)
            return self.generate([self.continuation(requests, question, params)])[0]
        if question is not None or sampling:
            raise UserError("a question and sampling arguments go with a cached prefix")
        results: list[Generation | None] = [None] * len(requests)
        for event in self.run(requests):
            if event.finished is not None:
                results[event.key] = event.finished
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

    # -- text conveniences -----------------------------------------------------------------
    def request(
        self,
        prompt: str,
        method: str | MethodSpec | Policy = "full",
        chat: bool = True,
        sampling: SamplingParams | None = None,
    ) -> Request:
        """A request from prompt text, through the chat template unless chat=False."""
        self._need_tokenizer()
        encoded = encode_prompt(self.tokenizer, prompt, chat=chat)
        return Request(
            encoded.ids,
            self.policy(method),
            sampling or SamplingParams(),
            encoded.header_tokens,
            encoded.turn_tokens,
        )

    def prefill(
        self, prompt: str | list[int], method: str | MethodSpec | Policy = "full", chat: bool = True
    ) -> CachedPrefix:
        """Prefill a document once, to ask it any number of questions with
        `generate(cache, question)`. Text goes through the chat template as a user message of
        its own (the question becomes the next one) unless chat=False; token ids are taken as
        they are. Only methods whose cache does not depend on the question can be reused."""
        policy = self.policy(method)
        check_reusable(policy)
        messages = None
        if isinstance(prompt, str):
            self._need_tokenizer()
            if not prompt.strip():
                raise UserError("the document is empty")
            if chat and getattr(self.tokenizer, "chat_template", None):
                messages = [{"role": "user", "content": prompt}]
                ids = encode_messages(self.tokenizer, messages, generation_header=False).ids
            else:
                ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            ids = [int(i) for i in prompt]
        self.check_request(Request(ids, policy))
        start = time.perf_counter()
        done = self.prefill_ids(ids, policy)
        return CachedPrefix(ids, policy.spec(), done.cache, messages, time.perf_counter() - start)

    def continuation(
        self, prefix: CachedPrefix, question: str | list[int], sampling: SamplingParams
    ) -> Request:
        """A request continuing `prefix` with `question`: a chat prefix gets it as the next
        user message (then the generation header); a raw one gets its tokens appended."""
        policy = make_policy(prefix.method, self.shape)
        if not isinstance(question, str):
            new = [int(i) for i in question]
            return Request(prefix.ids + new, policy, sampling, None, len(new), prefix)
        self._need_tokenizer()
        if not question.strip():
            raise UserError("the question is empty")
        if prefix.messages is None:
            new = list(self.tokenizer(question, add_special_tokens=False)["input_ids"])
            return Request(prefix.ids + new, policy, sampling, None, len(new), prefix)
        messages = [*prefix.messages, {"role": "user", "content": question}]
        encoded = encode_messages(self.tokenizer, messages)
        return Request(
            encoded.ids, policy, sampling, encoded.header_tokens, encoded.turn_tokens, prefix
        )

    def policy(self, method: str | MethodSpec | Policy) -> Policy:
        """The policy that runs `method` on this engine's model, for a `Request` built from
        token ids: a spec string (`"speed:lcut=22,anchors=bos"`) or a parsed `MethodSpec` is
        bound to the model's shape (the defaults its layer count implies, such as SPEED's
        lcut); a `Policy` is returned as it is. One policy may serve many requests: the engine
        runs each sequence on a `fresh()` copy of it."""
        if isinstance(method, Policy):
            return method
        return make_policy(method, self.shape, self.model.trained_method)

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer; pass token ids instead of text")

    def generate_text(
        self, prompt: str, method: str | Policy = "full", chat: bool = True, **sampling: Any
    ) -> Generation:
        """Generate for prompt text. `sampling` takes transformers `generate`-style arguments
        (do_sample, temperature, top_k, top_p, max_new_tokens, min_new_tokens,
        repetition_penalty, stop_strings, ...) with their HF meaning; see
        SamplingParams.from_generate_args for the exact mapping."""
        params = SamplingParams.from_generate_args(**sampling)
        return self.generate([self.request(prompt, method, chat, params)])[0]


class Batch:
    """Sequences decoding together. Requests join after their prefill and leave when they
    finish or are cancelled, between steps (continuous batching); each keeps its own cache,
    which is freed when it leaves."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.running: dict[object, _Sequence] = {}
        # each layer's sliding window (None: none); generating sequences drop what falls out
        shape = engine.shape
        windows = [shape.window(layer) for layer in range(engine.depth)]
        self.windows = windows if shape.windowed else None
        # the recorded step of the running sequences, in their order; dropped when one joins
        # or leaves (its shapes and caches are those of the batch it was recorded for)
        self._recorded: GraphDecode | None = None

    def __len__(self) -> int:
        return len(self.running)

    def add(self, key: object, request: Request, since: float | None = None) -> list[TokenEvent]:
        """Prefill a request and sample its first token; it decodes from the next step on.

        TTFT counts from `since` (a time.perf_counter() value, e.g. the request's arrival),
        or from now."""
        engine = self.engine
        t0 = time.perf_counter() if since is None else since
        seq = _Sequence(
            key,
            request,
            request.policy.fresh(),
            engine.tokenizer,
            t0,
            engine.shape,
            engine.eos_ids,
        )
        prefix, start = self._prefix(request, seq.policy)
        done = engine.prefill_ids(
            request.ids[start:],
            seq.policy,
            request.sampling.max_new_tokens - 1,
            request.header_tokens,
            request.turn_tokens,
            prefix.cache if prefix is not None else None,
            start,
        )
        seq.cache, seq.first_position = done.cache, done.next_position
        seq.reused = start
        if engine.prefix_cache is not None and seq.policy.reusable:
            # the prompt alone, for requests that arrive while this one decodes (whole: the
            # sequence's own cache gets new buffers when it drops entries below)
            snapshot = CachedPrefix(list(request.ids), seq.policy.spec(), seq.cache.snapshot())
            engine.prefix_cache.insert(snapshot)
        if self.windows is not None and seq.policy.reusable:
            seq.cache.drop_out_of_window(self.windows, seq.first_position)
        seq.flops_prefill = prefill_flops(engine.shape, done.rows, done.pairs)
        seq.kv_first = seq.cache.nbytes()
        seq.lengths_first = seq.cache.lengths()
        event = self._accept(seq, seq.sampler(done.logits), first=True)
        if seq.finish_reason is None:
            self.running[key] = seq
            self._recorded = None
        else:
            self._finished(seq)
        return [event]

    def _prefix(self, request: Request, policy: Policy) -> tuple[CachedPrefix | None, int]:
        """The cached prefix the request starts from and how many of its tokens it reuses:
        the one it names, or the longest the engine's prefix cache holds; (None, 0) when it
        starts from nothing."""
        if request.prefix is not None:
            prefix = request.prefix
            check_reusable(policy)
            if prefix.method != policy.spec():
                raise UserError(
                    f"the cache was built with '{prefix.method}'; a prompt continuing it runs "
                    f"the same method, not '{policy.spec()}'"
                )
            shared = common_prefix(prefix.ids, request.ids)
            if shared == 0:
                raise UserError("the prompt does not start with the cached prefix's tokens")
            reuse = min(shared, len(request.ids) - 1)  # the last token gives the logits
            if self.windows is not None and not prefix.cache.covers(self.windows, reuse):
                raise UserError(
                    f"the cached prefix dropped entries that a sliding window at token {reuse} "
                    "still sees; the prompt must continue it from its end"
                )
            return prefix, reuse
        store = self.engine.prefix_cache
        if store is not None and policy.reusable:
            windows = self.windows
            found = store.lookup(
                request.ids,
                policy.spec(),
                None if windows is None else lambda entry, n: entry.cache.covers(windows, n),
            )
            if found is not None:
                return found
        return None, 0

    def _finished(self, seq: _Sequence) -> None:
        """Leave a finished sequence's cache (prompt and every token fed back) in the engine's
        prefix cache, for the next turn of its conversation."""
        store = self.engine.prefix_cache
        if store is not None and seq.policy.reusable:
            ids = [*seq.request.ids, *seq.output[:-1]]  # the last token was never fed back
            cache = seq.cache
            if cache.allocated_bytes() > 2 * cache.nbytes() or cache.has_views():
                # room reserved for tokens it never generated (a stop before max_tokens) would
                # count against the store's bound, and a view of a batch's packed buffers
                # would hold the whole batch's: keep a tight copy instead
                cache = cache.prefix(len(ids), 0)
            store.insert(CachedPrefix(ids, seq.policy.spec(), cache))

    def step(self) -> list[TokenEvent]:
        """One decode step for every running sequence."""
        seqs = list(self.running.values())
        if not seqs:
            return []
        caches, policies = [s.cache for s in seqs], [s.policy for s in seqs]
        tokens, positions = [s.output[-1] for s in seqs], [s.next_pos for s in seqs]
        if self._recorded is None or self._recorded.left == 0:
            # every sequence runs until its token limit unless it stops early
            steps = min(s.request.sampling.max_new_tokens - len(s.output) for s in seqs)
            self._recorded = self.engine.record_decode(caches, policies, positions, steps)
        if self._recorded is not None:
            logits = self._recorded.step(tokens)
        else:
            logits = self.engine.decode_step(caches, policies, tokens, positions)
        events = [
            self._accept(seq, seq.sampler(row), first=False) for seq, row in zip(seqs, logits)
        ]
        for seq in seqs:
            if seq.finish_reason is not None:
                del self.running[seq.key]
                self._finished(seq)
                self._recorded = None
            elif (
                self.windows is not None
                and seq.policy.reusable
                and seq.cache.drop_out_of_window(self.windows, seq.next_pos, slack=True)
            ):
                self._recorded = None  # the layers that dropped have new buffers: record again
        return events

    def cancel(self, key: object) -> None:
        """Drop a sequence (its cache goes with it)."""
        if self.running.pop(key, None) is not None:
            self._recorded = None

    def kv_bytes(self) -> int:
        return sum(seq.cache.nbytes() for seq in self.running.values())

    def _accept(self, seq: _Sequence, token: int, first: bool) -> TokenEvent:
        now = time.perf_counter() - seq.t0
        if first:
            seq.t_first = now
        seq.t_last = now
        seq.output.append(token)
        params = seq.request.sampling
        eos = token in self.engine.eos_ids
        delta = ""
        if seq.detok is not None and not eos:
            delta = seq.detok.push(token)
            before = len(seq.text)
            seq.text += delta
            at = find_stop(seq.text, params.stop, before) if params.stop else None
            if at is not None:
                delta = seq.text[before:at] if at > before else ""
                seq.text = seq.text[:at]
                seq.finish_reason = "stop"
        if eos and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif seq.finish_reason is None and len(seq.output) >= params.max_new_tokens:
            seq.finish_reason = "length"
        return TokenEvent(seq.key, token, delta, seq.result() if seq.finish_reason else None)


def _choice(what: str, given: str | None, variable: str, choices: tuple[str, ...]) -> str:
    """`given`, else the environment's `variable`, else the first choice; checked."""
    value = given or os.environ.get(variable) or choices[0]
    if value not in choices:
        raise UserError(f"{what} '{value}' is not one of {', '.join(choices)}")
    return value


def check_reusable(policy: Policy | type[Policy]) -> None:
    """UserError unless caches `policy` (or any policy of this class) builds may serve other
    prompts."""
    if not policy.reusable:
        reusable = [name for name in method_names() if method_class(name).reusable]
        raise UserError(
            f"a cache built by '{policy.name}' cannot serve another prompt: what it keeps "
            f"depends on the end of the prompt, or its reuse is not defined; caches of "
            f"{' and '.join(reusable)} can be reused"
        )
