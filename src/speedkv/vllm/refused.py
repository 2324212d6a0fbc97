"""The SPEED architectures as registered on a vLLM the plugin does not support (`versions.py`),
or could not hook into.

vLLM inspects a registered model class before it builds the engine's configuration, so the
names must resolve to a class it can inspect; these are vLLM's stock Llama, Mistral, Qwen2,
Qwen3 and Gemma 3 (whose import paths are the most stable part of vLLM), and building one raises
the version sentence. The config hook refuses first, in the process that builds the configuration
(`support.py`); this is the second line, for a vLLM whose config hook the plugin could not
install.
"""

from __future__ import annotations

from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from speedkv.errors import Unsupported
from speedkv.vllm import plugin
from speedkv.vllm.versions import refusal


def _refuse(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
    raise Unsupported(
        plugin.refused_because or refusal() or "speedkv's vLLM plugin did not set SPEED up here"
    )


class SpeedLlamaForCausalLM(LlamaForCausalLM):
    __init__ = _refuse  # the signature vLLM looks for: (self, *, vllm_config, prefix)


class SpeedQwen2ForCausalLM(Qwen2ForCausalLM):
    __init__ = _refuse


class SpeedMistralForCausalLM(MistralForCausalLM):
    __init__ = _refuse


class SpeedQwen3ForCausalLM(Qwen3ForCausalLM):
    __init__ = _refuse


class SpeedGemma3ForCausalLM(Gemma3ForCausalLM):
    __init__ = _refuse
