"""SPEED -- Shallow Prefill, dEEp Decode (Oh et al., 2026).

Prompt tokens are computed and cached only in layers `< lcut`; decode-phase tokens run through
every layer. Three kinds of prompt position:

- anchors (`anchors=bos`: position 0, the BoS token; `first`: position 0 whatever it holds;
  `sink:K`: positions 0..K-1; `none`): full depth. `bos` needs a model whose prompts begin
  with its BoS token (SmolLM2's do); on one whose prompts do not (Qwen2.5's) it is an error,
  and the default is `NO_BOS_DEFAULT`, chosen by measurement (docs/qwen.md),
- the deep suffix (the last `deep` prompt tokens; `deep=header`: the chat template's
  generation header; `deep=turn`: the last message of a chat prompt and the header, so a
  document in an earlier turn stays shallow and the question is deep): treated as
  decode-phase tokens, so the first new token's logits come from a full-depth state,
- strided tokens (`stride=S`, off by default): every S-th prompt position (S-1, 2S-1, ...)
  also runs full depth, a variant a trained model can use to carry the prompt's content into
  the upper layers for S-th of their cache (at S=40 on SmolLM2 at lcut 22, KV x0.740 instead
  of x0.733),
- shallow tokens: every other prompt position, never computed in layers `>= lcut`.

In upper layers a query therefore sees earlier anchors and earlier deep/generated tokens only,
because that is all those layers ever hold. On a model with sliding-window layers every layer
keeps its window by absolute position, above the cut as below it: an upper windowed layer sees
the full-depth rows inside its window, so an anchor leaves its view exactly when it would
leave stock attention's. There, a prompt too short for its anchors to have left the widest
window W before its deep suffix starts (prompt - deep < W + anchors - 1) runs wholly at full
depth: SPEED then never needs an anchor and the deep rows in one window. That makes an upper
windowed layer's view a run of consecutive full-depth rows, which paged attention kernels
(vLLM's) compute exactly with their own window (`SpeedRule.deep_for`).

A SPEED cache does not depend on what follows it, so it can be reused: a prompt that extends a
cached prefix (another question about a cached document, the next turn of a chat) prefills
only its new tokens, with the rule applied to them. A token keeps the depth it was first
computed at. `selfonly=true` is the paper's SelfOnly ablation:
upper-layer decode-phase tokens see only themselves (and the anchors), so their upper-layer K/V
is never cached. Position ids are never renumbered.

`lcut` defaults to round(0.75 * L), the paper's operating point (24 of 32 layers).

`SpeedRule` is the rule itself (which positions run full depth, what each may see); the
policy here, the dense reference and SPEED-aware training (speedkv.analysis.dense), choose-lcut
and the diagnostic all follow it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from speedkv.core.cache import KVCache
from speedkv.core.policy import LayerView, Policy, PromptInfo, Stream
from speedkv.core.prefix import CachedPrefix
from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.hf.backbone import in_window

DEEP_RULE = "deep must be a token count >= 1, 'header' or 'turn'"
# The default deep suffix: the last 64 prompt tokens run every layer. A prompt of up to 64
# tokens (a short chat turn) then runs at full depth and answers as full attention does, and
# most of the continuation gap closes, for 63 more rows per upper layer than deep=1 (KV x0.738
# instead of x0.733 at 4K on SmolLM2 at lcut 22).
# The paper's suffix is deep=1. Evidence: docs/ruler.md, "SPEED's deep suffix".
DEFAULT_DEEP = 64


@dataclass(frozen=True)
class SpeedRule:
    """Which positions run which layers under SPEED, and which keys each may see.

    Layers `< lcut` run every position; layers `>= lcut` run only the full-depth positions
    (anchors, the deep suffix, every generated token), causal among themselves. lcut = the
    model's layer count is full attention.

    A layer with a sliding window (`ModelShape.window`) applies it by absolute position on
    top of that, whichever side of the cut it is on: a query at position t sees only keys
    at positions > t - window (`in_window`, transformers' rule). Below the cut this is the
    stock model's attention; above it, the full-depth rows inside the window, so anchors
    drop out of a windowed upper layer's view exactly as they drop out of stock attention's.
    Positions are never renumbered, so the window never stretches over the shallow rows an
    upper layer does not hold.
    """

    lcut: int  # layers every position runs
    anchors: int = 1  # leading positions kept at full depth
    deep: int | str = DEFAULT_DEEP  # last prompt tokens kept at full depth, "header" or "turn"
    selfonly: bool = False  # upper-layer deep tokens see only themselves and the anchors
    window: int | None = None  # the model's widest sliding window (ModelShape.largest_window)
    stride: int = 0  # every stride-th prompt position also runs full depth (0: none)

    def __post_init__(self):
        if self.stride < 0 or self.stride == 1:
            raise UserError(
                f"stride must be 0 (off) or at least 2 (1 would be full depth), got {self.stride}"
            )
        if isinstance(self.deep, int) and self.deep < 1:
            raise UserError(DEEP_RULE + f", got {self.deep}")
        if isinstance(self.deep, str) and self.deep not in ("header", "turn"):
            raise UserError(DEEP_RULE + f", got '{self.deep}'")

    @classmethod
    def full(cls, num_layers: int) -> SpeedRule:
        """Full attention: every position runs every layer."""
        return cls(num_layers, anchors=0)

    @classmethod
    def of(cls, policy: Policy) -> SpeedRule:
        """The rule a `speed` or `full` policy follows."""
        if isinstance(policy, Speed):
            return policy.rule
        if policy.name == "full":
            return cls.full(policy.shape.num_layers)
        raise UserError(f"method '{policy.name}' has no SPEED rule; only 'full' and 'speed' do")

    def at(self, lcut: int) -> SpeedRule:
        """The same rule with another cutoff."""
        return dataclasses.replace(self, lcut=lcut)

    def deep_tokens(self, header_tokens: int | None, turn_tokens: int | None = None) -> int:
        """D for one prompt: the option, or the length of its chat generation header
        (`header`) or of its last message and header (`turn`); 1 where the prompt has none
        (raw text, or a document cached without a question)."""
        if self.deep == "header":
            return max(1, header_tokens or 1)
        if self.deep == "turn":
            return max(1, turn_tokens or 1)
        return int(self.deep)

    def deep_for(self, prompt_len: int, deep: int) -> int:
        """The deep suffix a prompt of `prompt_len` tokens runs with: `deep`, or the whole
        prompt on a model with a sliding window when an anchor would still be inside the
        window of its first deep token (prompt_len - deep < window + anchors - 1). Then
        no upper windowed layer ever shows a deep row an anchor together with deep rows, and
        its view stays a run of consecutive rows; a longer prompt's anchors have left every
        window by the deep suffix, as they leave stock attention's."""
        if (
            self.window is not None
            and self.anchors
            and prompt_len - deep < (self.window + self.anchors - 1)
        ):
            return prompt_len
        return deep

    def full_depth(self, positions: torch.Tensor, prompt_len: int, deep: int) -> torch.Tensor:
        """Bool, shaped like `positions`: the anchors, the last `deep` prompt tokens (the
        whole prompt where `deep_for` says so), every `stride`-th prompt position and every
        later (generated) position."""
        deep = self.deep_for(prompt_len, deep)
        keep = (positions < self.anchors) | (positions >= prompt_len - deep)
        if self.stride:
            keep |= positions % self.stride == self.stride - 1
        return keep

    def visibility(
        self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        """Bool [n_q, n_k]: the keys a query may see in `layer`, among the rows that layer
        holds: every earlier position inside the layer's sliding `window`
        (`ModelShape.window(layer)`; None: no window); in upper layers under SelfOnly a deep
        token sees only itself and the anchors (an anchor sees what it would anyway)."""
        causal = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            causal &= in_window(window, q_pos, k_pos)
        if layer < self.lcut or not self.selfonly:
            return causal
        q_anchor = q_pos[:, None] < self.anchors
        own = k_pos[None, :] == q_pos[:, None]
        return causal & (q_anchor | own | (k_pos[None, :] < self.anchors))

    def upper_visibility(
        self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None
    ) -> torch.Tensor:
        """`visibility` in the layers `>= lcut` (of one with this `window`)."""
        return self.visibility(self.lcut, q_pos, k_pos, window)

    def rows_held(self, layer: int, prompt_len: int, window: int | None = None) -> int:
        """Prompt rows `layer` (of this sliding `window`) holds for the first generated token,
        with the option's deep suffix: the ones it computed that the token may see."""
        keys = torch.arange(prompt_len)
        held = self.visibility(layer, torch.tensor([prompt_len]), keys, window)[0]
        if layer >= self.lcut:
            held &= self.full_depth(keys, prompt_len, self.deep_tokens(None))
        return int(held.sum())


@register
class Speed(Policy):
    name = "speed"
    degenerate_specs = ("speed:lcut={L},anchors=bos", "speed:lcut={L},anchors=none,deep=5")
    reusable = True  # depth is decided by position, never by what follows

    @dataclass
    class Config:
        lcut: int | None = None
        anchors: str | None = None  # bos where the model has one, else NO_BOS_DEFAULT
        deep: int | str = DEFAULT_DEEP
        selfonly: bool = False
        stride: int = 0  # every stride-th prompt token at full depth too (0: off)

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        layers = shape.num_layers
        if config.lcut is None:
            config.lcut = round(0.75 * layers)
        if not 0 <= config.lcut <= layers:
            raise UserError(
                f"lcut must be between 0 and {layers} for this model, got {config.lcut}"
            )
        config.anchors = resolve_anchors(config.anchors, shape)
        self.rule = SpeedRule(
            config.lcut,
            parse_anchors(config.anchors),
            config.deep,
            config.selfonly,
            shape.largest_window,
            config.stride,
        )
        self.prompt_len, self.deep = 0, 1  # of the sequence being prefilled (set by begin)

    @property
    def lcut(self) -> int:
        return self.config.lcut

    def spec(self) -> str:
        # stride=0 is left out, so the spec of plain SPEED stays what records and boards name
        spec = super().spec()
        return spec.replace(",stride=0", "") if not self.config.stride else spec

    def begin(self, prompt: PromptInfo) -> None:
        self.prompt_len = prompt.end
        deep = self.rule.deep_tokens(prompt.header_tokens, prompt.turn_tokens)
        self.deep = self.rule.deep_for(prompt.end, deep)

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        if layer != self.lcut:  # above the cut the stream holds only full-depth rows already
            return None
        return self.rule.full_depth(stream.pos, self.prompt_len, self.deep)

    def visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        if not self.config.selfonly or layer < self.lcut:
            return None  # plain causal attention (in the layer's window) over what it holds
        return self.rule.upper_visibility(q_pos, k_pos, self.shape.window(layer))

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        if not self.config.selfonly or layer < self.lcut:
            return None
        # nobody will ever read an upper deep token's K/V
        return view.kv.positions()[0] < self.rule.anchors

    def keeps_decode_kv(self, layer: int) -> bool:
        return not (self.config.selfonly and layer >= self.lcut)

    def prefix_from_full(
        self,
        full: CachedPrefix,
        header_tokens: int | None = None,
        turn_tokens: int | None = None,
    ) -> CachedPrefix:
        """What a SPEED prefill of `full.ids` holds before its deep suffix, taken from a
        full-attention cache of the same prompt, with no layer computed: the lower layers
        compute every prompt token as full attention does, and the anchors, a prefix of the
        prompt, see in the upper layers what they would under full attention (themselves).
        A request for the same ids with this as its prefix computes only the deep suffix, so
        one full prefill serves every cutoff and anchor choice (exact up to rounding)."""
        if full.method != "full":
            raise UserError(
                f"a SPEED cache is taken from a full-attention one, not '{full.method}'"
            )
        if self.config.selfonly:
            raise UserError("selfonly=true runs its own prefill; it is not taken from full's")
        if self.config.stride:
            # a strided row's upper layers see only full-depth rows, not full attention's
            raise UserError("stride runs its own prefill; it is not taken from full's")
        tokens = self.rule.deep_tokens(header_tokens, turn_tokens)
        deep = self.rule.deep_for(len(full.ids), tokens)
        # a prompt that runs wholly at full depth (deep_for) is the anchors, then deep rows
        kept = len(full.ids) - deep if deep == tokens else self.rule.anchors
        if not self.rule.anchors <= kept < len(full.ids):
            raise UserError(f"a {len(full.ids)}-token prompt has no room for anchors and deep")
        # lower layers are shared, not copied: a request extending a prefix copies what it reads
        layers = [
            kv if layer < self.lcut else kv.prefix(self.rule.anchors, 0)
            for layer, kv in enumerate(full.cache.layers)
        ]
        return CachedPrefix(full.ids[:kept], self.spec(), KVCache(layers), full.messages)


# The anchor a model without a BoS token gets by default (Qwen2.5's chat prompts begin
# `<|im_start|>system\nYou`): the first four tokens tie with the first one on needles and
# fidelity and keep short chat answers closer to full's (docs/qwen.md).
NO_BOS_DEFAULT = "sink:4"
ANCHOR_CHOICES = "'bos', 'first', 'none' or 'sink:K' with K >= 1"


def resolve_anchors(value: str | None, shape) -> str:
    """The anchors SPEED runs with on a model of `shape`: the default for None (`bos` where
    the model's prompts begin with a BoS token, else NO_BOS_DEFAULT); `bos` on a model whose
    prompts do not is an error rather than an anchor on whatever token comes first."""
    if value is None:
        return "bos" if shape.starts_with_bos else NO_BOS_DEFAULT
    parse_anchors(value)
    if value == "bos" and not shape.starts_with_bos:
        raise UserError(
            "anchors=bos needs a BoS token, and this model's prompts do not begin with one; "
            f"use anchors=first (position 0, whatever token it holds), sink:K or none (the "
            f"default here is {NO_BOS_DEFAULT})"
        )
    return value


def parse_anchors(value: str) -> int:
    """'bos' and 'first' -> 1, 'none' -> 0, 'sink:K' -> K: the number of leading full-depth
    positions."""
    if value in ("bos", "first"):
        return 1
    if value == "none":
        return 0
    kind, _, count = value.partition(":")
    if kind == "sink" and count.isdigit() and int(count) >= 1:
        return int(count)
    raise UserError(f"anchors must be {ANCHOR_CHOICES}, got '{value}'")
