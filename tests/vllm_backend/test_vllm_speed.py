"""The vLLM backend against speedkv's own engine on SmolLM2-135M: float32, greedy, a batch of
prompts from 1 to 900 tokens (and 1700 and 3000 with SPEEDKV_LONG_TESTS); again with chunked
prefill and with preemption forced."""

from __future__ import annotations

import pytest

from speedkv.prompts.builders import exact_chat_prompt
from speedkv.vllm.args import engine_args
from speedkv.vllm.settings import SpeedSettings

from conftest import LONG, NEW, run_vllm, upper_rows, vllm_engine


def test_full_is_stock_vllm_and_equals_the_engine(directory, prompts, reference):
    assert engine_args("full", directory) == {}
    assert engine_args("speed:lcut=30,deep=1", directory) == {}  # lcut = L is the stock model
    run = run_vllm(directory, prompts, NEW)
    assert run.tokens == reference("full", prompts)


def test_speed_architecture_at_lcut_L_equals_stock(directory, prompts, reference):
    overrides = {
        "architectures": ["SpeedLlamaForCausalLM"],
        "speedkv_lcut": 30,
        "speedkv_anchors": 1,
        "speedkv_deep": 1,
    }
    run = run_vllm(directory, prompts, NEW, hf_overrides=overrides, enable_prefix_caching=False)
    assert run.tokens == reference("full", prompts)
    assert run.upper_rows == 0  # no layer is above the cut


@pytest.mark.parametrize(
    ("method", "anchors", "deep", "llm_args"),
    [
        ("speed:lcut=22,anchors=bos,deep=1", 1, 1, {}),
        ("speed:lcut=22,anchors=bos,deep=4", 1, 4, {}),
        ("speed:lcut=22,anchors=none,deep=1", 0, 1, {}),
        # 10 lower and 20 upper layers: two upper KV cache groups, each with its own metadata
        ("speed:lcut=10,anchors=bos,deep=4", 1, 4, {}),
        # chunked prefill: a 128-token budget splits every long prompt, anywhere in it
        # (with deep=1 on demand: the chunk boundary tests below split at its deep suffix)
        pytest.param(
            "speed:lcut=22,anchors=bos,deep=1", 1, 1, {"max_num_batched_tokens": 128}, marks=LONG
        ),
        ("speed:lcut=22,anchors=bos,deep=4", 1, 4, {"max_num_batched_tokens": 128}),
    ],
    ids=["bos-deep1", "bos-deep4", "none", "lcut10", "chunked-deep1", "chunked-deep4"],
)
def test_speed_equals_the_engine(directory, prompts, reference, method, anchors, deep, llm_args):
    run = run_vllm(directory, prompts, NEW, **engine_args(method, directory), **llm_args)
    assert run.tokens == reference(method, prompts)
    assert run.upper_rows == upper_rows(prompts, anchors, deep, NEW)


@pytest.mark.parametrize("deep", [1, 4])
def test_chunk_boundary_at_the_last_prompt_tokens(directory, smollm, reference, deep):
    """One request whose last chunk holds exactly its deep suffix (and one holding the last
    token alone): the deep rows arrive in a step of their own."""
    budget = 64
    prompts = [exact_chat_prompt(smollm.tokenizer, 3 * budget + deep, start=5)]
    method = f"speed:lcut=22,anchors=bos,deep={deep}"
    run = run_vllm(
        directory, prompts, NEW, **engine_args(method, directory), max_num_batched_tokens=budget
    )
    assert run.tokens == reference(method, prompts)


@pytest.mark.parametrize("compact", [True, False], ids=["compact-kv", "stock-blocks"])
def test_preemption_recomputes_the_same_tokens(directory, smollm, reference, compact):
    """Six prompts that fill their blocks exactly, in a pool with one block to spare: the first
    decode step needs new blocks for every request, so vLLM preempts and later recomputes
    requests (prompt and generated tokens together), which must land on the same SPEED layout.
    With the upper layers' own blocks (compact) or with every layer's (stock)."""
    prompts = [exact_chat_prompt(smollm.tokenizer, 640, start=13 * i) for i in range(6)]
    method = "speed:lcut=22,anchors=bos,deep=4"
    args = engine_args(method, directory)
    args["hf_overrides"]["speedkv_compact_kv"] = compact
    _, lower, upper = SpeedSettings.from_overrides(args["hf_overrides"]).kv_groups(30)
    per_request = lower * 640 // 128 + upper  # the upper groups keep 1 + 4 rows: one block
    run = run_vllm(directory, prompts, 16, **args, num_gpu_blocks_override=6 * per_request + 1,
                   max_model_len=1024)  # fmt: skip
    assert run.preemptions > 0
    assert run.tokens == reference(method, prompts, 16)


def test_prompt_logprobs_are_refused_offline(directory):
    """From Python too: SPEED cannot score prompt tokens, so vLLM refuses the request."""
    from vllm import SamplingParams as VllmSampling
    from vllm.exceptions import VLLMValidationError

    with vllm_engine(directory, **engine_args("speed:lcut=22,deep=1", directory)) as llm:
        with pytest.raises(VLLMValidationError, match="not available under SPEED"):
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                         VllmSampling(max_tokens=2, prompt_logprobs=1), use_tqdm=False)  # fmt: skip
        # everything else runs
        assert llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], VllmSampling(max_tokens=2),
                            use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
