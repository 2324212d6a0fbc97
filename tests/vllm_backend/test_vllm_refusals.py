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
    """A GPU install defaults to Model Runner V2 and FULL_AND_PIECEWISE CUDA graphs. Where the
    user chose neither, SPEED takes V1 and no graphs (torch.compile stays on)."""
    monkeypatch.delenv(support.V2_RUNNER, raising=False)
    monkeypatch.setattr(support, "_on_cpu", lambda: False)
    config = fake_config(v2=True)
    support.prepare(config)
    assert support.os.environ[support.V2_RUNNER] == "0" and not config.use_v2_model_runner
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


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
