"""Tests of the vLLM backend. They run where vLLM is installed (`make vllm-venv` builds
.venv-vllm; `make test` runs them there); tests/conftest.py leaves them out elsewhere.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), in float32 and eagerly, so its
greedy tokens can be compared with speedkv's own engine."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@dataclass
class VllmRun:
    tokens: list[list[int]]
    upper_rows: int | None  # rows that entered the upper layers (SPEED models only)
    preemptions: int


def run_vllm(directory, prompts: list[list[int]], new_tokens: int, **llm_args) -> VllmRun:
    """Greedy tokens from one vLLM engine built for this call (float32, eager)."""
    from vllm import LLM, SamplingParams

    llm_args = {"dtype": "float32", "seed": 0, "enforce_eager": True, **llm_args}
    llm = LLM(model=str(directory), disable_log_stats=False, **llm_args)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                  detokenize=not llm_args.get("skip_tokenizer_init"))  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        rows = llm.collective_rpc(
            lambda worker: getattr(worker.model_runner.model, "upper_rows", None)
        )[0]
        preemptions = next(
            (int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"), 0
        )
        return VllmRun([list(o.outputs[0].token_ids) for o in outputs], rows, preemptions)
    finally:
        llm.llm_engine.engine_core.shutdown()  # now, not whenever the collector gets to it
        del llm
        gc.collect()
