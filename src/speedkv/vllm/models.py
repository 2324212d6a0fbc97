"""SPEED variants of vLLM's Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) models.

Same weights, same layers; only the backbone's layer loop differs. Every row of a step runs the
layers below `lcut`; the full-depth rows (anchors, deep suffix, generated tokens) are gathered,
run the layers from `lcut` up over the upper layers' compact cache (`attention.py`), and are
scattered back. Shallow rows leave with their lower-layer state: vLLM samples only a prompt's
last row, which is always deep.

The two halves are compiled separately (`stacks.py`); a step whose rows are all full depth
(every decode-only step) skips the gather and scatter. With pipeline parallelism each rank runs
its own slice of layers, split where the cut falls in it (`settings.rank_split`).
"""

from __future__ import annotations

import torch
from vllm.compilation.backends import set_model_tag
from vllm.distributed import get_pp_group
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.sequence import IntermediateTensors

from speedkv.errors import Unsupported
from speedkv.vllm import support
from speedkv.vllm.attention import rows_of_step, use_speed_backend
from speedkv.vllm.batch import install_runner_hooks
from speedkv.vllm.settings import SpeedSettings, rank_split
from speedkv.vllm.stacks import LowerStack, UpperStack


class SpeedCausalLM:
    """Mixin over a vLLM causal LM whose backbone has `layers[i].self_attn.attn`."""

    def _install_speed(self, vllm_config) -> None:
        self.speed = SpeedSettings.from_hf_config(vllm_config.model_config.hf_config)
        model = self.model
        layers = len(model.layers)
        if not 0 <= self.speed.lcut <= layers:
            raise ValueError(
                f"speedkv_lcut must be between 0 and {layers} for this model, got {self.speed.lcut}"
            )
        support.check(vllm_config, self.speed.compact_kv)  # the worker's own configuration
        install_runner_hooks()  # the builders need each request's prompt length
        lower, upper = rank_split(self.speed.lcut, model.start_layer, model.end_layer)
        window = support.sliding_window(vllm_config)
        for index in range(model.start_layer, model.end_layer):
            # SPEED's rule reads one window for the model (SpeedRule.deep_for)
            own = model.layers[index].self_attn.attn.sliding_window
            if own is not None and own != window:
                raise Unsupported(
                    f"SPEED runs sliding-window models whose windowed layers share the "
                    f"config's window ({window}); layer {index} has {own}"
                )
        for index in upper:
            attention = model.layers[index].self_attn.attn
            use_speed_backend(attention)
            if self.speed.compact_kv:
                from speedkv.vllm.kv_spec import use_compact_spec

                use_compact_spec(attention, self.speed.anchors, self.speed.deep, window)
        pp = get_pp_group()
        self.lower_stack = None
        if pp.is_first_rank or len(lower):
            with set_model_tag("speedkv_lower"):
                self.lower_stack = LowerStack(
                    vllm_config=vllm_config,
                    model=model,
                    layers=[model.layers[i] for i in lower],
                    embed=pp.is_first_rank,
                )
        self.upper_stack = None
        if len(upper):
            with set_model_tag("speedkv_upper"):
                self.upper_stack = UpperStack(
                    vllm_config=vllm_config,
                    layers=[model.layers[i] for i in upper],
                    norm=model.norm if pp.is_last_rank else None,
                )
        self._upper_names = [model.layers[i].self_attn.attn.layer_name for i in upper]
        self.upper_rows = 0  # rows that entered this rank's upper layers, for tests and benchmarks

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        hidden = residual = None
        if intermediate_tensors is not None and not pp.is_first_rank:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        if self.lower_stack is not None:
            hidden, residual = self.lower_stack(input_ids, positions, hidden, residual,
                                                inputs_embeds)  # fmt: skip
        normed = False
        if self.upper_stack is not None:
            hidden, residual = self._run_upper(positions, hidden, residual)
            normed = pp.is_last_rank
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        if not normed:
            hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _run_upper(self, positions, hidden, residual):
        """The upper layers over the step's full-depth rows. On the last rank every row comes
        back normed: the rows that went up by the upper stack's final norm, the others (never
        sampled) by the same norm here."""
        if residual is None:  # no layer below the cut here: the embeddings go straight up
            residual = torch.zeros_like(hidden)
        rows = rows_of_step(self._upper_names)
        if rows is None or rows.numel() == hidden.shape[0]:
            # warm-up and profiling runs (shapes only), and steps whose rows are all full
            # depth (decode-only): every row goes up, in place
            if rows is not None:
                self.upper_rows += int(rows.numel())
            return self.upper_stack(positions, hidden, residual)
        if rows.numel():
            self.upper_rows += int(rows.numel())
            up_hidden, up_residual = self.upper_stack(positions[rows], hidden[rows],
                                                      residual[rows])  # fmt: skip
        if get_pp_group().is_last_rank:
            hidden, residual = self.model.norm(hidden, residual)
        if rows.numel():
            hidden = hidden.index_copy(0, rows, up_hidden)
            residual = residual.index_copy(0, rows, up_residual)
        return hidden, residual


class SpeedLlamaForCausalLM(SpeedCausalLM, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        LlamaForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._install_speed(vllm_config)


class SpeedQwen2ForCausalLM(SpeedCausalLM, Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        Qwen2ForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._install_speed(vllm_config)


class SpeedMistralForCausalLM(SpeedCausalLM, MistralForCausalLM):
    """vLLM's Mistral is its Llama with Mistral's weight names and options. The upper layers
    run with their true positions, so Llama-4 attention scaling (`llama_4_scaling`) holds."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        if getattr(vllm_config.model_config.hf_config, "ada_rms_norm_t_cond", False):
            # its layers take a conditioning input the stock backbone passes and SPEED's
            # layer loop (stacks.py) does not
            raise Unsupported(
                "SPEED does not run Mistral models with time-conditioned norms "
                "(ada_rms_norm_t_cond in the model's config)"
            )
        MistralForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._install_speed(vllm_config)


class SpeedGemma3ForCausalLM(SpeedCausalLM, Gemma3ForCausalLM):
    """Gemma 3's text model: local (sliding-window) layers interleaved with global ones, each
    with its own rotary base, inside its attention module. The embedding's scaling is
    `embed_input_ids`, which the lower stack calls; its norms take (x, residual) as Llama's."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        Gemma3ForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._install_speed(vllm_config)


class SpeedQwen3ForCausalLM(SpeedCausalLM, Qwen3ForCausalLM):
    """Qwen3 normalises q and k per head before rotary inside its attention module: the
    attention layer (whose backend and K/V write SPEED replaces) receives them normed and
    rotated, as in Llama and Qwen2."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        Qwen3ForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._install_speed(vllm_config)
