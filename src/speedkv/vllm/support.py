"""Which vLLM configurations SPEED runs, and one sentence for each it refuses.

Checked twice. At engine start, in the process that builds vLLM's configuration (the one that
calls `LLM(...)` or runs the server), through vLLM's per-architecture config hook, so a refusal
reaches the user before any worker starts. Then in each worker, as the model is built, on the
configuration the worker actually got.

Three defaults are set rather than refused:
- the V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`), unless the user chose one: the plugin
  reads each request's prompt length from V1's metadata build (`batch.py`) and has not been
  run on Model Runner V2;
- no CUDA graphs (`cudagraph_mode` NONE), unless the user chose a mode: which rows enter the
  upper layers changes each step, and a graph would replay the tensors of the step it was
  captured on. torch.compile stays on;
- no prefix caching where the upper layers keep stock blocks (`speedkv_compact_kv` false, or
  pipeline stages that need it): their compact rows sit in a request's first blocks, which a
  prefix hit would share. With their own blocks, prefix caching works (`prefix_index.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from speedkv.errors import Unsupported
from speedkv.log import log

V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"


def _refusals(config: Any, compact_kv: bool) -> list[tuple[Callable[[], bool], str]]:
    """(condition, sentence) for every path SPEED refuses, in the order they are checked."""
    parallel, cache = config.parallel_config, config.cache_config
    scheduler = config.scheduler_config
    return [
        (
            lambda: config.use_v2_model_runner,
            "SPEED runs on vLLM's V1 model runner, not Model Runner V2: set "
            f"{V2_RUNNER}=0 (and drop options that need V2, such as HiSparse or watermarking)",
        ),
        (
            lambda: config.kv_transfer_config is not None,
            "SPEED does not run with a KV connector (kv_transfer_config): a connector would move "
            "the upper layers' compact K/V to engines that read it as ordinary K/V",
        ),
        (
            lambda: config.speculative_config is not None,
            "SPEED does not run with speculative decoding: draft tokens are not yet in the "
            "upper layers' compact cache layout",
        ),
        (
            lambda: parallel.decode_context_parallel_size > 1,
            "SPEED does not run with decode context parallelism "
            "(decode_context_parallel_size > 1): its compact slots assume each rank holds "
            "every K/V row",
        ),
        (
            lambda: parallel.prefill_context_parallel_size > 1,
            "SPEED does not run with prefill context parallelism "
            "(prefill_context_parallel_size > 1)",
        ),
        (
            lambda: bool(cache.enable_prefix_caching) and not compact_kv,
            "SPEED's prefix caching needs the upper layers' own blocks: with stock blocks the "
            "compact rows sit in a request's first blocks, which vLLM would share",
        ),
        (
            lambda: cache.kv_sharing_fast_prefill,
            "SPEED does not run with kv_sharing_fast_prefill, which also skips upper-layer rows",
        ),
        (
            lambda: config.lora_config is not None,
            "SPEED does not serve LoRA adapters in vLLM (enable_lora): the upper layers run a "
            "gathered subset of the step's rows, which vLLM's LoRA kernels would map to the "
            "wrong adapters; merge the adapter into the weights (speedkv's --adapter does)",
        ),
        (
            lambda: parallel.enable_dbo or parallel.use_ubatching,
            "SPEED does not run micro-batched steps (dual-batch overlap, ubatching)",
        ),
        (
            lambda: compact_kv and scheduler.disable_hybrid_kv_cache_manager,
            "SPEED's compact upper-layer blocks need vLLM's hybrid KV cache manager: drop "
            "disable_hybrid_kv_cache_manager, or set speedkv_compact_kv false in hf_overrides",
        ),
        (
            lambda: _graph_mode(config) not in (None, "NONE") and not _on_cpu(),
            "SPEED in vLLM runs without CUDA graphs, as which rows enter the upper layers "
            "changes every step: pass compilation_config={'cudagraph_mode': 'NONE'} "
            "(speedkv.vllm.engine_args does) or drop cudagraph_mode",
        ),
    ]


def check(config: Any, compact_kv: bool = True) -> None:
    """Raise `Unsupported` with the first refusal that applies to a vLLM configuration."""
    for applies, sentence in _refusals(config, compact_kv):
        if applies():
            raise Unsupported(sentence)


def prepare(config: Any, compact_kv: bool = True) -> None:
    """At engine start: set SPEED's defaults where the user left vLLM's, then check. Runs in
    vLLM's config hook, before the rest of vLLM's configuration is resolved."""
    compact_kv = _choose_blocks(config, compact_kv)
    if not compact_kv and config.cache_config.enable_prefix_caching:
        # stock blocks hold the upper layers' compact rows in a request's first blocks, which
        # a prefix hit would share: no prefix caching there
        config.cache_config.enable_prefix_caching = False
        log("SPEED with stock KV blocks turns vLLM's prefix caching off (docs/vllm.md)",
            source="vllm")  # fmt: skip
    if os.environ.get(V2_RUNNER) is None and config.use_v2_model_runner:
        os.environ[V2_RUNNER] = "0"  # inherited by the engine and worker processes
        log(f"SPEED runs on vLLM's V1 model runner: set {V2_RUNNER}=0", source="vllm")
    compilation = config.compilation_config
    if compilation.cudagraph_mode is None:
        from vllm.config import CUDAGraphMode

        compilation.cudagraph_mode = CUDAGraphMode.NONE
    check(config, compact_kv)


def _choose_blocks(config: Any, compact_kv: bool) -> bool:
    """With pipeline parallelism every stage sizes its blocks by its largest KV cache group, and
    the upper layers' own blocks can cost more memory than stock ones: then the upper layers
    keep stock blocks (`speedkv_compact_kv` false in the config every process reads)."""
    pp = config.parallel_config.pipeline_parallel_size
    hf_config = getattr(getattr(config, "model_config", None), "hf_config", None)
    if not compact_kv or pp == 1 or hf_config is None:
        return compact_kv
    from vllm.distributed.utils import get_pp_indices

    from speedkv.vllm.settings import SpeedSettings

    layers = hf_config.num_hidden_layers
    stages = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    if SpeedSettings.from_hf_config(hf_config).compact_pays(layers, stages):
        return True
    hf_config.speedkv_compact_kv = False
    log(f"with {pp} pipeline stages the upper layers' own KV blocks would cost more memory "
        "than stock blocks: SPEED keeps stock blocks (docs/vllm.md)", source="vllm")  # fmt: skip
    return False


def _graph_mode(config: Any) -> str | None:
    mode = config.compilation_config.cudagraph_mode
    return None if mode is None else mode.name


def _on_cpu() -> bool:
    """vLLM's CPU build captures no graphs, whatever cudagraph_mode says."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def install_config_hook(architectures: list[str]) -> None:
    """Make vLLM call `prepare` when it builds the configuration of a SPEED architecture
    (its per-architecture hook, `MODELS_CONFIG_MAP`)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from speedkv.vllm.settings import SpeedSettings

    class SpeedConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            settings = SpeedSettings.from_hf_config(vllm_config.model_config.hf_config)
            prepare(vllm_config, settings.compact_kv)

    for arch in architectures:
        MODELS_CONFIG_MAP[arch] = SpeedConfig
