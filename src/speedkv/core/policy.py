"""The method interface.

A method is a `Policy`: for one sequence it decides, layer by layer, which prompt tokens are
computed, which keys each query may see, and which K/V entries the cache keeps; the engine
carries out those decisions. Every hook has a full-attention default, so a method overrides
only what it changes. Methods register under a name and carry a dataclass `Config` whose
fields are the spec options:

    speed:lcut=22,anchors=bos        fastkv:tsp_layer=15,tsp_rate=0.2
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from speedkv.core.cache import LayerKV
from speedkv.core.spec import format_value
from speedkv.hf.backbone import ModelShape


@dataclass
class PromptInfo:
    """What a policy may know about the prompt before its prefill starts."""

    ids: torch.Tensor  # [n] token ids that will be prefilled
    header_tokens: int | None = None  # length of the chat template's generation header, if any
    positions: torch.Tensor | None = None  # absolute positions of `ids` (default 0..n-1)
    original_length: int | None = None  # prompt length before any token selection
    turn_tokens: int | None = None  # the last message's content through the header (chat)

    def __post_init__(self):
        if self.positions is None:
            self.positions = torch.arange(self.ids.shape[0], device=self.ids.device)
        if self.original_length is None:
            self.original_length = int(self.ids.shape[0])

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def end(self) -> int:
        """One past the last prompt position. When a request extends a cached prefix, `ids`
        are only its new tokens and `end` is where the whole prompt ends."""
        return int(self.positions[-1]) + 1 if self.n else 0


@dataclass
class Selection:
    """Prompt tokens a method prefills instead of the whole prompt (GemFilter, SpecPrefill)."""

    indices: torch.Tensor  # [k] sorted indices into the prompt
    positions: torch.Tensor  # [k] the positions they are prefilled at
    next_position: int  # where decoding continues


@dataclass
class Stream:
    """The residual-stream rows entering a layer during prefill (one sequence)."""

    h: torch.Tensor  # [n, hidden]
    pos: torch.Tensor  # [n] absolute positions, increasing


class LayerView(Protocol):
    """What a policy may inspect of a layer once its prefill attention is done."""

    layer: int
    kv: LayerKV  # the layer's entries (computed and synthesised), in the order written
    q_pos: torch.Tensor  # [n] positions of the rows computed in this layer

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-rotary queries [Hq, w, D] of the last w computed rows and their positions,
        w = the policy's `query_window(layer)`."""
        ...


class Policy:
    """Full attention. Subclasses override the hooks their method changes.

    A policy instance serves one sequence at a time. What it learns about that sequence
    (prompt length, scores, selections) lives on the instance, set in `select_prompt` or
    `begin`; its configuration (`config`, resolved by the constructor, and `shape`) never
    changes. The engine and the evaluation run every sequence on its own `fresh()` copy, so
    one configured policy can be handed to many requests.
    """

    name: ClassVar[str] = "full"
    # Specs at which the method must equal full attention exactly (same tokens, logits to float
    # tolerance). The tests check each one, and its canonical-spec round trip, for every
    # registered method, so every method declares its own right after `name` (an empty tuple
    # says that no setting reduces to full). Placeholders, filled in for the model and prompt
    # under test: {L} = the model's layer count, {T} = prompt + new tokens (a token budget
    # that covers everything the cache will ever hold).
    degenerate_specs: ClassVar[tuple[str, ...]] = ("full",)
    # Whether a cache this method built can serve other prompts that extend it (other
    # questions about a cached document, later turns of a chat): only when what the cache
    # holds does not depend on the end of the prompt. Methods that choose what to keep by
    # looking at the question (SnapKV, FastKV, ...) must leave this False; the engine then
    # refuses to reuse their caches.
    reusable: ClassVar[bool] = False

    @dataclass
    class Config:
        pass

    def __init__(self, config: Any, shape: ModelShape):
        self.config = config
        self.shape = shape

    def fresh(self) -> Policy:
        """A new instance for one sequence, from the same resolved config and shape."""
        return type(self)(dataclasses.replace(self.config), self.shape)

    # -- identity ------------------------------------------------------------------------------
    def spec(self) -> str:
        """Canonical spec: the name and every option with its resolved value."""
        fields = dataclasses.fields(self.config)
        if not fields:
            return self.name
        opts = ",".join(f"{f.name}={format_value(getattr(self.config, f.name))}" for f in fields)
        return f"{self.name}:{opts}"

    def summary(self) -> dict:
        """What the method kept or chose for the last prompt, for reports (JSON-able)."""
        return {}

    def external_models(self) -> list[str]:
        """Models other than the engine's own that the method would load (embedded names,
        HF directories or GGUF files): a server refuses them in per-request methods."""
        return []

    # -- before prefill ----------------------------------------------------------------------
    def select_prompt(self, prompt: PromptInfo, engine: Any) -> Selection | None:
        """Choose a subset of prompt tokens (and their positions) to prefill; None keeps all.

        `engine` can run probes (the model's own first layers, or a speculator)."""
        return None

    def begin(self, prompt: PromptInfo) -> None:
        """Called once per sequence before its prefill (after any prompt selection)."""

    # -- prefill, per layer ------------------------------------------------------------------
    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        """Rows of `stream` that run layer `layer` (bool [n]); None means all of them.

        Rows not selected leave the residual stream for good: they are not computed in this
        layer or any later one.
        """
        return None

    def exited_kv(self, layer: int) -> int | None:
        """For rows that left the stream: None means they have no K/V in `layer`; an index n
        means their K/V here are projected from the residual they left with, normed by layer
        n's input norm (POP: n = layer; SwiftKV: n = its cut layer)."""
        return None

    def kv_input(self, layer: int) -> tuple[int, int] | None:
        """For computed rows and decode tokens: None means K/V come from the layer's own
        input; (src, n) means they are projected from the residual entering layer `src`,
        normed by layer n's input norm (SwiftKV's single input)."""
        return None

    def kv_owner(self, layer: int) -> int:
        """The layer whose cache (and K/V projection) `layer` uses; itself unless caches are
        shared across layers (SwiftKV's AcrossKV)."""
        return layer

    def visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Extra visibility rule on top of causality: bool [n_q, n_k], True where a query
        may see a key. None means plain causal attention over what the layer holds."""
        return None

    def query_window(self, layer: int) -> int:
        """How many of the layer's last query rows `observe`/`kept` want to see (0 = none)."""
        return 0

    def observe(self, layer: int, view: LayerView) -> None:
        """Called after a layer's prefill attention (scores for later decisions)."""

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        """Which of the layer's entries the cache keeps: bool [m] over entries in the order
        written, or index [heads, m] per head (heads = KV heads, or query heads for per-query-
        head retention); None keeps all of them."""
        return None

    # -- decode --------------------------------------------------------------------------------
    def keeps_decode_kv(self, layer: int) -> bool:
        """Whether a decode-phase token's K/V in `layer` stays in the cache for later tokens."""
        return True

    def after_decode(self, layer: int, q: torch.Tensor, kv: LayerKV) -> None:
        """Called after a decode token attended in `layer` (q: [Hq, 1, D]); eviction goes here."""


def own_cache_only(policy: Policy, depth: int) -> str | None:
    """Why a policy's decode does more than write each token's K/V into each layer's own cache
    (K/V computed from another layer's input, a cache shared between layers, eviction after a
    step); None when that is all it does."""
    if type(policy).after_decode is not Policy.after_decode:
        return "it changes its cache during decode"
    for layer, (owner, kv_input, _) in enumerate(decode_plan(policy, depth)):
        if owner != layer or kv_input is not None:
            return f"layer {layer} does not append its own K/V during decode"
    return None


def decode_plan(policy: Policy, depth: int) -> list[tuple[int, tuple[int, int] | None, bool]]:
    """Per layer: (cache owner, K/V input, keeps decode K/V); fixed for a policy, so cached."""
    plan = getattr(policy, "_decode_plan", None)
    if plan is None or len(plan) != depth:
        plan = [
            (policy.kv_owner(layer), policy.kv_input(layer), policy.keeps_decode_kv(layer))
            for layer in range(depth)
        ]
        policy._decode_plan = plan
    return plan
