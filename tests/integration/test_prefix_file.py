"""A cached prefix saved to a file and loaded back continues exactly as the prefix in memory
(and as the dense reference, on the real model); every wrong, damaged or foreign file is one
UserError in Python and one sentence with exit 2 on the command line, never an answer."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_prefix_reuse import REAL_SPECS, dense_rows, engine_rows, rule_of, suffix_positions

from speedkv.core.engine import Engine
from speedkv.core.prefix import CachedPrefix
from speedkv.core.prefix_file import _digest, load_prefix, save_prefix
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.hf.loading import LoadedModel

from conftest import random_prompt, tiny_model
from helpers import run_cli

DOC, QUESTION, NEW = 41, 9, 6
SPEC = "speed:lcut=3,anchors=bos,deep=1"


def saved(engine: Engine, tmp_path, spec: str = SPEC, doc=None) -> tuple[CachedPrefix, object]:
    """A prefix of a random document under `spec`, and the file it was saved to."""
    cached = engine.prefill(doc if doc is not None else random_prompt(DOC, seed=11), spec)
    path = tmp_path / "doc.kv"
    save_prefix(cached, path, engine)
    return cached, path


def rewrite(path, change) -> None:
    """Let `change(metadata, tensors)` edit a prefix file in place, then give it a valid
    checksum again: a file that is whole but says something wrong."""
    with safe_open(path, framework="pt") as file:
        metadata = dict(file.metadata())
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    change(metadata, tensors)
    metadata["sha256"] = _digest(metadata, tensors)
    save_file(tensors, path, metadata=metadata)


# -- the round trip ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        "full",
        SPEC,
        "speed:lcut=2,anchors=none,deep=3",
        "speed:lcut=3,anchors=bos,selfonly=true,deep=1",
    ],
)
def test_a_loaded_prefix_continues_exactly_as_the_one_in_memory(tiny, tiny_engine, tmp_path, spec):
    cached, path = saved(tiny_engine, tmp_path, spec)
    loaded = load_prefix(path, tiny_engine)
    assert loaded.ids == cached.ids and loaded.method == cached.method
    assert loaded.cache.lengths() == cached.cache.lengths()
    assert loaded.nbytes() == cached.nbytes()  # the live entries, nothing reserved
    for a, b in zip(loaded.cache.layers, cached.cache.layers):
        assert torch.equal(a.keys(), b.keys()) and torch.equal(a.positions(), b.positions())
    question = random_prompt(QUESTION, seed=12)
    from_file = tiny_engine.generate(loaded, question, max_new_tokens=NEW)
    in_memory = tiny_engine.generate(cached, question, max_new_tokens=NEW)
    assert from_file.output_ids == in_memory.output_ids
    assert from_file.reused_tokens == DOC and from_file.kv_bytes == in_memory.kv_bytes
    assert path.stat().st_size < cached.nbytes() + 8192  # keys and values, ids, a header


def test_the_fingerprint_follows_the_weights_not_the_dtype(tiny):
    base = tiny.backbone.fingerprint()
    half = LoadedModel("half", copy.deepcopy(tiny.hf_model).to(torch.bfloat16), None, "memory")
    assert half.backbone.fingerprint() == base
    tuned = copy.deepcopy(tiny.hf_model)
    with torch.no_grad():  # what merging a small adapter does: one projection moves by 0.1 %
        weight = tuned.model.layers[2].self_attn.v_proj.weight
        weight.add_(1e-3 * weight.abs().mean() * torch.randn_like(weight))
    assert LoadedModel("tuned", tuned, None, "memory").backbone.fingerprint() != base
    assert (
        tiny_model("llama", seed=1).backbone.fingerprint()
        != tiny_model("llama").backbone.fingerprint()
    )


# -- files that must be refused ---------------------------------------------------------------
def test_a_file_from_another_model_or_dtype_is_refused(tiny, tiny_engine, tmp_path):
    _, path = saved(tiny_engine, tmp_path)
    other = Engine(tiny_model(tiny.hf_model.config.model_type, seed=1))
    with pytest.raises(UserError, match="saved from another model or other weights"):
        load_prefix(path, other)
    half = LoadedModel("half", copy.deepcopy(tiny.hf_model).to(torch.bfloat16), None, "memory")
    with pytest.raises(
        UserError, match="saved from the model in float32 and this one runs in bfloat16"
    ):
        load_prefix(path, Engine(half))


def damage_truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def damage_header(data: bytes) -> bytes:
    return data[:40] + b"\x00" + data[41:]  # not JSON any more


def damage_a_value(data: bytes) -> bytes:
    return data.replace(b"lcut=3", b"lcut=4", 1)  # still JSON: another method


def damage_a_key(data: bytes) -> bytes:
    return data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]  # one bit of the last layer


@pytest.mark.parametrize(
    "damage, message",
    [
        (damage_truncated, "not a readable prefix file"),
        (damage_header, "not a readable prefix file"),
        (damage_a_value, "is damaged"),
        (damage_a_key, "is damaged"),
        (lambda data: bytes(range(256)) * 64, "not a readable prefix file"),
        (lambda data: b"", "not a readable prefix file"),
    ],
)
def test_a_damaged_file_is_refused(tiny_engine, tmp_path, damage, message):
    _, path = saved(tiny_engine, tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError, match=message):
        load_prefix(path, tiny_engine)


def test_files_that_are_not_prefix_files_are_refused(tiny_engine, tmp_path):
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, weights, metadata={"format": "pt"})
    with pytest.raises(UserError, match="is not a speedkv prefix file"):
        load_prefix(weights, tiny_engine)
    with pytest.raises(UserError, match="does not exist"):
        load_prefix(tmp_path / "missing.kv", tiny_engine)
    with pytest.raises(UserError, match="is a directory"):
        load_prefix(tmp_path, tiny_engine)
    _, path = saved(tiny_engine, tmp_path)
    rewrite(path, lambda metadata, _: metadata.update(version="2"))
    with pytest.raises(UserError, match="format version '2'; speedkv .* reads version 1"):
        load_prefix(path, tiny_engine)


def swap_two_positions(metadata, tensors):
    positions = tensors["layers.0.positions"]
    positions[:, [3, 4]] = positions[:, [4, 3]]


def position_beyond_the_prefix(metadata, tensors):
    tensors["layers.5.positions"][:, -1] = DOC


def drop_a_layer(metadata, tensors):
    for part in ("keys", "values", "positions"):
        del tensors[f"layers.5.{part}"]


def heads_disagree(metadata, tensors):
    tensors["layers.1.positions"][1, 2] = 1


def wrong_token_count(metadata, tensors):
    metadata["tokens"] = str(DOC + 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (swap_two_positions, "layer 0's positions are not increasing"),
        (position_beyond_the_prefix, "layer 5's positions are not increasing positions below"),
        (heads_disagree, "the same in every head"),
        (drop_a_layer, "layer 5 lacks its keys"),
        (wrong_token_count, "do not match its token count"),
        (lambda m, t: t.update(ids=t["ids"] + 1000), "outside the vocabulary"),
        (lambda m, t: m.update(messages='{"role": 1}'), "not a list of {role, content}"),
        (lambda m, t: m.update(kv_heads="4"), "do not fit the model"),
        (
            lambda m, t: t.update({"layers.2.keys": t["layers.2.keys"][:, :-1].contiguous()}),
            "layer 2 holds",
        ),
    ],
)
def test_a_whole_but_inconsistent_file_is_refused(tiny_engine, tmp_path, change, message):
    _, path = saved(tiny_engine, tmp_path)
    rewrite(path, change)
    with pytest.raises(UserError, match=message):
        load_prefix(path, tiny_engine)


def test_a_method_whose_cache_depends_on_the_question_is_not_saved(tiny, tiny_engine, tmp_path):
    cached = tiny_engine.prefill(random_prompt(DOC), "full")
    snap = CachedPrefix(cached.ids, make_policy("snapkv", tiny.shape).spec(), cached.cache)
    with pytest.raises(UserError, match="cannot serve another prompt"):
        save_prefix(snap, tmp_path / "snap.kv", tiny_engine)
    assert not (tmp_path / "snap.kv").exists()


def test_a_prefix_and_question_longer_than_the_context_are_refused(tiny_engine, tmp_path):
    limit = tiny_engine.shape.max_positions
    _, path = saved(tiny_engine, tmp_path, doc=random_prompt(limit - 4))
    with pytest.raises(UserError, match=f"more than the model's context of {limit}"):
        tiny_engine.generate(load_prefix(path, tiny_engine), random_prompt(8), max_new_tokens=2)


# -- the command line, on a tiny model with SmolLM2's tokenizer --------------------------------
DOCUMENT = "The lighthouse keeper's cat is called Biscuit. She sleeps on the third step. " * 4


def cli(args, monkeypatch, capsys, model):
    code, out, err = run_cli(args, monkeypatch, capsys, model=model)
    said = [line for line in err.splitlines() if line.strip() and not line.startswith("[")]
    if code == 2:  # log lines aside, one sentence
        assert len(said) == 1 and said[0].startswith("error: ") and "Traceback" not in err, err
    return code, out, err


def prefill_cli(tmp_path, monkeypatch, capsys, model, *options):
    path = tmp_path / "doc.kv"
    args = ["prefill", DOCUMENT, "--method", SPEC, "--save", str(path), "--json", *options]
    code, out, err = cli(args, monkeypatch, capsys, model)
    assert code == 0, err
    return path, json.loads(out)


def test_prefill_then_generate_load_on_the_command_line(word_model, tmp_path, monkeypatch, capsys):
    path, record = prefill_cli(tmp_path, monkeypatch, capsys, word_model)
    engine = Engine(word_model)
    assert record["method"] == make_policy(SPEC, word_model.shape).spec()
    assert record["path"] == str(path) and record["file_bytes"] == path.stat().st_size
    assert record["chat"] is True and record["kv_bytes"] > 0 and record["ttft_s"] > 0
    assert record["dtype"] == "float32" and record["model"] == word_model.name
    in_memory = engine.prefill(DOCUMENT, SPEC)
    assert record["prompt_ids"] == in_memory.ids
    question = ["generate", "--load", str(path), "Who sleeps there?", "-n", "5", "--json"]
    code, out, err = cli(question, monkeypatch, capsys, word_model)
    assert code == 0, err
    result = json.loads(out)
    expected = engine.generate(in_memory, "Who sleeps there?", max_new_tokens=5)
    assert result["output_ids"] == expected.output_ids
    assert result["prompt_ids"] == expected.prompt_ids
    assert result["prompt_ids"][: len(in_memory)] == in_memory.ids
    assert result["reused_tokens"] == len(in_memory) and result["method"] == record["method"]
    # an equal spec written otherwise is the same method
    again = ["generate", "--load", str(path), "Why?", "-n", "2", "--method", "speed:lcut=3,deep=1"]
    assert cli(again, monkeypatch, capsys, word_model)[0] == 0
    # without --json: the path on stdout, a summary on stderr
    code, out, err = cli(["prefill", "hi", "--save", str(path)], monkeypatch, capsys, word_model)
    assert code == 0 and out == f"{path}\n" and "tokens (chat) prefilled" in err


@pytest.mark.parametrize(
    "made_with, asked_with, message",
    [
        (
            [],
            ["Why?", "--method", "speed:lcut=2,deep=1"],
            "was prefilled with 'speed:lcut=3,anchors=bos,deep=1",
        ),
        ([], ["Why?", "--method", "full"], "leave out --method or give that one, not 'full'"),
        ([], ["Why?", "--raw"], "holds a chat conversation"),
        (["--raw"], ["Why?"], "holds raw text (prefilled with --raw); continue it with --raw"),
        ([], ["question " * 1100], "more than the model's context of"),
    ],
)
def test_generate_load_refuses_what_does_not_fit(
    word_model, tmp_path, monkeypatch, capsys, made_with, asked_with, message
):
    path, _ = prefill_cli(tmp_path, monkeypatch, capsys, word_model, *made_with)
    args = ["generate", "--load", str(path), *asked_with, "-n", "2"]
    code, _, err = cli(args, monkeypatch, capsys, word_model)
    assert code == 2 and message in err, err


def test_generate_load_refuses_a_file_from_another_dtype(word_model, tmp_path, monkeypatch, capsys):
    path, _ = prefill_cli(tmp_path, monkeypatch, capsys, word_model)
    half = copy.deepcopy(word_model.hf_model).to(torch.bfloat16)
    model = LoadedModel("half", half, word_model.tokenizer, "memory")  # what --dtype would load
    args = ["generate", "--load", str(path), "Why?", "--dtype", "bfloat16"]
    code, _, err = cli(args, monkeypatch, capsys, model)
    assert code == 2 and "--dtype float32" in err, err


def test_cli_refusals_before_any_model_loads(tmp_path, monkeypatch, capsys):
    def no_model(*_args, **_kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("speedkv.hf.loading.load_model", no_model)
    junk = tmp_path / "junk.kv"
    junk.write_bytes(bytes(range(256)) * 8)
    cases = [
        (["prefill", "doc", "--method", "snapkv", "--save", "x.kv"], "cannot serve another"),
        (["prefill", "doc", "--save", str(tmp_path)], "is a directory"),
        (["prefill", "doc", "--save", str(tmp_path / "no" / "x.kv")], "does not exist"),
        (["generate", "q", "--load", str(junk)], "not a readable prefix file"),
        (["generate", "q", "--load", str(tmp_path / "none.kv")], "does not exist"),
    ]
    for args, message in cases:
        code, _, err = cli(args, monkeypatch, capsys, None)
        assert code == 2 and message in err, (args, err)


# -- the real model: file, memory and the dense reference agree --------------------------------
@pytest.fixture(scope="module")
def real_document(smol_tokenizer) -> str:
    from speedkv.prompts.haystack import haystack_text

    return haystack_text(smol_tokenizer, 300, split="calib")


@pytest.mark.real_model
@pytest.mark.parametrize("spec", REAL_SPECS)
def test_real_loaded_prefix_equals_memory_and_the_dense_reference(
    smollm2, real_document, tmp_path, spec
):
    """Through the chat template: a question on the loaded file gives the tokens and logits
    of the same question on the prefix in memory, and both equal the dense reference."""
    from speedkv.core.sampling import SamplingParams

    engine = Engine(smollm2)
    question = "What is the passage about?"
    cached = engine.prefill(real_document, spec)
    save_prefix(cached, tmp_path / "doc.kv", engine)
    loaded = load_prefix(tmp_path / "doc.kv", engine)
    request = engine.continuation(loaded, question, SamplingParams(NEW))
    reuse = len(loaded)
    tokens, logits = engine_rows(engine, request, loaded, reuse, NEW)
    memory_tokens, memory_logits = engine_rows(engine, request, cached, reuse, NEW)
    assert tokens == memory_tokens and torch.equal(logits, memory_logits)
    assert engine.generate(loaded, question, max_new_tokens=NEW).output_ids == tokens
    rule, n = rule_of(spec, smollm2), len(request.ids)
    deep = [
        *suffix_positions(rule, reuse, None, None),  # the document's own deep suffix
        *suffix_positions(rule, n, request.header_tokens, request.turn_tokens),
    ]
    reference = dense_rows(smollm2, request.ids + tokens[:-1], rule, deep, n - 1)
    assert reference.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, reference, atol=1e-4, rtol=0), (logits - reference).abs().max()
