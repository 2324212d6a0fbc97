"""SPEED on vLLM's default path: torch.compile on, each half of the layer loop compiled on its
own with a dynamic row count (speedkv/vllm/stacks.py). Float32 greedy tokens against speedkv's
own engine over the mixed batch, and the refusals of CUDA graphs."""

from __future__ import annotations

import pytest

from speedkv.vllm.args import engine_args

from conftest import LONG, NEW, run_vllm, upper_rows


@pytest.mark.parametrize(
    ("method", "anchors", "deep", "llm_args"),
    [
        # two upper KV cache groups, and chunks that split prompts anywhere: `make test`
        ("speed:lcut=10,anchors=bos,deep=4", 1, 4, {"max_num_batched_tokens": 512}),
        # one upper group, whole prompts: on demand (the same compiled stacks as above)
        pytest.param("speed:lcut=22,anchors=bos,deep=1", 1, 1, {}, marks=LONG),
    ],
    ids=["lcut10-chunked", "lcut22"],
)
def test_compiled_speed_equals_the_engine(directory, prompts, reference, method, anchors, deep,
                                          llm_args):  # fmt: skip
    args = engine_args(method, directory)
    assert args["compilation_config"] == {"cudagraph_mode": "NONE"}  # compiled, no graphs
    run = run_vllm(directory, prompts, NEW, **args, **llm_args, enforce_eager=False)
    assert run.tokens == reference(method, prompts)
    assert run.upper_rows == upper_rows(prompts, anchors, deep, NEW)
