"""Every vLLM path SPEED cannot run is refused when the engine's configuration is built, with one
sentence that names it: from Python (`LLM(...)` builds the same configuration as here), from
`speedkv generate/bench --backend vllm` (exit 2) and from `speedkv serve --backend vllm`, which
then never starts vLLM's server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm.config import CUDAGraphMode
from vllm.engine.arg_utils import EngineArgs

from speedkv.errors import Unsupported
from speedkv.vllm import support
from speedkv.vllm.args import engine_args

from conftest import fake_config

SPEED = "speed:lcut=22,anchors=bos,deep=1"
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
CONNECTOR = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}

CASES = {
    "kv-connector": ({"kv_transfer_config": CONNECTOR}, "KV connector"),
    "speculative": ({"speculative_config": NGRAM}, "speculative decoding"),
    "decode-cp": (
        {"decode_context_parallel_size": 2, "tensor_parallel_size": 2},
        "decode context parallelism",
    ),
    "prefill-cp": (
        {"prefill_context_parallel_size": 2, "tensor_parallel_size": 2},
        "prefill context parallelism",
    ),
    "lora": ({"enable_lora": True}, "LoRA"),
    "dual-batch-overlap": ({"enable_dbo": True}, "micro-batched"),
    "no-hybrid-manager": ({"disable_hybrid_kv_cache_manager": True}, "hybrid KV cache manager"),
    "fast-prefill": ({"kv_sharing_fast_prefill": True}, "kv_sharing_fast_prefill"),
    # embeddings, rewards: vLLM converts the causal LM into a pooling model
    "pooling": ({"runner": "pooling"}, "pooling runner"),
    # vLLM turns this into an OffloadingConnector after the config hook has run
    "kv-offloading": ({"kv_offloading_size": 1.0}, "KV offloading"),
    # vLLM's default on CUDA; the CPU build turns it off after the config hook
    "async-scheduling": ({"async_scheduling": True}, "asynchronous scheduling"),
}


def build_config(directory, **options):
    args = {**engine_args(SPEED, directory), **options}
    return EngineArgs(model=str(directory), dtype="float32", **args).create_engine_config()


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_engine_start(directory, case):
    options, message = CASES[case]
    with pytest.raises(Unsupported, match=message) as refused:
        build_config(directory, **options)
    assert "\n" not in str(refused.value)  # one sentence, no validation report


def test_a_platform_without_the_hybrid_manager_is_refused(directory, monkeypatch):
    """vLLM turns its hybrid KV cache manager off after the config hook where the platform
    lacks it; the hook refuses that platform before, from the same question."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "support_hybrid_kv_cache", lambda: False)
    with pytest.raises(Unsupported, match="which this platform does not offer") as refused:
        build_config(directory)
    assert "\n" not in str(refused.value)


def test_chunked_local_attention_is_refused(directory):
    """Llama 4's chunked local attention, which vLLM also answers by turning the hybrid manager
    off after the hook, is refused in the hook: its chunks would be cut over compact rows."""
    args = engine_args(SPEED, directory)
    args["hf_overrides"] = {**args["hf_overrides"], "attention_chunk_size": 64}
    with pytest.raises(Unsupported, match="chunked local attention") as refused:
        EngineArgs(model=str(directory), dtype="float32", **args).create_engine_config()
    assert "\n" not in str(refused.value)


def test_model_runner_v2_is_refused_when_asked_for(directory, monkeypatch):
    monkeypatch.setenv(support.V2_RUNNER, "1")
    with pytest.raises(Unsupported, match="V1 model runner"):
        build_config(directory)


def test_the_supported_configuration_starts(directory):
    config = build_config(directory)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert not config.use_v2_model_runner
    assert config.cache_config.enable_prefix_caching  # vLLM's default, with SPEED too


def test_stock_blocks_turn_prefix_caching_off(directory):
    """With stock blocks the upper layers' compact rows sit in a request's first blocks, which
    a prefix hit would share: SPEED turns prefix caching off (and says so) instead."""
    args = engine_args(SPEED, directory)
    args["hf_overrides"] = {**args["hf_overrides"], "speedkv_compact_kv": False}
    config = EngineArgs(model=str(directory), dtype="float32", enable_prefix_caching=True,
                        **args).create_engine_config()  # fmt: skip
    assert not config.cache_config.enable_prefix_caching


def test_on_a_gpu_speed_chooses_the_v1_runner_and_no_graphs(monkeypatch):
    """A GPU install defaults to Model Runner V2, FULL_AND_PIECEWISE CUDA graphs and
    asynchronous scheduling, and ROCm with AITER to the fused RoPE + KV-cache write. Where the
    user chose none of them, SPEED takes V1, no graphs, no async scheduling and no fused
    write (torch.compile stays on)."""
    monkeypatch.delenv(support.V2_RUNNER, raising=False)
    monkeypatch.setattr(support, "_on_cpu", lambda: False)
    config = fake_config(v2=True)
    support.prepare(config)
    assert support.os.environ[support.V2_RUNNER] == "0" and not config.use_v2_model_runner
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.scheduler_config.async_scheduling is False
    passes = config.compilation_config.pass_config
    assert passes.fuse_rope_kvcache is False and passes.fuse_qk_norm_rope_kvcache is False


@pytest.mark.parametrize("fusion", support.FUSED_KV_WRITES)
def test_a_fused_rope_and_kv_cache_write_is_refused(directory, monkeypatch, fusion):
    """vLLM keeps the fused RoPE + KV-cache write passes on ROCm only (it turns them off
    elsewhere as the pass configuration is made): that configuration is made here as on ROCm,
    then the engine's configuration is built from it, as `LLM(...)` would."""
    from vllm.config import CompilationConfig, PassConfig
    from vllm.platforms import current_platform

    with monkeypatch.context() as rocm:
        rocm.setattr(current_platform, "is_rocm", lambda: True)
        compilation = CompilationConfig(cudagraph_mode="NONE",
                                        pass_config=PassConfig(**{fusion: True}))  # fmt: skip
    assert getattr(compilation.pass_config, fusion) is True
    with pytest.raises(Unsupported, match="fused RoPE and KV-cache write") as refused:
        build_config(directory, compilation_config=compilation)
    assert "\n" not in str(refused.value)


def tiny_config(directory, family: str, **options):
    """A config.json alone: vLLM builds an engine configuration from it without weights."""
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    kind = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kind(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
         **options).save_pretrained(directory)  # fmt: skip
    return directory


def speed_overrides(arch: str = "SpeedLlamaForCausalLM", **more):
    """SPEED selected by hand, as a user may write it without `engine_args`."""
    return {"architectures": [arch], "speedkv_lcut": 3, "speedkv_anchors": 1,
            "speedkv_deep": 1, **more}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "options", "arch"),
    [
        # a windowed Mistral (Mistral-7B-v0.1's config), under SPEED's Llama and its Mistral
        ("mistral", {"sliding_window": 64}, "SpeedLlamaForCausalLM"),
        ("mistral", {"sliding_window": 64}, "SpeedMistralForCausalLM"),
        # every layer sliding: vLLM's cache configuration carries the window
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
         "SpeedQwen2ForCausalLM"),
        # the upper two layers sliding: their layer types carry it
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
         "SpeedQwen2ForCausalLM"),
        # Qwen3 carries Qwen2's switch
        ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0,
                   "head_dim": 32}, "SpeedQwen3ForCausalLM"),
    ],
)  # fmt: skip
def test_sliding_window_models_start_with_prefix_caching(tmp_path, family, options, arch):
    """SPEED selected by hand on a sliding-window model: the configuration builds, with the
    window the rule reads and vLLM's prefix caching left on (a windowed group reuses prefixes
    whose upper rows are the anchors alone: test_vllm_sliding_window.py)."""
    model = tiny_config(tmp_path, family, **options)
    config = EngineArgs(model=str(model), hf_overrides=speed_overrides(arch), dtype="float32",
                        skip_tokenizer_init=True).create_engine_config()  # fmt: skip
    assert support.sliding_window(config) == 64
    assert config.cache_config.enable_prefix_caching is True


def test_a_windowed_model_whose_pipeline_stages_choose_stock_blocks_is_refused(tmp_path):
    """The windowed Mistral by hand under two pipeline stages: at lcut 3 of 4 the stages'
    own upper blocks would cost more than stock ones, so SPEED would choose stock blocks, whose
    first block (the anchor's) vLLM's window manager frees. Refused instead."""
    model = tiny_config(tmp_path, "mistral", sliding_window=64)
    with pytest.raises(Unsupported, match="own KV blocks only") as refused:
        EngineArgs(model=str(model), hf_overrides=speed_overrides(), dtype="float32",
                   skip_tokenizer_init=True,
                   pipeline_parallel_size=2).create_engine_config()  # fmt: skip
    assert "\n" not in str(refused.value)


def test_a_window_of_unknown_size_is_refused_at_llm(tmp_path):
    """Qwen2's switch turned on in hf_overrides, after the config dropped its window: the
    rule has no window to read."""
    from vllm import LLM

    model = tiny_config(tmp_path, "qwen2")
    overrides = speed_overrides("SpeedQwen2ForCausalLM", use_sliding_window=True)
    with pytest.raises(Unsupported, match="size of this model's sliding window") as refused:
        LLM(model=str(model), hf_overrides=overrides, dtype="float32",
            skip_tokenizer_init=True, enforce_eager=True)  # fmt: skip
    assert "\n" not in str(refused.value)


def test_a_qwen2_without_its_window_and_a_disabled_window_start(tmp_path):
    """Qwen2 checkpoints carry a window they do not use (use_sliding_window false): not
    refused; nor is a window the user disables (vLLM then runs full attention within it)."""
    plain = tiny_config(tmp_path / "plain", "qwen2", sliding_window=64)
    config = EngineArgs(model=str(plain), hf_overrides=speed_overrides("SpeedQwen2ForCausalLM"),
                        skip_tokenizer_init=True).create_engine_config()  # fmt: skip
    assert support.sliding_window(config) is None
    windowed = tiny_config(tmp_path / "windowed", "mistral", sliding_window=64)
    config = EngineArgs(model=str(windowed), hf_overrides=speed_overrides(),
                        disable_sliding_window=True,
                        skip_tokenizer_init=True).create_engine_config()  # fmt: skip
    assert support.sliding_window(config) is None and config.model_config.max_model_len == 64


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.PIECEWISE,
                                  CUDAGraphMode.FULL_DECODE_ONLY])  # fmt: skip
def test_on_a_gpu_cuda_graphs_asked_for_are_refused(monkeypatch, mode):
    monkeypatch.setenv(support.V2_RUNNER, "0")
    monkeypatch.setattr(support, "_on_cpu", lambda: False)
    with pytest.raises(Unsupported, match="without CUDA graphs"):
        support.prepare(fake_config(graphs=mode))


def speedkv(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: its own process, vLLM's log lines included."""
    command = [sys.executable, "-m", "speedkv.cli.app", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_cli_refuses_with_one_sentence():
    done = speedkv("generate", "hi", "--backend", "vllm", "--method", SPEED,
                   "--vllm-arg=--enable-lora")  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: SPEED does not serve LoRA adapters")


def test_serve_refuses_before_vllm_starts():
    """Refused before vLLM's server is started (it would answer on the port and never exit)."""
    connector = json.dumps(CONNECTOR)
    done = speedkv("serve", "--backend", "vllm", "--method", SPEED, "--port", "0",
                   f"--vllm-arg=--kv-transfer-config={connector}")  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: SPEED does not run with a KV connector")
    )
