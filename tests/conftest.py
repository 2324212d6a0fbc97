"""Shared fixtures: tiny random Llama-, Qwen2-, Mistral- and Gemma 3-shaped models, and one real
SmolLM2 instance."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from speedkv.core.engine import Engine
from speedkv.hf.loading import LoadedModel

from helpers import RULER_SAMPLES, ruler_length

# family -> (config class, model class); Qwen2's q/k/v projections carry a bias
TINY_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# what a family's tiny model gets before the caller's settings. Gemma 3: its head size must be
# given (the default is 256); an attention scale that is not 1/sqrt(head_dim); local layers
# with a 16-token window around each global one (which the equivalence tests' prompts of up to
# 90 tokens cross), each type with its own rotary base (transformers' defaults, 10K and 1M);
# a wider init and an untied head, without which its greedy choice mostly repeats one token
# (tied embeddings are tested on their own: tests/unit/test_gemma3.py)
TINY_SETTINGS = {
    "gemma3_text": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        initializer_range=0.05,
        tie_word_embeddings=False,
    ),
}
# the families the shared `tiny` fixture runs each test that takes it on; a test module may
# name its own list as `TINY_PARAMS`: the engine, method, batch and kv_bytes checks take
# EQUIVALENCE_PARAMS, which adds Gemma 3 (its windows and layer shape through the same checks)
TINY_PARAMS = ("llama", "qwen2")
EQUIVALENCE_PARAMS = (*TINY_PARAMS, "gemma3_text")

# the vLLM backend's tests need vLLM, which lives in its own venv (make vllm-venv)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_backend"]

TINY = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",  # the dense reference runs transformers' own eager attention
)


def pytest_configure(config) -> None:
    # under pytest-xdist (make test runs two workers), each worker and the processes it starts
    # get their share of the cores: threads beyond them would only wait on each other
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Test files in the order `make test` hands them out, slowest first: seconds each in its two
# workers (the vLLM suite as it runs after the main one: converted models reused, vLLM's compile
# cache empty), on 2 cores of an AMD EPYC Zen 3 (AVX2 only, 2026-11-29; per file, from each
# test's start and end). `make test` runs pytest-xdist with `--dist loadfile
# --no-loadscope-reorder`, so the long files start first and no worker is left alone with one at
# the end. xdist gives a worker its next file when two tests of its current one remain, so a
# file of one or two tests brings the next with it: two vLLM files (marked) sit a place early,
# the order that ended both workers closest together, replayed over two runs' timings. Files
# not named keep their place after these.
SLOWEST_FIRST = (
    "test_readme.py",  # 328
    "test_ruler.py",  # 303, with the RULER samples the later ruler files reuse
    "test_vllm_scaleout.py",  # 298
    "test_vllm_qwen3_mistral.py",  # 240 (alone; more beside other work)
    "test_vllm_prefix_cache.py",  # 243
    "test_vllm_speed.py",  # 237
    "test_server.py",  # 146
    "test_vllm_serve.py",  # 145
    "test_native_builds.py",  # 135
    "test_kvpress_peer.py",  # 90
    "test_ruler_served.py",  # 88
    "test_readme_vllm.py",  # 84
    "test_vllm_cli.py",  # 68, before the one-test file below
    "test_vllm_kv_blocks.py",  # 78
    "test_real_qwen.py",  # 64
    "test_prefix_reuse.py",  # 56
    "test_kernel_paths.py",  # 52
    "test_evals.py",  # 52
    "test_vllm_compiled.py",  # 43, before the file below
    "test_vllm_refusals.py",  # 47
    "test_gpu_check.py",  # 46
    "test_real_model.py",  # 34
    "test_train.py",  # 34
    "test_prefix_file.py",  # 30
    "test_bench.py",  # 27
    "test_vllm_qwen2.py",  # 15
)


# the suite's tiers, one folder each: every test carries its folder's marker, so `-m unit`
# (make test-fast) or `-m "not integration"` picks tiers whatever paths pytest is given
TIERS = {
    "unit": "unit",
    "integration": "integration",
    "docs": "docs",
    "benchmarks": "benchmarks",
    "vllm_backend": "vllm",
}


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(here):
            continue  # a test from elsewhere that pytest was also given
        folder = item.path.relative_to(here).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.path} is in no tier: test files go in {sorted(TIERS)}")
        item.add_marker(TIERS[folder])
    if missing := [name for name in SLOWEST_FIRST if next(here.rglob(name), None) is None]:
        raise pytest.UsageError(f"SLOWEST_FIRST names test files that do not exist: {missing}")
    rank = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device the tiny models run on (cpu, cuda): the engine's reference tests on "
        "a GPU are these same tests with --device cuda (benchmarks/gpu.py runs them)",
    )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    return torch.device(request.config.getoption("--device"))


def tiny_model(
    family: str, seed: int = 0, device: torch.device | str = "cpu", **config
) -> LoadedModel:
    """A tiny random model; `config` overrides TINY's and TINY_SETTINGS' entries."""
    torch.manual_seed(seed)
    config_class, model_class = TINY_FAMILIES[family]
    hf = model_class(config_class(**{**TINY, **TINY_SETTINGS.get(family, {}), **config}))
    hf.eval().requires_grad_(False)
    # Random init is too flat to discriminate tokens; scale it so greedy choices are decisive.
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0)
        if family == "gemma3_text":  # its norms start at 0 (they scale by 1 + weight)
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    return LoadedModel(name=f"tiny-{family}", hf_model=hf.to(device), tokenizer=None,
                       source="memory")  # fmt: skip


def pytest_generate_tests(metafunc) -> None:
    # the shared tiny model, once a session per family, for the families the module names
    if "tiny" in metafunc.fixturenames:
        families = getattr(metafunc.module, "TINY_PARAMS", TINY_PARAMS)
        metafunc.parametrize("tiny", families, indirect=True, scope="session")


@pytest.fixture(scope="session")
def tiny(request, device) -> Iterator[LoadedModel]:
    model = tiny_model(request.param, device=device)
    yield model
    # every test shares this instance: one that changed its weights or dtype (instead of
    # building its own model) would have skewed every test after it
    fresh = tiny_model(request.param).hf_model.state_dict()
    for key, value in model.hf_model.state_dict().items():
        value = value.cpu()
        unchanged = value.dtype == fresh[key].dtype and torch.equal(value, fresh[key])
        assert unchanged, f"a test changed the shared tiny-{request.param} model ({key})"


@pytest.fixture(scope="session")
def tiny_engine(tiny) -> Engine:
    return Engine(tiny, chunk_size=16)  # small chunks so prompts span several


def random_prompt(n: int, vocab: int = 101, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer and chat template, without its weights (skips if not installed)."""
    from transformers import AutoTokenizer

    from speedkv.hf.loading import EMBEDDED, convert_gguf

    parts = EMBEDDED["smollm2-135m"].part_paths()
    if parts is None:
        pytest.skip("the embedded SmolLM2 is not installed")
    return AutoTokenizer.from_pretrained(convert_gguf(parts[0], progress=False))


@pytest.fixture(scope="session")
def ruler_root(tmp_path_factory, smol_tokenizer) -> Path:
    """A RULER data directory holding every task's samples at `ruler_length`, seed 0: made once
    a session, as each task is a subprocess (test files that use it skip themselves where the
    speedkv[ruler] extra is missing)."""
    from filelock import FileLock

    from speedkv.evals import ruler

    wanted = [(task, ruler_length(task), RULER_SAMPLES) for task in ruler.TASKS]
    # under pytest-xdist the workers share one folder (beside their own temporary ones): the
    # first makes the samples, and the others wait for it and reuse them
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = tmp_path_factory.getbasetemp().parent / "ruler"
    else:
        root = tmp_path_factory.mktemp("ruler")
    with FileLock(f"{root}.lock"):
        ruler.ensure_samples(smol_tokenizer, wanted, 0, root)
    return root


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded default model in float32, loaded once for every real-model test."""
    from speedkv.hf.loading import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="session")
def word_model(smol_tokenizer) -> LoadedModel:
    """A tiny random Llama that speaks SmolLM2's vocabulary and chat template, so whole
    evaluation tasks and benchmarks run in seconds (never modified by a test)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = LlamaForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(name="tiny-words", hf_model=hf, tokenizer=smol_tokenizer, source="memory")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests (tiny models are latency-bound: one thread
    avoids contention on a shared CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
