"""The Qwen3 (per-head q/k RMSNorm before rotary), Mistral (without a sliding window) and
Llama 3 (its rope scaling, tied embeddings) architectures in vLLM: a small random checkpoint of
each, stock and SPEED, against speedkv's own engine and the dense reference on the same weights
(float32, greedy).

SPEED runs on one engine per family and rank count, with a 64-token step budget (the short
prompts whole, the long ones in chunks) and prefix caching on: a mixed batch, then a question
on a document of the batch and the next turn of a conversation of the batch, each reusing
cached blocks (test_vllm_prefix_cache.py's replay and dense reference check them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from speedkv import Engine, Request, SamplingParams, make_policy
from speedkv.errors import Unsupported
from speedkv.hf.loading import wrap_model
from speedkv.vllm.args import engine_args

from conftest import LONG_TESTS, run_vllm, save_tiny_checkpoint, upper_rows, vllm_engine
from test_vllm_prefix_cache import BLOCK, Replay, Served, check

LENGTHS = [1, 3, 40, 129, 300, 380]
NEW = 8
LAYERS = 6
VOCAB = 512
BUDGET = 64  # tokens per step: every prompt from 129 tokens up runs in chunks
METHOD, ANCHORS, DEEP = "speed:lcut=4,anchors=sink:2,deep=3", 2, 3

FAMILIES = {
    # head_dim: Qwen3's default is 128; vLLM's CPU kernel takes 32 (hidden 128 / 4 heads)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}, "SpeedQwen3ForCausalLM"),
    # MistralConfig's default window is 4096: windowed models run in test_vllm_sliding_window
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None},
                "SpeedMistralForCausalLM"),
    # Llama 3's rope scaling (past original_max_position_embeddings from 64 tokens on) and
    # tied embeddings, as Llama-3.2-1B's config has them
    "llama3": (LlamaConfig, LlamaForCausalLM,
               {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                "tie_word_embeddings": True},
               "SpeedLlamaForCausalLM"),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A random 6-layer model of the family (4 query, 2 KV heads of 32), its weights scaled so
    greedy choices are decisive, saved as an HF directory; and its SPEED architecture name."""
    config_cls, model_cls, options, arch = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = save_tiny_checkpoint(config_cls, model_cls, directory, LAYERS, VOCAB, **options)
    return directory, model, arch


@pytest.fixture(scope="module")
def prompts():
    return random_ids(LENGTHS, seed=1)


def random_ids(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def engine_tokens(model, method: str, prompts) -> list[list[int]]:
    engine = Engine.from_hf(model)
    policy = lambda: make_policy(method, engine.shape)  # noqa: E731
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return [
        g.output_ids for g in engine.generate([Request(p, policy(), sampling) for p in prompts])
    ]


def dense_tokens(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' own forward over the prompt and the tokens fed back: its greedy choice
    at every generated position."""
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


def test_full_is_stock_vllm_and_speed_at_lcut_L_equals_it(checkpoint, prompts):
    """`full` and SPEED at lcut = L are stock vLLM (no arguments); the SPEED architecture
    chosen by hand at lcut = L runs no row above the cut and gives stock vLLM's tokens, which
    equal speedkv's engine and transformers' forward."""
    directory, model, arch = checkpoint
    assert engine_args("full", directory) == {}
    assert engine_args(f"speed:lcut={LAYERS},deep=1", directory) == {}
    stock = run_vllm(directory, prompts, NEW, skip_tokenizer_init=True)
    assert stock.tokens == engine_tokens(model, "full", prompts)
    assert stock.tokens == [dense_tokens(model, p, t) for p, t in zip(prompts, stock.tokens)]
    overrides = {"architectures": [arch], "speedkv_lcut": LAYERS, "speedkv_anchors": 1,
                 "speedkv_deep": 1}  # fmt: skip
    speed = run_vllm(directory, prompts, NEW, skip_tokenizer_init=True, hf_overrides=overrides,
                     enable_prefix_caching=False)  # fmt: skip
    assert speed.tokens == stock.tokens
    assert speed.upper_rows == 0


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_speed_chunked_and_reused_equals_the_engine_and_the_dense_reference(
    checkpoint, prompts, tp
):
    """A mixed batch (short prompts whole, long ones chunked), then a question on the
    300-token prompt's first 200 tokens (one cached block) and the next turn of the
    380-token prompt's conversation (three cached blocks, its deep suffix and answer
    included). With 2 tensor-parallel ranks, each holds 2 query heads and 1 KV head (and
    Qwen3's q/k norms run per head on each rank). Mistral's and Llama 3's layers are vLLM's
    Llama layers: their two ranks run in `make test-long`, as SmolLM2's three do."""
    from vllm import SamplingParams as VllmSampling

    directory, model, arch = checkpoint
    if tp > 1 and arch in ("SpeedMistralForCausalLM", "SpeedLlamaForCausalLM") and not LONG_TESTS:
        pytest.skip("SPEEDKV_LONG_TESTS=1 (make test-long) runs it")
    args = engine_args(METHOD, directory)
    assert args["hf_overrides"]["architectures"] == [arch]
    sampling = VllmSampling(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                            detokenize=False)  # fmt: skip

    def served(outputs) -> list[Served]:
        return [
            Served(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
                   [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                   o.num_cached_tokens)
            for o in outputs
        ]  # fmt: skip

    question, turn = random_ids([60, 100], seed=2)
    with vllm_engine(directory, **args, skip_tokenizer_init=True, max_num_batched_tokens=BUDGET,
                     enable_prefix_caching=True, tensor_parallel_size=tp) as llm:  # fmt: skip
        done = served(llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                                   use_tqdm=False))  # fmt: skip
        rows = llm.collective_rpc(lambda worker: worker.model_runner.model.upper_rows)
        later = [prompts[4][:200] + question, prompts[5] + done[5].tokens + turn]
        for ids in later:  # one after another: the second reuses the batch's answer
            done += served(llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False))
    assert rows == [upper_rows(prompts, ANCHORS, DEEP, NEW)] * tp
    fed = len(prompts[5]) + NEW - 1  # the conversation's tokens computed: its blocks cached
    assert [s.hit for s in done] == [0] * len(prompts) + [BLOCK, fed // BLOCK * BLOCK]
    check(Replay(wrap_model(model), METHOD, new=NEW), done)


def test_a_time_conditioned_mistral_is_refused():
    """Mistral's time-conditioned norms (`ada_rms_norm_t_cond`) take an input SPEED's layer
    loop does not pass: refused as the model is built, before any layer is."""
    from speedkv.vllm.models import SpeedMistralForCausalLM

    hf_config = SimpleNamespace(ada_rms_norm_t_cond=True)
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config))
    with pytest.raises(Unsupported, match="ada_rms_norm_t_cond"):
        SpeedMistralForCausalLM(vllm_config=config)
