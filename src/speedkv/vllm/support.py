"""Which vLLM configurations SPEED runs, and one sentence for each it refuses.

Checked twice. At engine start, in the process that builds vLLM's configuration (the one that
calls `LLM(...)` or runs the server), through vLLM's per-architecture config hook, so a refusal
reaches the user before any worker starts. Then in each worker, as the model is built, on the
configuration the worker actually got. Both first check vLLM's version (`versions.py`).

vLLM calls the hook at the start of its configuration's checks, before it settles the options
the user left unset (`None`). Where SPEED has a safe choice it sets it there rather than
refusing vLLM's default:
- the V1 model runner (`VLLM_USE_V2_MODEL_RUNNER=0`), unless the user chose one: the plugin
  reads each request's prompt length from V1's metadata build (`batch.py`) and has not been
  run on Model Runner V2;
- no CUDA graphs (`cudagraph_mode` NONE), unless the user chose a mode: which rows enter the
  upper layers changes each step, and a graph would replay the tensors of the step it was
  captured on. torch.compile stays on;
- no asynchronous scheduling (vLLM's default on CUDA; the CPU build never runs it), unless the
  user asked for it: the plugin has not been run with it;
- no fused RoPE + KV-cache write passes (`fuse_rope_kvcache`, `fuse_qk_norm_rope_kvcache`,
  vLLM's default on ROCm with AITER): they write K/V at the runner's per-position slots,
  bypassing the upper layers' compact write (`attention.write_compact_kv`);
- no prefix caching where the upper layers keep stock blocks (`speedkv_compact_kv` false, or
  pipeline stages that need it): their compact rows sit in a request's first blocks, which a
  prefix hit would share. With their own blocks, prefix caching works (`prefix_index.py`);
  on a sliding-window model a windowed group reuses only prefixes whose upper rows are the
  anchors alone (`kv_spec.SpeedUpperManager.find_longest_cache_hit`).

Every field is read with a default (`_field`): a newer vLLM that drops one gets the refusal or
the default, never an AttributeError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from speedkv.errors import Unsupported
from speedkv.log import log
from speedkv.vllm.versions import require_supported

V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
# the fused passes that write K/V themselves (vllm/compilation/passes/fusion/): each calls the
# attention implementation's own fused method with the runner's slot mapping
FUSED_KV_WRITES = ("fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")
_MISSING = object()


def _field(obj: Any, *path: str, default: Any = None) -> Any:
    """`obj.a.b...`, or `default` where this vLLM has no such field (or a parent is None)."""
    for name in path:
        obj = getattr(obj, name, _MISSING) if obj is not None else _MISSING
        if obj is _MISSING:
            return default
    return obj


def _v2_runner(config: Any) -> bool | None:
    """Whether the engine uses Model Runner V2; None where this vLLM has no such choice
    (vLLM 0.34 removed `use_v2_model_runner` with the V1 runner). The property may raise
    a ValueError for option combinations vLLM refuses itself: that is vLLM's to report, so
    it is left to propagate."""
    value = getattr(config, "use_v2_model_runner", _MISSING)
    return None if value is _MISSING else bool(value)


def sliding_window(config: Any) -> int | None:
    """The attention window vLLM gives the model's layers, if any: the text config's
    `sliding_window` (per layer through `layer_types`, or for every layer), the cache config's,
    or a Qwen2 `use_sliding_window` switched on after its window was dropped."""
    text = _field(config, "model_config", "hf_text_config")
    if text is None:
        text = _field(config, "model_config", "hf_config")
    window = _field(text, "sliding_window") or _field(config, "cache_config", "sliding_window")
    if window:
        return int(window)
    if _field(text, "use_sliding_window", default=False) and not _field(
        config, "model_config", "disable_sliding_window", default=False
    ):
        return -1  # asked for, size unknown
    return None


def _refusals(config: Any, compact_kv: bool) -> list[tuple[Callable[[], bool], str]]:
    """(condition, sentence) for every path SPEED refuses, in the order they are checked."""

    def get(*path: str, default: Any = None) -> Any:
        return _field(config, *path, default=default)

    return [
        (
            lambda: _v2_runner(config) is None,
            "SPEED runs on vLLM's V1 model runner, which this vLLM no longer has "
            "(VllmConfig.use_v2_model_runner is gone): install vLLM 0.32",
        ),
        (
            lambda: _v2_runner(config) is True,
            "SPEED runs on vLLM's V1 model runner, not Model Runner V2: set "
            f"{V2_RUNNER}=0 (and drop options that need V2, such as HiSparse or watermarking)",
        ),
        (
            lambda: get("model_config", "runner_type", default="generate") == "pooling",
            "SPEED does not run vLLM's pooling runner (runner='pooling': embeddings, rewards, "
            "classification), which pools prompt tokens' last-layer states that SPEED never "
            "computes",
        ),
        (
            lambda: sliding_window(config) == -1,
            "SPEED cannot tell the size of this model's sliding window (use_sliding_window "
            "without sliding_window in its config)",
        ),
        (
            lambda: sliding_window(config) is not None and not compact_kv,
            "SPEED runs sliding-window models with the upper layers' own KV blocks only: with "
            "stock blocks (speedkv_compact_kv false, or pipeline stages that choose them) "
            "vLLM's window manager would free the blocks that hold their compact rows",
        ),
        (
            lambda: get("cache_config", "kv_offloading_size") is not None,
            "SPEED does not run with KV offloading (kv_offloading_size): the offloading "
            "connector would move the upper layers' compact K/V as if it were ordinary K/V",
        ),
        (
            lambda: get("kv_transfer_config") is not None,
            "SPEED does not run with a KV connector (kv_transfer_config): a connector would move "
            "the upper layers' compact K/V to engines that read it as ordinary K/V",
        ),
        (
            lambda: get("speculative_config") is not None,
            "SPEED does not run with speculative decoding: draft tokens are not yet in the "
            "upper layers' compact cache layout",
        ),
        (
            lambda: get("parallel_config", "decode_context_parallel_size", default=1) > 1,
            "SPEED does not run with decode context parallelism "
            "(decode_context_parallel_size > 1): its compact slots assume each rank holds "
            "every K/V row",
        ),
        (
            lambda: get("parallel_config", "prefill_context_parallel_size", default=1) > 1,
            "SPEED does not run with prefill context parallelism "
            "(prefill_context_parallel_size > 1)",
        ),
        (
            lambda: bool(get("cache_config", "enable_prefix_caching")) and not compact_kv,
            "SPEED's prefix caching needs the upper layers' own blocks: with stock blocks the "
            "compact rows sit in a request's first blocks, which vLLM would share",
        ),
        (
            lambda: bool(get("cache_config", "kv_sharing_fast_prefill")),
            "SPEED does not run with kv_sharing_fast_prefill, which also skips upper-layer rows",
        ),
        (
            lambda: get("lora_config") is not None,
            "SPEED does not serve LoRA adapters in vLLM (enable_lora): the upper layers run a "
            "gathered subset of the step's rows, which vLLM's LoRA kernels would map to the "
            "wrong adapters; merge the adapter into the weights (speedkv's --adapter does)",
        ),
        (
            lambda: (
                bool(get("parallel_config", "enable_dbo"))
                or bool(get("parallel_config", "use_ubatching"))
            ),
            "SPEED does not run micro-batched steps (dual-batch overlap, ubatching)",
        ),
        (
            lambda: compact_kv and bool(get("scheduler_config", "disable_hybrid_kv_cache_manager")),
            "SPEED's compact upper-layer blocks need vLLM's hybrid KV cache manager: drop "
            "disable_hybrid_kv_cache_manager, or set speedkv_compact_kv false in hf_overrides",
        ),
        (
            # vLLM turns the hybrid manager off after this hook on such platforms
            lambda: compact_kv and not _platform_has_hybrid_manager(),
            "SPEED's compact upper-layer blocks need vLLM's hybrid KV cache manager, which this "
            "platform does not offer: set speedkv_compact_kv false in hf_overrides",
        ),
        (
            lambda: get("model_config", "attention_chunk_size") is not None,
            "SPEED does not run chunked local attention (attention_chunk_size): its kernel "
            "would cut chunks over the upper layers' compact rows, not over positions",
        ),
        (
            lambda: bool(get("scheduler_config", "async_scheduling")),
            "SPEED in vLLM does not run with asynchronous scheduling, which it has not been "
            "run and checked with: drop async_scheduling (or pass --no-async-scheduling)",
        ),
        (
            lambda: any(get("compilation_config", "pass_config", name) for name in FUSED_KV_WRITES),
            "SPEED does not run vLLM's fused RoPE and KV-cache write (fuse_rope_kvcache, "
            "fuse_qk_norm_rope_kvcache in compilation_config's pass_config), which writes the "
            "upper layers' K/V at the runner's slots instead of SPEED's compact ones",
        ),
        (
            lambda: _graph_mode(config) not in (None, "NONE") and not _on_cpu(),
            "SPEED in vLLM runs without CUDA graphs, as which rows enter the upper layers "
            "changes every step: pass compilation_config={'cudagraph_mode': 'NONE'} "
            "(speedkv.vllm.engine_args does) or drop cudagraph_mode",
        ),
    ]


def check(config: Any, compact_kv: bool = True) -> None:
    """Raise `Unsupported` with the first refusal that applies to a vLLM configuration (the
    version first)."""
    require_supported()
    for applies, sentence in _refusals(config, compact_kv):
        if applies():
            raise Unsupported(sentence)


def prepare(config: Any, compact_kv: bool = True) -> None:
    """At engine start: set SPEED's defaults where the user left vLLM's, then check. Runs in
    vLLM's config hook, before the rest of vLLM's configuration is resolved."""
    require_supported()  # before anything of this vLLM's configuration is read
    compact_kv = _choose_blocks(config, compact_kv)
    if not compact_kv and _field(config, "cache_config", "enable_prefix_caching"):
        # stock blocks hold the upper layers' compact rows in a request's first blocks, which
        # a prefix hit would share: no prefix caching there
        config.cache_config.enable_prefix_caching = False
        log("SPEED with stock KV blocks turns vLLM's prefix caching off (docs/vllm.md)",
            source="vllm")  # fmt: skip
    if os.environ.get(V2_RUNNER) is None and _v2_runner(config):
        os.environ[V2_RUNNER] = "0"  # inherited by the engine and worker processes
        log(f"SPEED runs on vLLM's V1 model runner: set {V2_RUNNER}=0", source="vllm")
    compilation = _field(config, "compilation_config")
    if _field(compilation, "cudagraph_mode", default=_MISSING) is None:
        from vllm.config import CUDAGraphMode

        compilation.cudagraph_mode = CUDAGraphMode.NONE
    scheduler = _field(config, "scheduler_config")
    if _field(scheduler, "async_scheduling", default=_MISSING) is None:
        scheduler.async_scheduling = False  # vLLM would turn it on where it can (CUDA)
    passes = _field(compilation, "pass_config")
    for name in FUSED_KV_WRITES:
        if _field(passes, name, default=_MISSING) is None:
            setattr(passes, name, False)  # vLLM would turn them on on ROCm with AITER
    check(config, compact_kv)


def _choose_blocks(config: Any, compact_kv: bool) -> bool:
    """With pipeline parallelism every stage sizes its blocks by its largest KV cache group, and
    the upper layers' own blocks can cost more memory than stock ones: then the upper layers
    keep stock blocks (`speedkv_compact_kv` false in the config every process reads)."""
    pp = _field(config, "parallel_config", "pipeline_parallel_size", default=1)
    hf_config = _field(config, "model_config", "hf_config")
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
    mode = _field(config, "compilation_config", "cudagraph_mode")
    return None if mode is None else getattr(mode, "name", str(mode))


def _platform_has_hybrid_manager() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.support_hybrid_kv_cache())


def _on_cpu() -> bool:
    """vLLM's CPU build captures no graphs, whatever cudagraph_mode says."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def install_config_hook(architectures: list[str], refused: str | None = None) -> None:
    """Make vLLM call `prepare` when it builds the configuration of a SPEED architecture
    (its per-architecture hook, `MODELS_CONFIG_MAP`); where the plugin cannot run SPEED at all
    (`refused`), make it raise that sentence instead."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from speedkv.vllm.settings import SpeedSettings

    class SpeedConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            if refused is not None:
                raise Unsupported(refused)
            require_supported()  # also where the plugin registered before the version changed
            settings = SpeedSettings.from_hf_config(vllm_config.model_config.hf_config)
            prepare(vllm_config, settings.compact_kv)

    for arch in architectures:
        MODELS_CONFIG_MAP[arch] = SpeedConfig
