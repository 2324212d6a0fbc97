"""SPEED variants of vLLM's Llama and Qwen2 models.

Same weights, same layers; only the backbone's layer loop differs. Every row of a step runs the
layers below `lcut`; the full-depth rows (anchors, deep suffix, generated tokens) are gathered,
run the layers from `lcut` up over the upper layers' compact cache (`attention.py`), and are
scattered back before the final norm. Shallow rows leave with their lower-layer state: vLLM
samples only a prompt's last row, which is always deep.

The backbone runs eagerly: which rows go up is decided per step, from metadata, which a compiled
graph would bake in.
"""

from __future__ import annotations

from itertools import islice

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.sequence import IntermediateTensors

from speedkv.vllm.attention import rows_of_step, use_speed_backend
from speedkv.vllm.batch import install_runner_hook
from speedkv.vllm.settings import SpeedSettings


class SpeedCausalLM:
    """Mixin over a vLLM causal LM whose backbone has `layers[i].self_attn.attn`."""

    def _install_speed(self, vllm_config) -> None:
        self.speed = SpeedSettings.from_hf_config(vllm_config.model_config.hf_config)
        layers = len(self.model.layers)
        if not 0 <= self.speed.lcut <= layers:
            raise ValueError(
                f"speedkv_lcut must be between 0 and {layers} for this model, got {self.speed.lcut}"
            )
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "SPEED keeps the upper layers' K/V in a per-request compact layout that prefix "
                "caching cannot share; start vLLM with enable_prefix_caching=False"
            )
        install_runner_hook()  # the builders need each request's prompt length
        for layer in islice(
            self.model.layers, max(self.speed.lcut, self.model.start_layer), self.model.end_layer
        ):
            use_speed_backend(layer.self_attn.attn)
            if self.speed.compact_kv:
                from speedkv.vllm.kv_spec import use_compact_spec

                use_compact_spec(layer.self_attn.attn, self.speed.anchors, self.speed.deep)
        self.upper_rows = 0  # rows that entered the upper layers, for tests and benchmarks

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor | IntermediateTensors:
        model = self.model
        if get_pp_group().is_first_rank:
            hidden = model.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        split = min(max(self.speed.lcut, model.start_layer), model.end_layer)
        for layer in islice(model.layers, model.start_layer, split):
            hidden, residual = layer(positions, hidden, residual)
        if split < model.end_layer:
            upper = list(islice(model.layers, split, model.end_layer))
            hidden, residual = self._run_upper(upper, positions, hidden, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = model.norm(hidden, residual)
        return hidden

    def _run_upper(self, layers, positions, hidden, residual):
        rows = rows_of_step(layers[0].self_attn.attn)
        if rows is None:  # warm-up / profiling: no metadata, shapes only
            for layer in layers:
                hidden, residual = layer(positions, hidden, residual)
            return hidden, residual
        if rows.numel() == 0:
            return hidden, residual
        self.upper_rows += int(rows.numel())
        if residual is None:  # lcut = 0: the embeddings go straight up
            residual = torch.zeros_like(hidden)
        up_hidden, up_residual, up_positions = hidden[rows], residual[rows], positions[rows]
        for layer in layers:
            up_hidden, up_residual = layer(up_positions, up_hidden, up_residual)
        return hidden.index_copy(0, rows, up_hidden), residual.index_copy(0, rows, up_residual)


class SpeedLlamaForCausalLM(SpeedCausalLM, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        LlamaForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._install_speed(vllm_config)


class SpeedQwen2ForCausalLM(SpeedCausalLM, Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        Qwen2ForCausalLM.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._install_speed(vllm_config)
