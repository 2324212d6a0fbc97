"""The Python face a transformers user meets first: `Engine.from_hf` on a model they already
have, and `Engine.generate_text` with `generate`-style sampling arguments, checked against
transformers' own `generate` where it has the same option."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError

from conftest import TINY, random_prompt, tiny_model
from helpers import hf_generate


@pytest.fixture(scope="module")
def text_engine(smol_tokenizer) -> Engine:
    """A tiny random Llama over SmolLM2's vocabulary, wrapped by from_hf."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": len(smol_tokenizer)}))
    return Engine.from_hf(hf, smol_tokenizer, chunk_size=16)


# -- Engine.from_hf -----------------------------------------------------------------------------
def test_from_hf_runs_generate_text_end_to_end(text_engine, smol_tokenizer):
    hf = text_engine.model.hf_model
    assert not hf.training and not any(p.requires_grad for p in hf.parameters())
    result = text_engine.generate_text(
        "Name three rivers.", "speed:lcut=4,deep=1", max_new_tokens=6, ignore_eos=True
    )
    assert result.method == "speed:lcut=4,anchors=bos,deep=1,selfonly=false"
    assert len(result.output_ids) == 6 and result.text
    decoded = smol_tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert decoded.startswith(result.text)
    # full attention through from_hf is the model's own greedy generate
    plain = text_engine.generate_text(
        "Name three rivers.", chat=False, max_new_tokens=6, ignore_eos=True
    )
    assert plain.output_ids == hf_generate(hf, plain.prompt_ids, 6, min_new_tokens=6)


def test_from_hf_without_a_tokenizer_takes_token_ids():
    model = tiny_model("llama").hf_model
    engine = Engine.from_hf(model, chunk_size=16)
    ids = random_prompt(30)
    request = Request(ids, make_policy("full", engine.shape), SamplingParams(max_new_tokens=7))
    result = engine.generate([request])[0]
    assert result.output_ids == hf_generate(model, ids, 7) and result.text == ""
    with pytest.raises(UserError, match="no tokenizer"):
        engine.generate_text("text needs a tokenizer")


def test_from_hf_refuses_an_unsupported_architecture():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UserError, match="architecture 'gpt2' is not supported"):
        Engine.from_hf(gpt2)


# -- generate-style sampling arguments ----------------------------------------------------------
def test_do_sample_false_is_greedy_whatever_the_temperature(text_engine):
    greedy = text_engine.generate_text("Hello.", max_new_tokens=6, ignore_eos=True)
    hot = text_engine.generate_text(
        "Hello.", max_new_tokens=6, ignore_eos=True, do_sample=False, temperature=5.0
    )
    assert hot.output_ids == greedy.output_ids


def test_unknown_sampling_argument_is_a_user_error(text_engine):
    with pytest.raises(UserError, match="num_beams; accepted: max_new_tokens, min_new_tokens"):
        text_engine.generate_text("Hello.", num_beams=2)


def test_min_new_tokens_keeps_eos_from_ending_generation():
    model = tiny_model("llama")
    ids, full = random_prompt(12), make_policy("full", model.shape)
    greedy = Engine(model).generate([Request(ids, full, SamplingParams(max_new_tokens=1))])
    eos = greedy[0].output_ids[0]
    model.hf_model.config.eos_token_id = eos  # the greedy first token is now EOS
    engine = Engine(model)
    stopped = engine.generate([Request(ids, full, SamplingParams(max_new_tokens=8))])[0]
    assert stopped.output_ids == [eos] and stopped.finish_reason == "stop"
    sampling = SamplingParams(max_new_tokens=8, min_new_tokens=3)
    held = engine.generate([Request(ids, full, sampling)])[0]
    assert eos not in held.output_ids[:3]
    assert held.output_ids == hf_generate(
        model.hf_model, ids, 8, min_new_tokens=3, eos_token_id=eos
    )


def test_repetition_penalty_decodes_like_transformers(tiny, tiny_engine):
    ids = random_prompt(40, seed=2)
    sampling = SamplingParams(max_new_tokens=10, repetition_penalty=1.5, ignore_eos=True)
    request = Request(ids, make_policy("full", tiny.shape), sampling)
    penalised = tiny_engine.generate([request])[0].output_ids
    expected = hf_generate(tiny.hf_model, ids, 10, min_new_tokens=10, repetition_penalty=1.5)
    assert penalised == expected
    assert penalised != hf_generate(tiny.hf_model, ids, 10, min_new_tokens=10)  # it matters


# -- the README's headline call -----------------------------------------------------------------
@pytest.mark.real_model
def test_generate_text_on_the_embedded_model(smollm2):
    result = Engine(smollm2).generate_text(
        "Name a river in Africa.", method="speed:lcut=22,anchors=bos,deep=1", max_new_tokens=8
    )
    assert result.text.strip()
    assert result.method == "speed:lcut=22,anchors=bos,deep=1,selfonly=false"
    n = len(result.prompt_ids)
    # 22 lower layers hold the prompt, 8 upper layers the BoS anchor and the deep last token;
    # K and V x 3 KV heads x 64 dims x 4 bytes (float32)
    assert result.kv_bytes == (22 * n + 8 * 2) * 2 * 3 * 64 * 4
