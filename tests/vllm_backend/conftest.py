"""Tests of the vLLM backend. They run where vLLM is installed (`make vllm-venv` builds
.venv-vllm; `make test` runs them there); tests/conftest.py leaves them out elsewhere.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), in float32 and eagerly unless a
test asks for vLLM's compilation, so its greedy tokens can be compared with speedkv's own engine.
Tensor- and pipeline-parallel runs start one worker process per rank, each bound to a core."""

from __future__ import annotations

import functools
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from speedkv import Engine, Request, SamplingParams, load_model, make_policy
from speedkv.hf.loading import model_directory
from speedkv.prompts.builders import exact_chat_prompt, raw_passage
from speedkv.vllm.compact import compact_length
from speedkv.vllm.offline import cpu_engine_defaults

# set before vLLM is imported (speedkv's modules above do not import it)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# a 1 GiB KV pool, and no AOT compile step (whose artifacts vLLM-CPU cannot load again)
cpu_engine_defaults(1)
# the tests read counters off the workers (collective_rpc with a function): with worker
# processes (tensor parallel) vLLM pickles the function, which it allows only when asked
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# under pytest-xdist two workers may compile the same engine at once, and vLLM writes its
# compile cache's files in place: each worker keeps a cache of its own
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    caches = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(caches, "vllm", f"pytest-{worker}"))


@dataclass
class VllmRun:
    tokens: list[list[int]]
    upper_rows: int | None  # rows that entered the upper layers (SPEED models only)
    preemptions: int
    rank_rows: list[int | None]  # upper_rows of every worker (tensor-parallel ranks)


@contextmanager
def vllm_engine(directory, **llm_args):
    """One vLLM engine (float32, eager, seed 0 unless asked otherwise), each worker bound to a
    core, shut down when the block ends."""
    from vllm import LLM

    from speedkv.vllm.offline import cpu_thread_binding, shut_down

    llm_args = {"dtype": "float32", "seed": 0, "enforce_eager": True, **llm_args}
    binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    ranks = llm_args.get("tensor_parallel_size", 1) * llm_args.get("pipeline_parallel_size", 1)
    cpu_thread_binding(ranks)
    llm = LLM(model=str(directory), disable_log_stats=False, **llm_args)
    try:
        yield llm
    finally:
        shut_down(llm)
        del llm
        gc.collect()
        # vLLM runs a full collection three times as an engine starts, each walking every
        # object of this process (some 700,000: torch, transformers, vLLM, the reference
        # models). What is alive between engines is frozen, so those walks skip it; vLLM's
        # shutdown unfreezes it all again, so nothing stays uncollectable past an engine
        gc.freeze()
        if binding is None:  # the next engine may have another number of ranks
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def run_vllm(directory, prompts: list[list[int]], new_tokens: int, **llm_args) -> VllmRun:
    """Greedy tokens from one vLLM engine built for this call (float32, eager)."""
    from vllm import SamplingParams

    with vllm_engine(directory, **llm_args) as llm:
        sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                  detokenize=not llm_args.get("skip_tokenizer_init"))  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        rows = llm.collective_rpc(
            lambda worker: getattr(worker.model_runner.model, "upper_rows", None)
        )
        preemptions = next(
            (int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"), 0
        )
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return VllmRun(tokens, rows[0], preemptions, rows)


# -- SmolLM2-135M, a mixed batch and speedkv's own engine's tokens, shared by the test files --
NEW = 8
# SPEEDKV_LONG_TESTS=1 adds prompts of 1700 and 3000 tokens: with them the batch passes vLLM's
# 4096-token step budget, so its longest prompt is split by the default scheduler too (the
# chunked cases split every long prompt either way). Without them the batch's tests take a
# third of the time; 900 tokens still span eight 128-token blocks and two 512-token chunks.
LONG_TESTS = bool(os.environ.get("SPEEDKV_LONG_TESTS"))
LENGTHS = [1, 2, 5, 37, 300, 900] + ([1700, 3000] if LONG_TESTS else [])
# what `make test` leaves to `make test-long`: the cases another CI case covers on the same path
LONG = pytest.mark.skipif(not LONG_TESTS, reason="SPEEDKV_LONG_TESTS=1 (make test-long) runs it")


@pytest.fixture(scope="session")
def smollm():
    return load_model("smollm2-135m", dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="session")
def directory():
    return model_directory("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    return [
        raw_passage(tok, n, "eval", 7 * i + 3) if n < 40 else exact_chat_prompt(tok, n, 11 * i)
        for i, n in enumerate(LENGTHS)
    ]


@pytest.fixture(scope="session")
def reference(smollm):
    """speedkv's own engine: greedy tokens of a method over prompts (memoised)."""
    engine = Engine(smollm)

    @functools.cache
    def tokens(method: str, prompts: tuple[tuple[int, ...], ...], new: int = NEW):
        requests = [
            Request(
                list(p),
                make_policy(method, smollm.shape),
                SamplingParams(max_new_tokens=new, ignore_eos=True),
            )
            for p in prompts
        ]
        return [g.output_ids for g in engine.generate(requests)]

    return lambda method, prompts, new=NEW: tokens(method, tuple(map(tuple, prompts)), new)


def upper_rows(prompts, anchors: int, deep: int, new: int) -> int:
    """Rows SPEED sends through the upper layers: each prompt's full-depth positions, then
    every generated token that is fed back (the last one never is)."""
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_rows = compact_length(lengths, lengths, anchors, deep).sum().item()
    return int(prompt_rows) + len(prompts) * (new - 1)


def fake_config(v2: bool = False, graphs=None, pipeline: int = 1, hf_config=None):
    """What `speedkv.vllm.support` reads of an engine's configuration, for the paths this
    machine cannot build one for (a GPU's defaults, pipeline stages): Model Runner V2 is
    vLLM's default where Triton is installed, unless VLLM_USE_V2_MODEL_RUNNER says otherwise."""

    class Config(SimpleNamespace):
        @property
        def use_v2_model_runner(self) -> bool:
            chosen = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
            return v2 if chosen is None else chosen == "1"

    # the options vLLM settles after the config hook: None where the user left them
    passes = SimpleNamespace(fuse_rope_kvcache=None, fuse_qk_norm_rope_kvcache=None)
    return Config(
        model_config=SimpleNamespace(hf_config=hf_config),
        compilation_config=SimpleNamespace(cudagraph_mode=graphs, pass_config=passes),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1, enable_dbo=False,
                                        use_ubatching=False),  # fmt: skip
        cache_config=SimpleNamespace(enable_prefix_caching=False, kv_sharing_fast_prefill=False),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False,
                                         async_scheduling=None),  # fmt: skip
        kv_transfer_config=None, speculative_config=None, lora_config=None,
    )  # fmt: skip


def save_tiny_checkpoint(config_cls, model_cls, directory, layers: int = 6, vocab: int = 512,
                         **options):  # fmt: skip
    """A random decoder of `layers` layers (hidden 128, 4 query and 2 KV heads of 32, vLLM's
    CPU kernel's head size), its weights scaled so greedy choices are decisive, saved as an HF
    directory; returns the model. Gemma 3's norms scale by 1 + weight (0 at init): they get a
    spread instead."""
    torch.manual_seed(0)
    fields = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None)  # fmt: skip
    config = config_cls(**(fields | options))
    model = model_cls(config).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if config.model_type == "gemma3_text" and name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.mul_(3.0)
    model.save_pretrained(directory)
    return model
