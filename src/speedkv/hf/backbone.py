"""The only module that touches transformers' model internals.

The engine owns the decoder loop; this module hands it the pieces of a HuggingFace causal LM
(embedding, per-layer norms and projections, MLP, final norm, LM head, rotary tables) under
names that do not depend on the model family. Supported: Llama, Mistral, Qwen2, Qwen3 -- the
pre-norm, rotary, grouped-query decoders whose layers are `input_layernorm -> self_attn ->
residual -> post_attention_layernorm -> mlp -> residual` -- with or without sliding-window
attention (`ModelShape.windows`, read as transformers reads it: `sliding_windows`), and Gemma 3's
text model (`gemma3_text`), whose layers differ in ways this module absorbs:

- "sandwich" norms: `post_attention_layernorm` normalises attention's output before the
  residual add, and the MLP sits between `pre_feedforward_layernorm` and
  `post_feedforward_layernorm` (`attn_out`, `mlp_block`); its RMSNorms scale by 1 + weight
  and run as the model's own modules; the embedding module multiplies by sqrt(hidden_size);
- interleaved local (sliding-window) and global layers, each type with its own rotary base:
  `rope` returns one table per type side by side, and each layer takes its own (`_layer_rope`);
- the attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5: queries leave
  this module multiplied by the ratio, so every attention kernel's 1/sqrt(head_dim) gives the
  model's scale (and scores read from those queries are the model's);
- a final logit soft cap, applied in `logits` when the config sets one (Gemma 3's do not);
  an attention logit soft cap, which no attention kernel here applies, is refused.

Gemma 3 layers never run on `layer_work`'s fused functions or the native one-call decode layer
(`decode_dims` is None for them): those compute the Llama-shaped layer.

When a transformers release renames something, this is the file to change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from speedkv.errors import UserError
from speedkv.hf import layer_work
from speedkv.hf.fused import FusedProjection, linear_tensors
from speedkv.hf.int8 import Int8Linear
from speedkv.hf.layer_work import LayerDims, LayerTensors, apply_rope
from speedkv.kernels.catalogue import ONE_CALL_OPERATORS
from speedkv.kernels.config import TORCH_KERNELS, KernelConfig, NativeOps
from speedkv.kernels.linear import apply_linear, can_prepack, prepacked, tiles_take

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# families whose layers have Gemma's sandwich norms (see the module docstring)
SANDWICH_NORM_TYPES = ("gemma3_text",)
# The families' RMSNorm classes, which all compute weight * (x / rms(x) in float32, rounded to
# the input dtype); the decoder runs that as one fused kernel instead of the module's six ops.
T5_STYLE_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
FINGERPRINT_SAMPLES = 1024  # values read from each parameter
# config entries that say how the model was loaded or what it returns, not what it computes
NOT_FINGERPRINTED = {
    "dtype",
    "torch_dtype",
    "transformers_version",
    "architectures",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions every part of speedkv needs to know about a model."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    # whether this model's prompts begin with its BoS token (SPEED's `anchors=bos` needs one);
    # a model without a tokenizer takes the caller's ids, whose position 0 is taken on trust
    starts_with_bos: bool = True
    # each layer's sliding window (None: the layer attends to every earlier position), or ()
    # when no layer has one; a window is per layer so that models mixing local and global
    # layers (Qwen2's max_window_layers, or interleaved layer types) fit the same field
    windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window: a query at position t sees keys at positions
        t - window + 1 .. t (`in_window`); None for a layer without one."""
        return self.windows[layer] if self.windows else None

    @property
    def windowed(self) -> bool:
        """Whether any layer has a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def largest_window(self) -> int | None:
        """The widest sliding window of any layer; None where no layer has one."""
        return max((w for w in self.windows if w is not None), default=None)

    def kv_bytes_per_token_layer(self, dtype: torch.dtype) -> int:
        """Bytes of one token's key and value in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def check_supported(model_type: str) -> None:
    if model_type == "gemma3":  # Gemma 3 4B and larger: a vision tower around the text model
        raise UserError(
            "model architecture 'gemma3' is Gemma 3's image-text model; speedkv runs Gemma 3 "
            "text models (model_type gemma3_text, such as gemma-3-270m and gemma-3-1b)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"model architecture '{model_type}' is not supported; speedkv runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} decoders"
        )


def layer_types(config) -> list[str] | None:
    """Each layer's `layer_types` entry (`sliding_attention` or `full_attention`) as
    transformers derives it when a config has none, or None for a family that needs none.
    `config` may be a raw config.json read into a namespace (see `sliding_windows`)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    layers = config.num_hidden_layers
    if config.model_type in ("qwen2", "qwen3"):
        first = getattr(config, "max_window_layers", 28)  # transformers' default
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if config.model_type == "gemma3_text":
        # older Gemma 3 configs give the pattern: every `sliding_window_pattern`-th layer global
        pattern = getattr(config, "sliding_window_pattern", None) or 6  # transformers' default
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    return None


def sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers (5.x) applies it, or () when none has one.

    Mistral windows every layer when `sliding_window` is set (its modeling ignores
    `layer_types`). Qwen2 and Qwen3 window only when `use_sliding_window` is true, and then
    the layers `layer_types` names `sliding_attention`, which their configs derive as the
    layers from `max_window_layers` on. Gemma 3 windows the layers `layer_types` names
    `sliding_attention` (five local layers to one global in its checkpoints). `config` may be
    a transformers config or a raw config.json read into a namespace (the vLLM backend's), so
    the derivation is repeated here rather than read from attributes only a transformers
    config has."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None  # Qwen2.5 checkpoints carry a window they do not use
    if config.model_type == "llama" or window is None:
        return ()
    if int(window) < 1:
        raise UserError(f"the model's sliding_window must be a positive token count, got {window}")
    if config.model_type == "mistral":
        return (int(window),) * layers
    types = layer_types(config) or ["sliding_attention"] * layers
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in types)
    return windows if any(w is not None for w in windows) else ()


def in_window(window: int | None, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool [n_q, n_k]: which keys lie inside a query's sliding window, by absolute position.
    transformers' rule (masking_utils.sliding_window_overlay): key position > query position
    - window, so a query sees itself and the window - 1 positions before it. All True for a
    layer without a window."""
    if window is None:
        return torch.ones((q_pos.shape[0], k_pos.shape[0]), dtype=torch.bool, device=q_pos.device)
    return k_pos[None, :] > q_pos[:, None] - window


def check_gemma3(config) -> None:
    """Refuse, in one sentence each, the Gemma 3 options speedkv's engine does not compute: an
    attention logit soft cap (no attention kernel here applies one) and bidirectional
    attention (an encoder, not a causal LM)."""
    if config.model_type != "gemma3_text":
        return
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise UserError(
            f"this Gemma model caps attention logits (attn_logit_softcapping={cap}), which "
            "speedkv's attention kernels do not apply; Gemma 3 checkpoints set it to null"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UserError(
            "this Gemma model attends bidirectionally (use_bidirectional_attention=true): it "
            "is an encoder, and speedkv runs causal decoders only"
        )


def shape_of(config) -> ModelShape:
    check_supported(config.model_type)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        windows=sliding_windows(config),
    )


def enable_activation_checkpointing(hf_model: nn.Module) -> None:
    """transformers' own activation (gradient) checkpointing: each decoder layer's forward is
    recomputed in the backward pass instead of keeping its activations. It applies to every
    call of a layer, so `Backbone.hf_layer` (the training forward) is checkpointed too."""
    enable = getattr(hf_model, "activation_checkpointing_enable", None)  # the newer name
    enable = enable or hf_model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # the kwargs, first under either name


def is_t5_style_norm(norm: nn.Module) -> bool:
    return type(norm).__name__ in T5_STYLE_NORMS


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`, through torch's fused kernel when `norm` is one of the families' RMSNorms."""
    if not is_t5_style_norm(norm):
        return norm(x)
    return layer_work.rms_norm(x, norm.weight, norm.variance_epsilon)


def can_prepack_layer(weights: LayerTensors | None, ops: NativeOps = None) -> bool:
    return weights is not None and all(
        can_prepack(t, ops) for t in (weights.qkv, weights.o, weights.gate_up, weights.down)
    )


def prepack_layer(weights: LayerTensors, ops: NativeOps = None) -> LayerTensors:
    return dataclasses.replace(
        weights,
        qkv=prepacked(weights.qkv, ops),
        o=prepacked(weights.o, ops),
        gate_up=prepacked(weights.gate_up, ops),
        down=prepacked(weights.down, ops),
    )


def decode_dims(config, shape: ModelShape) -> LayerDims | None:
    """The layer constants of `layer_work`, or None when the model's layers are not the
    form it computes (another activation, per-head q/k norms, a norm eps it cannot find)."""
    eps = getattr(config, "rms_norm_eps", None)
    if getattr(config, "hidden_act", None) != "silu" or eps is None:
        return None
    if shape.model_type == "qwen3":  # per-head q/k norms run as the model's modules
        return None
    if shape.model_type in SANDWICH_NORM_TYPES:  # four norms a layer, (1 + weight), GELU
        return None
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    return LayerDims(float(eps), (q, kv, kv), shape.head_dim, shape.intermediate_size)


class Backbone:
    """A causal LM's pieces, addressed by layer index, for a decoder loop we run ourselves."""

    def __init__(self, hf_model: nn.Module, starts_with_bos: bool = True):
        self.hf_model = hf_model
        self.config = hf_model.config
        self.shape = dataclasses.replace(shape_of(self.config), starts_with_bos=starts_with_bos)
        check_gemma3(self.config)
        inner = hf_model.model
        self._embed = inner.embed_tokens  # Gemma's multiplies by sqrt(hidden_size) itself
        self.layers = inner.layers
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._lm_head = hf_model.lm_head
        self._sandwich = self.shape.model_type in SANDWICH_NORM_TYPES
        # the rotary tables `rope` returns side by side (None: the model has one, called
        # without a layer type), and which of them each layer takes
        types = layer_types(self.config) if self._sandwich else None
        self._rope_kinds: tuple[str | None, ...] = tuple(sorted(set(types))) if types else (None,)
        self._rope_slot = [self._rope_kinds.index(t) for t in types] if types else None
        # the model's attention scale; every attention kernel here divides by sqrt(head_dim),
        # so queries are multiplied by the ratio of the two (None where they are equal)
        pre_attn = getattr(self.config, "query_pre_attn_scalar", None) if self._sandwich else None
        self.scaling = (pre_attn or self.shape.head_dim) ** -0.5
        ratio = self.scaling * self.shape.head_dim**0.5
        self._q_scale = None if ratio == 1.0 else ratio
        self._final_softcap = getattr(self.config, "final_logit_softcapping", None)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused: dict[int, tuple[FusedProjection, FusedProjection]] = {}
        self._decode_weights: list[LayerTensors | None] | None = None
        self._plain_weights: list[LayerTensors | None] = []  # as loaded, for prefill chunks
        self._weights_key: tuple[int, ...] = ()
        self._dims = decode_dims(self.config, self.shape)
        self.prepacked = False
        self._packed_head: tuple[torch.Tensor | None, ...] | None = None
        # the kernels the engine chose (its native operations, which decode batches run on
        # the prepacked copy, when products run in float32): handed over by `use_kernels`
        self.kernels: KernelConfig = TORCH_KERNELS
        self._tiles_take_all = False  # every packed copy is one the tile kernel takes
        # every layer's weights as `decode_layer` takes them, where all are packed by speedkv
        self._native_layers: list[tuple[list, list]] | None = None

    def use_kernels(self, kernels: KernelConfig) -> None:
        """Run on the kernels the engine chose (kernels/tuning.py's `engine_config`)."""
        self.kernels = kernels

    @property
    def native_ops(self) -> NativeOps:
        """speedkv's native CPU operations (torch.ops.speedkv) the engine uses, or None."""
        return self.kernels.ops

    @property
    def native_linear_rows(self) -> int:
        """Decode batches of more rows than this run the plain weights (oneDNN) instead of the
        prepacked copy, unless the tile kernel takes them (`tile_batches`)."""
        return self.kernels.native_linear_rows

    # -- basic facts --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def int8_weights(self) -> bool:
        """Whether the linear layers hold int8 weights (`--weights int8`)."""
        return any(isinstance(m, Int8Linear) for m in self.hf_model.modules())

    def fingerprint(self) -> str:
        """A digest of what the model computes: its config (without how it was loaded) and a
        fixed strided sample of every parameter. The sample is read in float32 and rounded to
        bfloat16, so the same weights loaded in float32 or bfloat16 share a digest, while
        other weights (another model, an adapter merged in) change it."""
        config = {
            key: value
            for key, value in self.config.to_dict().items()
            if not key.startswith("_") and key not in NOT_FINGERPRINTED
        }
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        with torch.no_grad():
            for name, p in self.hf_model.named_parameters():
                flat = p.detach().reshape(-1)
                step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
                sample = flat[::step][:FINGERPRINT_SAMPLES].float().to(torch.bfloat16).cpu()
                digest.update(f"{name}{tuple(p.shape)}".encode())
                digest.update(sample.view(torch.int16).numpy().tobytes())
        return digest.hexdigest()

    def decode_weight_bytes(self) -> int:
        """Bytes of weight one decode step must read: every layer, the final norm and the LM
        head (the embedding contributes one row; tied or not, its matrix is read as the head)."""
        modules = [*self.layers, self._norm, self._lm_head]
        seen: set[int] = set()
        total = 0
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        return total

    # -- embedding, rotary table, head ---------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed(ids)

    def rope(
        self, positions: torch.Tensor, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given absolute positions ([n] -> [n, head_dim] each; for a model
        whose layer types have their own rotary bases, Gemma 3's, [n, types * head_dim]: the
        types' tables side by side, which the layer methods here split, so callers index
        rows only); `bound`, if the caller knows one, is above every position (reading the
        largest back from a GPU would wait for it).

        The table is computed by the model's own rotary module (so rope scaling variants come
        out as HF has them) once for the whole context, and extended if generation runs past
        it, as HF's generate allows.
        """
        if bound is not None:
            needed = bound
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 1
        table = self._rope_table
        if table is None or table[0].dtype != self.dtype or table[0].shape[0] < needed:
            size = max(self.shape.max_positions, 2 * needed if table is not None else needed)
            all_pos = torch.arange(size, device=self.device)[None]
            probe = torch.empty((), dtype=self.dtype, device=self.device)
            if self._rope_kinds == (None,):
                cos, sin = self._rotary(probe, all_pos)
            else:
                parts = [self._rotary(probe, all_pos, kind) for kind in self._rope_kinds]
                cos = torch.cat([c for c, _ in parts], dim=-1)
                sin = torch.cat([s for _, s in parts], dim=-1)
            self._rope_table = table = (cos[0].contiguous(), sin[0].contiguous())
        return table[0][positions], table[1][positions]

    def _layer_rope(
        self, layer: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's own cos, sin out of `rope`'s tables (the same tensors where there is one)."""
        if self._rope_slot is None:
            return cos, sin
        d = self.shape.head_dim
        at = self._rope_slot[layer] * d
        return cos[..., at : at + d], sin[..., at : at + d]

    def _rotary_of(
        self, layer: int, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary module's cos, sin for `layer` (its layer type's, where types
        have their own)."""
        if self._rope_slot is None:
            return self._rotary(x, position_ids)
        return self._rotary(x, position_ids, self._rope_kinds[self._rope_slot[layer]])

    def _scaled_q(self, q: torch.Tensor) -> torch.Tensor:
        """Post-rotary queries times the model's attention scale over 1/sqrt(head_dim)."""
        return q if self._q_scale is None else q * self._q_scale

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(self._norm, h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """LM head over (already normed) hidden states, in float32 for sampling (soft-capped
        as transformers caps them, where the config sets a cap)."""
        head = self._packed_head
        if head is not None and (h.shape[0] <= self.native_linear_rows or self._tiles_for(head)):
            out = apply_linear(h, self._packed_head, self.kernels).float()
        else:
            out = self._lm_head(h).float()
        if self._final_softcap is not None:
            out = torch.tanh(out / self._final_softcap) * self._final_softcap
        return out

    # -- one decoder layer, in parts -------------------------------------------------------
    def input_norm(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.layers[layer].input_layernorm, h)

    def qkv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-rotary q [..., Hq, n, D] and k, v [..., Hkv, n, D] of normed input x [..., n, H]."""
        attn = self.layers[layer].self_attn
        qkv, _ = self._projections(layer)
        q, k, v = (self._heads(t) for t in qkv(x, self.kernels).split(qkv.sizes, dim=-1))
        if hasattr(attn, "q_norm"):  # Qwen3 and Gemma 3 normalise q and k per head before rotary
            q = attn.q_norm(q.transpose(-3, -2)).transpose(-3, -2)
            k = attn.k_norm(k.transpose(-3, -2)).transpose(-3, -2)
        cos, sin = self._layer_rope(layer, cos, sin)
        return self._scaled_q(apply_rope(q, cos, sin)), apply_rope(k, cos, sin), v

    def q(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Only a layer's post-rotary query of normed input x."""
        attn = self.layers[layer].self_attn
        q = self._heads(attn.q_proj(x))
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q.transpose(-3, -2)).transpose(-3, -2)
        return self._scaled_q(apply_rope(q, *self._layer_rope(layer, cos, sin)))

    def kv(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Only a layer's post-rotary k and v of normed input x (no query, no attention)."""
        attn = self.layers[layer].self_attn
        k = self._heads(attn.k_proj(x))
        v = self._heads(attn.v_proj(x))
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k.transpose(-3, -2)).transpose(-3, -2)
        return apply_rope(k, *self._layer_rope(layer, cos, sin)), v

    def attn_out(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        """What attention output o [..., Hq, n, D] adds to the residual [..., n, H]: its output
        projection (normed by Gemma's post_attention_layernorm)."""
        o = o.transpose(-3, -2).flatten(-2)
        block = self.layers[layer]
        out = block.self_attn.o_proj(o)
        return rms_norm(block.post_attention_layernorm, out) if self._sandwich else out

    def mlp_block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """h + MLP(post_attention_layernorm(h)); on Gemma
        h + post_feedforward_layernorm(MLP(pre_feedforward_layernorm(h)))."""
        block = self.layers[layer]
        _, gate_up = self._projections(layer)
        sandwich = self._sandwich
        before = block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm
        gate, up = gate_up(rms_norm(before, h), self.kernels).split(gate_up.sizes, -1)
        out = block.mlp.down_proj(block.mlp.act_fn(gate) * up)
        return h + (rms_norm(block.post_feedforward_layernorm, out) if sandwich else out)

    # -- a layer's dense work for decode tokens and prefill chunks (see layer_work.py) --------
    def before_attention(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        prefill: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the residual h [..., n, H] entering `layer` (qkv of its input norm).
        `prefill`: h is a chunk of one prompt's rows [n, H], run on the weights as loaded
        (prepacked copies are made for one-row products)."""
        weights = self._layer_weights(layer, prefill, h.shape[0])
        if weights is None:
            return self.qkv(layer, self.input_norm(layer, h), cos, sin)
        return layer_work.before_attention(h, weights, cos, sin, self._dims, self.kernels)

    def after_attention(
        self, layer: int, h: torch.Tensor, o: torch.Tensor, prefill: bool = False
    ) -> torch.Tensor:
        """The residual leaving `layer`, from the one entering it and attention output o."""
        weights = self._layer_weights(layer, prefill, h.shape[0])
        if weights is None:
            return self.mlp_block(layer, h + self.attn_out(layer, o))
        return layer_work.after_attention(h, o, weights, self._dims, self.kernels)

    def _layer_weights(self, layer: int, prefill: bool, rows: int = 1) -> LayerTensors | None:
        if prefill or not self._on_packed(rows):
            self.decode_weights()  # gathers both sets
            return self._plain_weights[layer]
        return self.decode_weights()[layer]

    @property
    def tile_batches(self) -> bool:
        """Whether decode batches above `native_linear_rows` run on the packed copy too (the
        AMX tile kernel, where the engine's measured choice says so), rather than on the plain
        weights."""
        return self.kernels.tiles_for_rows(self.native_linear_rows + 1)

    def _on_packed(self, rows: int) -> bool:
        """Whether a decode batch of `rows` uses the packed copies (see `tile_batches`)."""
        return rows <= self.native_linear_rows or (self.tile_batches and self._tiles_take_all)

    def layers_in_one_call(self, rows: int) -> bool:
        """Whether a decode batch of `rows` can run each layer as one native call
        (`decode_layer`): every layer's products are on speedkv's packed copies for this many
        rows, and every operator the call makes was built here and chosen."""
        ops = self.native_ops
        tiles = self.kernels.tiles_for_rows(rows)
        return (
            ops is not None
            and all(hasattr(ops, name) for name in ONE_CALL_OPERATORS)
            and self._native_layers is not None
            and self._on_packed(rows)
            and (not tiles or (self._tiles_take_all and hasattr(ops, "tile_linear")))
        )

    def decode_layer(
        self,
        layer: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int]],
        positions: list[int],
    ) -> torch.Tensor:
        """The residual leaving `layer` for a decode batch h [B, 1, H], each sequence's new
        key, value and position written into its cache buffers at its live length, in one
        native call (see layer_work.decode_layer; only where `layers_in_one_call`)."""
        args = self._native_layers[layer]  # type: ignore[index]
        tiles = self.kernels.tiles_for_rows(h.shape[0])
        return layer_work.decode_layer(
            h, args, cos, sin, self._dims, self.native_ops, caches, positions, tiles
        )

    def _tiles_for(self, tensors: tuple[torch.Tensor | None, ...]) -> bool:
        return self.tile_batches and tiles_take(tensors)

    def decode_weights(self) -> list[LayerTensors | None]:
        """Every layer's weights as plain tensors; None for a layer where some piece must run
        as the model's own module (an adapter wrapper, trainable weights, per-head q/k norms,
        an unusual norm or activation)."""
        if self._decode_weights is None:
            self.check_weights()
        return self._decode_weights  # type: ignore[return-value]

    def check_weights(self) -> None:
        """Fuse the projections and gather the layers' weights anew if any parameter was
        replaced since they were (an adapter merged or wrapped, new weights loaded). The
        engine calls it before each prefill: cheap when nothing changed."""
        if self._decode_weights is not None and self._weights_key == self._parameter_ids():
            return
        self._fused = {}
        layers = self._plain_weights = [
            self._layer_tensors(i) for i in range(self.shape.num_layers)
        ]
        head = linear_tensors(self._lm_head)
        self._packed_head = None
        ops = self.native_ops
        if self.prepacked:  # each weight that can be: where oneDNN takes no bfloat16 (AVX2), a
            # head of 101 outputs stays plain while the layers decode on speedkv's kernel
            layers = [prepack_layer(w, ops) if can_prepack_layer(w, ops) else w for w in layers]
            if can_prepack(head, ops):
                self._packed_head = prepacked(head, ops)  # type: ignore[arg-type]
        packed = [t for w in layers if w is not None for t in (w.qkv, w.o, w.gate_up, w.down)]
        self._tiles_take_all = bool(packed) and all(tiles_take(t) for t in packed)
        norms = [n for w in layers if w is not None for n in (w.input_norm, w.post_norm)]
        native = (
            all(w is not None for w in layers)
            and all(t[0].dim() == 4 for t in packed)  # speedkv's layout, not oneDNN's
            and all(n.dtype == self.dtype for n in norms)
        )
        self._native_layers = [layer_work.native_layer_args(w) for w in layers] if native else None
        self._decode_weights = layers
        self._weights_key = self._parameter_ids()  # fusing replaced the parts' parameters

    def _parameter_ids(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.hf_model.parameters())

    def _layer_tensors(self, layer: int) -> LayerTensors | None:
        if self._dims is None:
            return None
        block = self.layers[layer]
        qkv, gate_up = self._projections(layer)
        o = linear_tensors(block.self_attn.o_proj)
        down = linear_tensors(block.mlp.down_proj)
        norms = (block.input_layernorm, block.post_attention_layernorm)
        if qkv.tensors is None or gate_up.tensors is None or o is None or down is None:
            return None
        if not all(is_t5_style_norm(n) for n in norms):
            return None
        return LayerTensors(norms[0].weight, qkv.tensors, o, norms[1].weight, gate_up.tensors, down)

    def prepack_decode(self, enabled: bool = True) -> None:
        """Decode with a copy of every linear weight, the LM head included, packed for one-row
        products (see kernels.linear.prepacked: speedkv's kernel for bfloat16 and int8 weights where
        the engine found it, else oneDNN's layout for float weights), or with the weights as
        they are (prefill always uses those). CPUs only; anywhere else this changes
        nothing."""
        self.prepacked = enabled
        self._decode_weights = None

    def _projections(self, layer: int) -> tuple[FusedProjection, FusedProjection]:
        """The layer's q/k/v and gate/up projections, each fused into one matmul."""
        fused = self._fused.get(layer)
        if fused is None:
            attn, mlp = self.layers[layer].self_attn, self.layers[layer].mlp
            qkv = FusedProjection((attn.q_proj, attn.k_proj, attn.v_proj))
            fused = self._fused[layer] = (qkv, FusedProjection((mlp.gate_proj, mlp.up_proj)))
        return fused

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return layer_work.heads(x, self.shape.head_dim)

    # -- the library's own computation, for reference checks and training ---------------------
    def hf_layer(
        self, layer: int, h: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """transformers' own forward of one decoder layer over h [B, n, H].

        mask: bool [B or 1, 1, n, n], True where a query may see a key: the whole rule,
        the layer's sliding window included (transformers' own attention leaves the window to
        the mask it is given). Used by the dense SPEED reference and by SPEED-aware training,
        so they do not share our attention code.
        """
        additive = torch.zeros(mask.shape, dtype=h.dtype, device=h.device)
        additive.masked_fill_(~mask, torch.finfo(h.dtype).min)
        position_ids = positions.view(1, -1).expand(h.shape[0], -1)
        cos, sin = self._rotary_of(layer, h, position_ids)
        out = self.layers[layer](
            h, attention_mask=additive, position_ids=position_ids, position_embeddings=(cos, sin)
        )
        return out[0] if isinstance(out, tuple) else out

    def hf_generate_timed(self, ids: torch.Tensor, max_new_tokens: int) -> dict:
        """The library's own greedy `generate`, timed: the baseline users already know.

        Returns the new tokens, time to the first one, mean time per later one, and the bytes of
        the key/value tensors its cache holds at the end.
        """
        import time

        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self):
                self.calls: list[float] = []

            def put(self, value):  # first call: the prompt; then one per new token
                self.calls.append(time.perf_counter())

            def end(self):
                pass

        clock = Clock()
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            return_dict_in_generate=True,
        )
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                streamer=clock,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        stamps = clock.calls[1:]
        kv = sum(
            t.nbytes for layer in out.past_key_values.layers for t in (layer.keys, layer.values)
        )
        return {
            "output_ids": tokens,
            "ttft_s": stamps[0] - start,
            "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0,
            "kv_bytes_final": kv,
        }
