"""Layer-major prefill of one prompt under a method's policy.

The prompt's rows flow up the layers as a residual stream. Before each layer the policy may
drop rows (`computed`): SPEED drops its shallow tokens at `lcut`, FastKV keeps its selected
tokens after the TSP layer. Dropped rows are never computed again; a policy may still give
them K/V in later layers, projected from the residual they left with (POP, SwiftKV).

Within a layer the computed rows go through in chunks of `Chunks.rows` rows, each chunk's
K/V written straight into the layer's cache buffer before it attends, so activation memory
does not grow with the prompt. Attention never materialises an N x N matrix: a layer that
needs an explicit mask attends `Chunks.masked` queries at a time. After the
layer, the policy may look at its queries and keys (`observe`) and choose what the cache
keeps (`kept`). A layer with a sliding window attends only inside it, by absolute position,
in every layer and under every method (`ModelShape.window`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.cache import KVCache, LayerKV
from speedkv.core.graph_decode import recordable_width
from speedkv.core.policy import Policy, PromptInfo, Stream
from speedkv.hf.backbone import Backbone, in_window
from speedkv.kernels.attention import prefill_attention


@dataclass
class Prefill:
    """A prompt's prefill: its cache, the last computed position's logits, the work it took."""

    cache: KVCache
    logits: torch.Tensor  # [vocab] float32
    hidden: torch.Tensor  # [hidden] the last computed row's final (normed) hidden state
    next_position: int  # position of the first generated token
    rows: list[int]  # tokens computed in each layer
    pairs: list[int]  # query-key pairs attended in each layer


@dataclass(frozen=True)
class Chunks:
    """How many rows a prefill handles per call."""

    rows: int  # projections and MLP
    masked: int  # attention through an explicit mask, which holds masked x keys entries

    def __post_init__(self):
        if self.rows < 1 or self.masked < 1:
            raise ValueError(f"chunk sizes must be positive, got {self}")


@dataclass
class _Exit:
    layer: int  # the first layer these rows were not computed in
    h: torch.Tensor  # the residual they left with
    pos: torch.Tensor


class _View:
    """A finished layer as policies see it (see policy.LayerView)."""

    def __init__(self, layer: int, kv: LayerKV, q_pos: torch.Tensor, q_tail, q_tail_pos):
        self.layer, self.kv, self.q_pos = layer, kv, q_pos
        self._q, self._q_pos = q_tail, q_tail_pos

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._q, self._q_pos


class PrefillRun:
    """The state of one prompt's prefill while it climbs the layers."""

    def __init__(
        self,
        backbone: Backbone,
        policy: Policy,
        depth: int,
        chunks: Chunks,
        spare: int,
        base: KVCache | None = None,
        start: int = 0,
    ):
        self.bb, self.policy, self.depth = backbone, policy, depth
        self.chunks, self.spare = chunks, spare
        # extending a cached prefix: every layer starts from a copy of `base`'s entries at
        # positions < start, and the new rows attend to them
        self.base, self.start = base, start
        self.shape = backbone.shape
        self.exits: list[_Exit] = []
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: list[LayerKV] = []
        self.rows: list[int] = []
        self.pairs: list[int | torch.Tensor] = []
        self._rope_of: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def run(self, prompt: PromptInfo, next_position: int) -> Prefill:
        policy, bb = self.policy, self.bb
        sources = {
            src for layer in range(self.depth) if (ki := policy.kv_input(layer)) for src in ki[:1]
        }
        h, pos = bb.embed(prompt.ids), prompt.positions
        self.bound = next_position  # above every prompt position: rope tables need no read-back
        for layer in range(self.depth):
            selected = policy.computed(layer, Stream(h, pos))
            if selected is not None and not bool(selected.all()):
                self.exits.append(_Exit(layer, h[~selected], pos[~selected]))
                h, pos = h[selected], pos[selected]
            if pos.numel() == 0:
                raise RuntimeError(f"method {policy.spec()} left no token in layer {layer}")
            if layer in sources:
                self.saved[layer] = (h, pos)
            h = self._layer(layer, h, pos)
        hidden = bb.final_norm(h[-1:])
        logits = bb.logits(hidden)[0]
        return Prefill(
            KVCache(self.layers), logits, hidden[0], next_position, self.rows, self._pairs()
        )

    def _pairs(self) -> list[int]:
        """Pairs attended per layer. Masked layers counted theirs on the device; they are read
        back once here, not once per chunk (each read waits for a GPU)."""
        counted = [p for p in self.pairs if isinstance(p, torch.Tensor)]
        values = iter(torch.stack(counted).tolist() if counted else [])
        return [int(next(values)) if isinstance(p, torch.Tensor) else p for p in self.pairs]

    def _layer(self, layer: int, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bb, policy, shape = self.bb, self.policy, self.shape
        owner = policy.kv_owner(layer)
        writes = owner == layer
        if writes:
            synthesised = list(self._exited_kv(layer))
            extra = sum(p.numel() for _, _, p in synthesised)
            room = extra + h.shape[0] + self.spare
            if h.device.type == "cuda":  # as wide as a recorded step takes it: no copy then
                room = recordable_width(room)
            if self.base is not None:
                kv = self.base.layers[layer].prefix(self.start, room)
            else:
                kv = LayerKV(shape.num_kv_heads, room, shape.head_dim, bb.dtype, h.device)
            for k, v, p in synthesised:
                kv.extend(k, v, p)
            aligned = kv.length == 0  # entries will be exactly the computed rows, in order
        else:
            kv, aligned = self.layers[owner], False
        kv_input = policy.kv_input(layer)
        window = policy.query_window(layer)
        rows = h.shape[0]
        cos, sin = self._rope(pos)
        queries = []
        for start, end in self._chunks(rows):  # projections, chunk by chunk
            c, s = cos[start:end], sin[start:end]
            if kv_input is None and writes:
                q, k, v = bb.before_attention(layer, h[start:end], c, s, prefill=True)
            else:
                q = bb.q(layer, bb.input_norm(layer, h[start:end]), c, s)
                if writes:
                    src, norm = kv_input
                    h_src, pos_src = self.saved[src]
                    picked = torch.searchsorted(pos_src, pos[start:end])
                    k, v = bb.kv(layer, bb.input_norm(norm, h_src[picked]), c, s)
            if writes:
                kv.extend(k, v, pos[start:end])
            queries.append(q)
        q_all = joined(queries, dim=1)
        o_all, attended = self._attend(layer, q_all, pos, kv, aligned)
        out = joined(  # output projection and MLP, chunk by chunk
            [
                bb.after_attention(layer, h[start:end], o_all[:, start:end], prefill=True)
                for start, end in self._chunks(rows)
            ]
        )
        q_tail = q_all[:, -window:] if window else None
        view = _View(layer, kv, pos, q_tail, pos[-q_tail.shape[1] :] if window else None)
        policy.observe(layer, view)
        if writes:
            keep = policy.kept(layer, view)
            if keep is not None:
                kv.keep(keep.nonzero()[:, 0] if keep.dtype == torch.bool else keep)
        self.layers.append(kv)
        self.rows.append(int(pos.numel()))
        self.pairs.append(attended)
        return out

    def _attend(
        self, layer: int, q: torch.Tensor, pos: torch.Tensor, kv: LayerKV, aligned: bool
    ) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Attention of every computed row; returns the output and the pairs attended (a count
        still on the device where a mask was summed).

        When the layer holds exactly the computed rows in order and the policy adds no
        visibility rule, one causal call covers the whole layer: the fused kernel works
        block by block and never materialises the score matrix, and one call is markedly
        faster on CPU than chunked calls with an offset causal mask. Otherwise queries go in
        chunks with an explicit mask by position.

        A layer with a sliding window whose rows span more than the window also goes in
        masked chunks (neither the native kernel nor the one causal call applies a window);
        where the entries are in position order each chunk reads only the slots from its
        first query's window to its last query, so attention costs rows x window, not
        rows x rows.
        """
        rows = q.shape[1]
        k_pos = kv.positions()[0]
        has_rule = self.policy.visible(layer, pos[:1], k_pos) is not None
        window = self.shape.window(layer)
        # positions increase along the stream; the first key is the earliest unless the
        # entries are out of order, so take the least (one read per layer)
        bites = window is not None and int(pos[-1]) - int(k_pos.min()) >= window
        if aligned and not has_rule and not bites:
            return prefill_attention(q, kv.keys(), kv.values()), rows * (rows + 1) // 2
        out, attended = torch.empty_like(q), torch.zeros((), dtype=torch.long, device=q.device)
        for start, end in self._chunks(rows, self.chunks.masked):
            lo, hi = 0, kv.length
            if bites and kv.in_order():  # only the slots some query of the chunk can see
                lo = kv.window_start(int(pos[start]) - window + 1)
                hi = kv.window_start(int(pos[end - 1]) + 1)
            keys, values, chunk_pos = kv.k[:, lo:hi], kv.v[:, lo:hi], k_pos[lo:hi]
            mask = chunk_pos[None, :] <= pos[start:end, None]
            if bites:
                mask &= in_window(window, pos[start:end], chunk_pos)
            visible = self.policy.visible(layer, pos[start:end], chunk_pos)
            if visible is not None:
                mask &= visible
            out[:, start:end] = prefill_attention(q[:, start:end], keys, values, mask)
            attended += mask.sum()
        return out, attended

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the stream's positions: gathered once while the stream keeps its rows."""
        if self._rope_of is None or self._rope_of[0] is not pos:
            self._rope_of = (pos, *self.bb.rope(pos, bound=self.bound))
        return self._rope_of[1], self._rope_of[2]

    def _chunks(self, rows: int, size: int | None = None):
        size = size or self.chunks.rows
        for start in range(0, rows, size):
            yield start, min(start + size, rows)

    def _exited_kv(self, layer: int):
        """K/V of rows that left the stream, if the policy gives them any in this layer."""
        norm = self.policy.exited_kv(layer)
        if norm is None:
            return
        for gone in self.exits:
            for start, end in self._chunks(gone.pos.numel()):
                cos, sin = self.bb.rope(gone.pos[start:end], bound=self.bound)
                x = self.bb.input_norm(norm, gone.h[start:end])
                k, v = self.bb.kv(layer, x, cos, sin)
                yield k, v, gone.pos[start:end]


def joined(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The chunks' results as one tensor; a single chunk's as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
