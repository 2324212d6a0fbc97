"""Decode steps a CUDA graph can replay: one launch per token instead of one per kernel.

Launched kernel by kernel, the engine's decode step at Llama-3.1-8B's shape is bound by the
host issuing its ~930 kernels: about 20 ms a token on an H100 and an H200 at every length,
against 8 ms of device work at 16K tokens, so SPEED's smaller cache does not show in the time
per token. A CUDA graph records a step's kernels once and replays them with one call: on the
H200 the step then took 8.8 ms at 16K and 17.7 ms at 128K, and SPEED-24's 15.6 ms (docs/gpu.md).
Recording needs every shape and address fixed, so this step differs from `Engine.decode_step`
in three ways:

- each layer writes its new key and value at the slot a device tensor names (`index_copy_`),
  not at a slot the host indexes;
- attention reads the layer's whole buffer and counts only the entries before the live
  length, a device tensor. By default on a GPU in half precision it is flash attention's
  variable-length form, for the whole batch in one call per layer: the batch's buffers of a
  layer are first laid side by side in one buffer (`_pack`), and it runs only where it gives
  the matrix products' output on the batch's own cache. Otherwise two matrix products per
  sequence mask the rest (`attention.matmul_decode_attention` with `live`); the buffer is
  widened to a multiple of WIDTH and its free slots are zeroed first, so the masked ones are
  finite;
- the token, the position and the live lengths are device tensors, advanced in place;
- a layer with a sliding window masks, by position against the device position, the entries
  that fell out of it (always: the mask costs one comparison, and the window starts to bite
  mid-recording without the host knowing). Flash attention's window counts slots, not
  positions, so a sliding-window model's recorded steps attend by the matrix products.

The same step runs eagerly on any device (the tests hold it to `Engine.decode_step` on the
CPU, and on CUDA with `--device cuda`) and is recorded and replayed on CUDA. It takes methods
whose decode only appends to each layer's own cache (full, SPEED, and every method that
changes only the prefill); methods that evict during decode, or share a cache between layers,
are refused with the reason. The engine's batches decode through it on a GPU
(`Engine.record_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from speedkv.core.cache import KVCache
from speedkv.core.policy import Policy, decode_plan, own_cache_only
from speedkv.kernels.attention import (
    flash_takes,
    live_flash_decode_attention,
    matmul_decode_attention,
)
from speedkv.log import log

# Each layer's buffer is attended whole, so its width is a dimension of both matrix products.
# On an H200 at Llama-3.1-8B's shape a step over buffers of 131072 + 63 entries took 162 ms
# against 16-18 ms over 131072 + 64 (benchmarks/gpu/h200/2-engine-odd-width and 3-engine):
# buffers are widened to a multiple of this first.
WIDTH = 64


def recordable_width(entries: int) -> int:
    """`entries` rounded up to a multiple of WIDTH: the width a recorded step's buffer takes."""
    return -(-entries // WIDTH) * WIDTH


# devices and dtypes where flash attention with a device length failed: not tried again
_NO_FLASH: set[tuple[torch.device, torch.dtype]] = set()


@dataclass
class Packed:
    """One layer's buffers of a whole batch, side by side (`GraphDecode._pack`)."""

    k: torch.Tensor  # [kv_heads, B * width, D]
    v: torch.Tensor
    pos: torch.Tensor  # [kv_heads, B * width] int32
    offsets: torch.Tensor  # [B] long: where each sequence's part starts
    starts: torch.Tensor  # [B + 1] int32: the same, and the end, as flash attention takes them
    width: int


class Stepper(Protocol):
    """What a recorded step needs of the engine (core/engine.py records through this module,
    so it is named by what it offers, not imported)."""

    backbone: Any
    depth: int
    device: torch.device


class GraphDecode:
    """`steps` decode steps for a fixed batch of prefilled caches, recorded as one CUDA graph
    on a GPU (`record`, default: on CUDA) and run eagerly elsewhere. `flash`: attend by flash
    attention with device lengths where it matches the matrix products (`attention` says
    which runs; the engine asks for it by default)."""

    @torch.inference_mode()  # the caches are inference tensors
    def __init__(
        self,
        engine: Stepper,
        caches: list[KVCache],
        policies: list[Policy],
        positions: list[int],
        steps: int,
        record: bool | None = None,
        flash: bool = False,
    ):
        self.engine, self.caches, self.steps, self.taken = engine, caches, steps, 0
        for policy, cache in zip(policies, caches):
            refusal = why_not(engine, policy, cache, steps)
            if refusal:
                raise ValueError(f"{policy.spec()}: {refusal}")
        device = engine.device
        self.tokens = torch.zeros(len(caches), dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.live = torch.tensor([c.lengths() for c in caches], dtype=torch.long, device=device)
        self.bound = max(positions) + steps + 1  # above every position the steps will see
        # flash attention's query offsets (int32, made before any recording: a recording
        # cannot copy from the host)
        self.query_starts = torch.arange(len(caches) + 1, dtype=torch.int32, device=device)
        self.packed: list[Packed] = []
        self.attention = "matmul"
        if flash and self._flash_may_run():
            self.packed = [self._pack(layer) for layer in range(engine.depth)]
            self.attention = "flash" if self._flash_agrees() else "matmul"
        else:
            for cache in caches:
                for kv in cache.layers:
                    kv.grow_to(recordable_width(kv.capacity))
                    kv.k[:, kv.length :].zero_()  # masked slots get weight 0: never NaN
                    kv.v[:, kv.length :].zero_()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if record if record is not None else device.type == "cuda":
            try:
                self._record()
            except RuntimeError as error:
                if self.attention != "flash":
                    raise
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                _give_up_flash(self.caches[0].layers[0].k, f"it could not be recorded: {first}")
                self.attention, self.graph = "matmul", None
                self._record()

    @property
    def left(self) -> int:
        """Recorded steps not yet taken."""
        return self.steps - self.taken

    @torch.inference_mode()
    def step(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Feed each sequence its next token; returns the logits [B, vocab] of the next."""
        if self.taken == self.steps:
            raise RuntimeError(f"all {self.steps} recorded decode steps are taken")
        self.tokens.copy_(torch.as_tensor(tokens, device=self.tokens.device))
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits.clone()  # the graph overwrites its output next step
        else:
            logits = self._step()
        self.taken += 1
        for cache in self.caches:  # the host's bookkeeping, as Engine.decode_step keeps it
            for kv in cache.layers:
                kv.commit()
                kv.reads += kv.length
        return logits

    def _step(self) -> torch.Tensor:
        bb = self.engine.backbone
        h = bb.embed(self.tokens)[:, None, :]  # [B, 1, H]
        cos, sin = bb.rope(self.positions, bound=self.bound)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        if self.attention == "flash":  # flash's int32 positions and lengths, once a step
            positions = self.positions.to(torch.int32)
            lengths = (self.live + 1).to(torch.int32).t().contiguous()  # [layers, B]
        for layer in range(self.engine.depth):
            q, k, v = bb.before_attention(layer, h, cos, sin)  # [B, heads, 1, D]
            if self.attention == "flash":
                out = self._flash_layer(layer, q, k, v, positions, lengths[layer])
                h = bb.after_attention(layer, h, out)
                continue
            window = bb.shape.window(layer)
            outs = []
            for b, cache in enumerate(self.caches):
                kv = cache.layers[layer]
                slot = self.live[b, layer : layer + 1]
                kb, vb = k[b], v[b]
                if kb.shape[0] != kv.k.shape[0]:  # a cache kept per query head
                    group = kv.k.shape[0] // kb.shape[0]
                    kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
                kv.k.index_copy_(1, slot, kb)
                kv.v.index_copy_(1, slot, vb)
                position = self.positions[b].to(torch.int32).reshape(1, 1)
                kv.pos.index_copy_(1, slot, position.expand(kv.pos.shape[0], 1))
                # free slots hold stale positions; `live` masks them either way
                visible = None if window is None else kv.pos >= position - (window - 1)
                out = matmul_decode_attention(q[b], kv.k, kv.v, live=slot + 1, visible=visible)
                outs.append(out)
            h = bb.after_attention(layer, h, torch.stack(outs))
        self.live += 1
        self.positions += 1
        return bb.logits(bb.final_norm(h[:, -1]))

    def _flash_layer(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        live: torch.Tensor,
    ) -> torch.Tensor:
        """One layer of the batch through flash attention: the new keys, values and positions
        ([B] int32) written into the packed buffers with one copy each, then one call for every
        sequence, each counting its first `live` ([B] int32, the new entry included) entries."""
        pack = self.packed[layer]
        slots = pack.offsets + self.live[:, layer]
        pack.k.index_copy_(1, slots, k[:, :, 0].transpose(0, 1))  # [kv_heads, B, D]
        pack.v.index_copy_(1, slots, v[:, :, 0].transpose(0, 1))
        pack.pos.index_copy_(1, slots, positions.expand(pack.pos.shape[0], -1))
        starts = (self.query_starts, pack.starts)
        out = live_flash_decode_attention(q[:, :, 0], pack.k, pack.v, live, starts, pack.width)
        return out[:, :, None]  # [B, heads, 1, D]

    def _flash_may_run(self) -> bool:
        """Whether flash attention could attend this batch: half-precision caches on a GPU,
        one entry per KV head (flash reads the model's grouped heads itself), no sliding window
        (flash's window counts slots, and an upper SPEED layer's slots skip positions), and
        no earlier failure on this device and dtype."""
        first = self.caches[0].layers[0].k
        heads = self.engine.backbone.shape.num_kv_heads
        return (
            flash_takes(first)
            and (first.device, first.dtype) not in _NO_FLASH
            and not self.engine.backbone.shape.windowed
            and all(kv.k.shape[0] == heads for c in self.caches for kv in c.layers)
        )

    def _pack(self, layer: int) -> Packed:
        """The batch's buffers of one layer side by side in one buffer per tensor, each as
        wide as the widest rounded up to WIDTH, its free slots zero; each sequence's layer
        becomes a view of its part, so the rest of the engine sees its own cache as before.
        This copies the layer once per recording (not for a single sequence whose buffer is
        already that wide), and lets flash attention read the whole batch in one call."""
        kvs = [cache.layers[layer] for cache in self.caches]
        width = recordable_width(max(kv.capacity for kv in kvs))
        first, batch = kvs[0], len(kvs)
        if batch == 1 and first.capacity == width:
            first.k[:, first.length :].zero_()
            first.v[:, first.length :].zero_()
            k, v, pos = first.k, first.v, first.pos
        else:
            heads, _, dim = first.k.shape
            k = first.k.new_zeros((heads, batch * width, dim))
            v = first.v.new_zeros((heads, batch * width, dim))
            pos = first.pos.new_zeros((heads, batch * width))
            for b, kv in enumerate(kvs):
                start = b * width
                part = slice(start, start + kv.length)
                k[:, part], v[:, part], pos[:, part] = kv.keys(), kv.values(), kv.positions()
                whole = slice(start, start + width)
                kv.k, kv.v, kv.pos = k[:, whole], v[:, whole], pos[:, whole]
        device = k.device
        offsets = torch.arange(batch, dtype=torch.long, device=device) * width
        starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * width
        return Packed(k, v, pos, offsets, starts, width)

    def _flash_agrees(self) -> bool:
        """Whether flash attention with device lengths gives, on the first layer of the
        batch's own packed cache, what the matrix products give on each sequence's part (a
        torch without the entry point, or one that read past a length, would differ: the free
        slots hold zeros, which would get weight)."""
        pack, kvs = self.packed[0], [cache.layers[0] for cache in self.caches]
        if any(kv.length == 0 for kv in kvs):
            return False
        g = torch.Generator(device=pack.k.device).manual_seed(0)
        heads = self.engine.backbone.shape.num_heads
        q = torch.randn(len(kvs), heads, pack.k.shape[2], generator=g, device=pack.k.device)
        q = q.to(pack.k.dtype)
        want = torch.stack([
            matmul_decode_attention(
                q[b, :, None], kv.k, kv.v, per_head=False,
                live=torch.tensor([kv.length], device=kv.k.device),
            )[:, 0]
            for b, kv in enumerate(kvs)
        ]).float()  # fmt: skip
        live = torch.tensor([kv.length for kv in kvs], dtype=torch.int32, device=q.device)
        try:
            got = live_flash_decode_attention(
                q, pack.k, pack.v, live, (self.query_starts, pack.starts), pack.width
            )
        except (RuntimeError, TypeError) as error:  # not in this torch, or not for this shape
            _give_up_flash(pack.k, str(error).splitlines()[0])
            return False
        gap, scale = (got.float() - want).abs().max().item(), want.abs().max().item()
        if gap <= 1e-2 * max(1.0, scale):
            return True
        _give_up_flash(pack.k, f"it differed from the matrix products by {gap:.3g} here")
        return False

    def _record(self) -> None:
        """Record one step as a CUDA graph. A first run on a side stream sets up what
        recording cannot (cuBLAS's workspace, the rotary table); its advance is undone, and
        the slot it wrote is written again by the first real step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.live -= 1
        self.positions -= 1
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()  # recorded, not run


def _give_up_flash(cache: torch.Tensor, why: str) -> None:
    """Say once why recorded steps on this device and dtype attend by matrix products, and
    do not try flash attention there again."""
    log(f"recorded decode steps attend by matrix products, not flash attention: {why}")
    _NO_FLASH.add((cache.device, cache.dtype))


def why_not(engine: Stepper, policy: Policy, cache: KVCache, steps: int) -> str | None:
    """Why this sequence cannot decode through a recorded step; None if it can."""
    refusal = own_cache_only(policy, engine.depth)
    if refusal is not None:
        return f"{refusal}, which a recorded step cannot follow"
    for layer, (_, _, keeps) in enumerate(decode_plan(policy, engine.depth)):
        if not keeps:
            return f"layer {layer} does not append its own K/V during decode"
    short = [i for i, kv in enumerate(cache.layers) if kv.capacity < kv.length + steps]
    if short:
        return (
            f"layers {short[:4]} have no room for {steps} more tokens: prefill with "
            f"spare >= {steps}"
        )
    return None
