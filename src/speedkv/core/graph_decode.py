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
  length, a device tensor: two matrix products that mask the rest
  (`attention.matmul_decode_attention` with `live`), or, asked for (`flash`), flash
  attention's variable-length form on a GPU in half precision where it gives the same output
  on the batch's own cache; the buffer is widened to a multiple of WIDTH and its free slots
  are zeroed first, so the masked ones are finite;
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
# devices and dtypes where flash attention with a device length failed: not tried again
_NO_FLASH: set[tuple[torch.device, torch.dtype]] = set()


class Stepper(Protocol):
    """What a recorded step needs of the engine (core/engine.py records through this module,
    so it is named by what it offers, not imported)."""

    backbone: Any
    depth: int
    device: torch.device


class GraphDecode:
    """`steps` decode steps for a fixed batch of prefilled caches, recorded as one CUDA graph
    on a GPU (`record`, default: on CUDA) and run eagerly elsewhere. `flash`: attend by flash
    attention with a device length where it matches the matrix products (`attention` says
    which runs)."""

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
        for cache in caches:
            for kv in cache.layers:
                kv.grow_to(-(-kv.capacity // WIDTH) * WIDTH)
                kv.k[:, kv.length :].zero_()  # masked slots get weight 0: it must not meet NaN
                kv.v[:, kv.length :].zero_()
        self.tokens = torch.zeros(len(caches), dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.live = torch.tensor([c.lengths() for c in caches], dtype=torch.long, device=device)
        self.bound = max(positions) + steps + 1  # above every position the steps will see
        # flash's int32 offsets of a buffer of each width, and of the query (made before any
        # recording: a recording cannot copy from the host)
        widths = {kv.capacity for cache in caches for kv in cache.layers} if flash else ()
        self.starts = {w: torch.tensor([0, w], dtype=torch.int32, device=device) for w in widths}
        self.query_start = torch.tensor([0, 1], dtype=torch.int32, device=device)
        # flash's window is by slot, and an upper SPEED layer's slots skip positions
        windowed = engine.backbone.shape.windowed
        self.attention = "flash" if flash and not windowed and self._flash_agrees() else "matmul"
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
        for layer in range(self.engine.depth):
            q, k, v = bb.before_attention(layer, h, cos, sin)  # [B, heads, 1, D]
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
                outs.append(self._attend(q[b], kv.k, kv.v, slot + 1, visible))
            h = bb.after_attention(layer, h, torch.stack(outs))
        self.live += 1
        self.positions += 1
        return bb.logits(bb.final_norm(h[:, -1]))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        live: torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.attention == "flash":  # never with a window (see __init__)
            starts = (self.query_start, self.starts[k.shape[1]])
            return live_flash_decode_attention(q, k, v, live.to(torch.int32), starts)
        return matmul_decode_attention(q, k, v, live=live, visible=visible)

    def _flash_agrees(self) -> bool:
        """Whether flash attention with a device length may run this batch's attention: a
        half-precision cache on a GPU, and on the first layer's own buffer the same output as
        the matrix products (a torch without the entry point, or one that read past the
        length, would differ: the free slots hold zeros, which would get weight)."""
        kv = self.caches[0].layers[0]
        if not flash_takes(kv.k) or kv.length == 0 or (kv.k.device, kv.k.dtype) in _NO_FLASH:
            return False
        g = torch.Generator(device=kv.k.device).manual_seed(0)
        q = torch.randn(kv.k.shape[0], 1, kv.k.shape[2], generator=g, device=kv.k.device)
        q = q.to(kv.k.dtype)
        live = torch.tensor([kv.length], device=kv.k.device)
        want = matmul_decode_attention(q, kv.k, kv.v, per_head=False, live=live).float()
        starts = (self.query_start, self.starts[kv.capacity])
        try:
            got = live_flash_decode_attention(q, kv.k, kv.v, live.to(torch.int32), starts)
        except (RuntimeError, TypeError) as error:  # not in this torch, or not for this shape
            _give_up_flash(kv.k, str(error).splitlines()[0])
            return False
        gap, scale = (got.float() - want).abs().max().item(), want.abs().max().item()
        if gap <= 1e-2 * max(1.0, scale):
            return True
        _give_up_flash(kv.k, f"it differed from the matrix products by {gap:.3g} here")
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
