"""SPEED-aware training: the teacher-forcing forward against the engine, the loss, the data
mix, adapters, and a whole run (with resumption) on a tiny model."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import sys

import pytest
import torch

from speedkv.analysis.dense import speed_hidden
from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.hf.loading import LoadedModel
from speedkv.train.forward import (
    SpeedObjective,
    example_loss,
    hidden_match,
    response_logits,
    response_logits_with_full,
    visibility_for,
)
from speedkv.train.weights import FullWeights, LoraWeights

from conftest import random_prompt

SPECS = [
    "full",
    "speed:lcut=0,anchors=bos,deep=1",
    "speed:lcut=3,anchors=none,deep=4",
    "speed:lcut=5,anchors=sink:4,selfonly=true,deep=1",
    "speed:lcut=2,anchors=bos,deep=header",
    "speed:lcut=2,anchors=bos,deep=turn",
]
HEADER = 3  # generation-header length passed for deep=header
TURN = 7  # last-message-and-header length passed for deep=turn


def engine_response_logits(engine: Engine, spec: str, prompt: list[int], response: list[int]):
    """Logits predicting each response token through the engine's real prefill and decode."""
    policy = make_policy(spec, engine.shape)
    done = engine.prefill_ids(
        prompt, policy, spare=len(response), header_tokens=HEADER, turn_tokens=TURN
    )
    rows = [done.logits]
    for i, token in enumerate(response[:-1]):
        position = done.next_position + i
        rows.append(engine.decode_step([done.cache], [policy], [token], [position])[0])
    return torch.stack(rows)


def lora_copy(loaded: LoadedModel, seed: int = 0) -> LoraWeights:
    """LoRA (r=4) on a copy of `loaded`, its B matrices random so the adapter changes the
    model's output."""
    weights = LoraWeights(copy.deepcopy(loaded.hf_model), r=4, alpha=8)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in weights.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return weights


def full_copy(loaded: LoadedModel, teacher: bool = False) -> FullWeights:
    """Every weight of a copy of `loaded` trainable."""
    return FullWeights(copy.deepcopy(loaded.hf_model), loaded.tokenizer, teacher=teacher)


# -- the forward --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_training_forward_equals_engine_logits(tiny, tiny_engine, spec):
    prompt, response = random_prompt(40, seed=3), random_prompt(9, seed=4)
    expected = engine_response_logits(tiny_engine, spec, prompt, response)
    vis = visibility_for(spec, tiny.shape)
    ids = torch.tensor(prompt + response)
    got = response_logits(tiny.backbone, ids, len(prompt), vis, HEADER, TURN)
    assert got.shape == expected.shape == (len(response), tiny.shape.vocab_size)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_lora_training_forward_equals_engine_on_merged_adapter(tiny, tmp_path):
    """What is trained (LoRA live in the forward) is what runs (adapter merged, engine)."""
    from speedkv.hf.adapters import apply_adapter

    spec = "speed:lcut=3,anchors=bos,deep=1"
    weights = lora_copy(tiny)
    weights.save(tmp_path)
    assert_trained_forward_is_what_runs(tiny, weights, apply_adapter(tiny, tmp_path), spec)


def assert_trained_forward_is_what_runs(tiny, weights, saved, spec: str) -> None:
    """The training forward of `weights` gives the logits the engine gives on `saved` (the
    trained result as inference loads it), and they differ from the untrained model's."""
    prompt, response = random_prompt(30, seed=5), random_prompt(6, seed=6)
    expected = engine_response_logits(Engine(saved, chunk_size=16), spec, prompt, response)
    objective = SpeedObjective(weights, visibility_for(spec, tiny.shape))
    with torch.no_grad():
        got = response_logits(
            objective.backbone, torch.tensor(prompt + response), 30, objective.vis
        )
    base = engine_response_logits(Engine(tiny, chunk_size=16), spec, prompt, response)
    assert not torch.allclose(base, expected, atol=1e-2)  # training changed the answer
    assert torch.allclose(got, expected, atol=1e-4, rtol=0), (got - expected).abs().max()


def test_the_objective_keeps_an_examples_turn_deep_under_deep_turn(tiny):
    """Training with deep=turn trains the rule it names: the example's turn is full depth."""
    from speedkv.train.data import Example

    objective = SpeedObjective(lora_copy(tiny), visibility_for(SPECS[-1], tiny.shape))
    ids = torch.tensor(random_prompt(40, seed=3) + random_prompt(9, seed=4))
    targets = ids[40:]
    with torch.no_grad():
        losses = [
            objective.example_parts(Example(ids, 40, HEADER, "t", turn)).ce_sum
            for turn in (TURN, None)
        ]
        logits = response_logits(objective.backbone, ids, 40, objective.vis, HEADER, TURN)
    expected = float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    assert losses[0] == pytest.approx(expected, rel=1e-5) and losses[1] != pytest.approx(expected)


def test_upper_layers_run_only_anchors_and_deep_positions(tiny, monkeypatch):
    rows = []
    original = tiny.backbone.hf_layer

    def counting(layer, h, mask, positions):
        rows.append(h.shape[1])
        return original(layer, h, mask, positions)

    monkeypatch.setattr(tiny.backbone, "hf_layer", counting)
    vis = visibility_for("speed:lcut=2,anchors=sink:4,deep=3", tiny.shape)
    h, pos = speed_hidden(tiny.backbone, torch.tensor(random_prompt(60)), 50, vis)
    deep = 4 + 3 + 10  # anchors + deep suffix + response
    assert rows == [60, 60] + [deep] * 4
    assert pos.tolist() == [0, 1, 2, 3, 47, 48, 49] + list(range(50, 60))
    assert h.shape == (deep, tiny.shape.hidden_size)


@pytest.mark.parametrize("spec", ["speed:lcut=3,anchors=bos,deep=1", "full"])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_gradients_reach_every_layer(tiny, spec, kind):
    """LoRA: every adapter matrix gets a gradient. Full parameters: every weight of every
    layer, the embeddings and the final norm do; the teacher copy gets none."""
    from speedkv.train.data import Example

    weights = lora_copy(tiny) if kind == "lora" else full_copy(tiny, teacher=True)
    objective = SpeedObjective(weights, visibility_for(spec, tiny.shape), distill=0.5)
    ids = torch.tensor(random_prompt(30, seed=8))
    out = objective([Example(ids, 24, None, "test")])
    out["loss"].backward()
    assert out["response_tokens"] == 6 and out["sequence_tokens"] == 30
    trained = {n: p for n, p in objective.named_parameters() if p.requires_grad}
    for layer in range(tiny.shape.num_layers):
        grads = [
            p.grad
            for name, p in trained.items()
            if f"layers.{layer}." in name and (kind == "full" or "lora_" in name)
        ]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), layer
    if kind == "full":
        assert len(trained) == len(list(weights.model.parameters()))
        assert all(p.grad is not None for p in trained.values())
        with weights.reference() as teacher:
            assert all(p.grad is None for p in teacher.hf_model.parameters())


def count_first_mlp_calls(model) -> list[int]:
    """A one-item list counting the calls of the first layer's MLP from now on: a forward
    calls it once, and activation checkpointing once more in the backward pass."""
    mlp = model.model.layers[0].mlp
    count = [0]
    original = mlp.forward

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    mlp.forward = counted
    return count


def test_activation_checkpointing_recomputes_layers_and_keeps_the_gradients(tiny):
    """--gradient-checkpointing reaches the SPEED forward (which calls the layers one by one):
    each layer's forward runs again in the backward pass, and the gradients do not change."""
    from speedkv.hf.backbone import enable_activation_checkpointing
    from speedkv.train.data import Example

    example = Example(torch.tensor(random_prompt(40, seed=9)), 30, None, "test")
    grads, calls = [], []
    for checkpointing in (False, True):
        weights = full_copy(tiny)
        if checkpointing:
            enable_activation_checkpointing(weights.model)
        weights.model.train()
        count = count_first_mlp_calls(weights.model)
        objective = SpeedObjective(
            weights, visibility_for("speed:lcut=2,anchors=bos,deep=1", tiny.shape)
        )
        objective([example])["loss"].backward()
        calls.append(count[0])
        grads.append([p.grad.clone() for p in weights.model.parameters()])
    assert calls == [1, 2]
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-6)


def test_step_bench_runs_in_train_mode_so_checkpointing_recomputes(tiny):
    """train-bench measures the step a run takes: with --gradient-checkpointing each layer's
    forward runs again in the backward pass (transformers checkpoints only in train mode)."""
    from speedkv.hf.backbone import enable_activation_checkpointing
    from speedkv.train.data import Example
    from speedkv.train.stepbench import measure_step_speed

    weights = full_copy(tiny)
    weights.model.eval()
    enable_activation_checkpointing(weights.model)
    count = count_first_mlp_calls(weights.model)
    example = Example(torch.tensor(random_prompt(40, seed=9)), 30, None, "test")
    vis = visibility_for("speed:lcut=2,anchors=bos,deep=1", tiny.shape)
    measure_step_speed(weights, [vis], [example], repeats=1, bf16=False)
    assert count[0] == 4  # a warm-up and a measured step, each forward then recomputed


def test_full_parameter_training_forward_equals_engine_on_its_saved_model(
    tiny, smol_tokenizer, tmp_path
):
    """What is trained (every weight changed) is what runs: the saved model directory,
    loaded as --model, gives the engine the training forward's logits."""
    from speedkv.hf.loading import load_model

    spec = "speed:lcut=3,anchors=bos,deep=1"
    weights = FullWeights(copy.deepcopy(tiny.hf_model), smol_tokenizer)
    with torch.no_grad():  # a trained model: every weight moved
        generator = torch.Generator().manual_seed(1)
        for param in weights.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    weights.save(tmp_path)
    saved = load_model(str(tmp_path), dtype="float32", device="cpu", progress=False)
    assert_trained_forward_is_what_runs(tiny, weights, saved, spec)


def test_full_parameter_teacher_is_the_starting_model(tiny):
    """With distillation the teacher stays the untrained model while the student moves."""
    weights = full_copy(tiny, teacher=True)
    ids = torch.tensor(random_prompt(20, seed=2))
    full_rule = visibility_for("full", tiny.shape)
    with torch.no_grad():
        before = response_logits(weights.backbone, ids, 15, full_rule)
        for param in weights.model.parameters():
            param.mul_(1.1)
        with weights.reference() as teacher:
            after_teacher = response_logits(teacher, ids, 15, full_rule)
        after_student = response_logits(weights.backbone, ids, 15, full_rule)
    assert torch.equal(before, after_teacher)
    assert not torch.allclose(before, after_student, atol=1e-3)
    with pytest.raises(RuntimeError, match="no teacher"), full_copy(tiny).reference():
        pass


def test_loss_is_cross_entropy_kl_mix():
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 11), torch.randn(5, 11)
    targets = torch.tensor([1, 2, 3, 4, 5])
    ce = torch.nn.functional.cross_entropy(student, targets, reduction="sum")
    p_t = teacher.softmax(-1)
    kl = (p_t * (p_t.log() - student.log_softmax(-1))).sum()
    plain = example_loss(student, targets)
    assert torch.isclose(plain.loss_sum, ce) and plain.kl_sum == 0 and plain.tokens == 5
    mixed = example_loss(student, targets, teacher, distill=0.25)
    assert torch.isclose(mixed.loss_sum, 0.75 * ce + 0.25 * kl, atol=1e-5)
    assert mixed.kl_sum == pytest.approx(float(kl), rel=1e-5)
    same = example_loss(student, targets, student.clone(), distill=1.0, temperature=2.0)
    assert float(same.loss_sum) == pytest.approx(0.0, abs=1e-5)
    # --keep-full adds the full-depth student's KL to the same teacher, at its own weight
    student_full = torch.randn(5, 11)
    kl_full = (p_t * (p_t.log() - student_full.log_softmax(-1))).sum()
    kept = example_loss(student, targets, teacher, 0.25, student_full=student_full, keep_full=2.0)
    assert torch.isclose(kept.loss_sum, 0.75 * ce + 0.25 * kl + 2.0 * kl_full, atol=1e-4)
    assert kept.kl_full_sum == pytest.approx(float(kl_full), rel=1e-5)
    with pytest.raises(ValueError, match="keep_full needs"):
        example_loss(student, targets, teacher, keep_full=1.0)


@pytest.mark.parametrize("spec", SPECS)
def test_one_pass_gives_speed_and_full_depth_logits(tiny, spec):
    """--keep-full's shared lower layers: the pair equals SPEED's and full depth's own
    forwards, and gradients flow through both."""
    weights = lora_copy(tiny)
    vis = visibility_for(spec, tiny.shape)
    ids = torch.tensor(random_prompt(40, seed=5))
    speed, full = response_logits_with_full(weights.backbone, ids, 31, vis, 3, 3)
    full_rule = visibility_for("full", tiny.shape)
    assert torch.allclose(speed, response_logits(weights.backbone, ids, 31, vis, 3, 3), atol=1e-5)
    assert torch.allclose(full, response_logits(weights.backbone, ids, 31, full_rule), atol=1e-5)
    assert speed.shape == full.shape == (9, tiny.shape.vocab_size)
    (speed.sum() + full.sum()).backward()


def test_keep_full_pulls_full_depth_toward_the_untrained_model(tiny):
    """--keep-full: its term is zero while the adapter is untouched (the trained weights at
    full depth are the teacher), and once the adapter has moved, its gradient points back:
    a small step along it lowers the full-depth KL."""
    from speedkv.train.data import Example

    weights = LoraWeights(copy.deepcopy(tiny.hf_model), r=4, alpha=8)  # B = 0: no change yet
    spec = "speed:lcut=2,anchors=bos,deep=1"
    objective = SpeedObjective(weights, visibility_for(spec, tiny.shape), keep_full=1.0)
    example = Example(torch.tensor(random_prompt(30, seed=8)), 24, None, "test")
    assert objective([example])["kl_full_sum"] == pytest.approx(0.0, abs=1e-4)
    lora = [p for n, p in weights.model.named_parameters() if "lora_B" in n]
    torch.manual_seed(3)
    with torch.no_grad():
        for param in lora:
            param.add_(torch.randn_like(param) * 0.05)
    moved = objective([example])
    assert moved["kl_full_sum"] > 1e-3
    # only the full-depth term: no cross-entropy, no SPEED distillation
    kl_only = SpeedObjective(weights, objective.vis, distill=0.0, keep_full=1.0)
    parts = kl_only.example_parts(example)
    weights.model.zero_grad()
    (parts.loss_sum - parts.ce_sum).backward()
    with torch.no_grad():
        for param in lora:
            param.sub_(param.grad * 1e-2 / max(float(param.grad.abs().max()), 1e-9))
    assert kl_only([example])["kl_full_sum"] < moved["kl_full_sum"]


def test_hidden_match_is_relative_squared_error_averaged_over_layers():
    torch.manual_seed(1)
    t = {3: torch.randn(4, 6), 4: 10 * torch.randn(4, 6)}
    s = {3: t[3] + 0.1, 4: t[4] * 1.5}
    rel3 = ((s[3] - t[3]).pow(2).sum(-1) / t[3].pow(2).sum(-1)).sum()
    rel4 = torch.full((4,), 0.25).sum()  # (1.5 t - t)^2 / t^2 on every row, whatever t's scale
    assert torch.isclose(hidden_match(s, t), (rel3 + rel4) / 2, atol=1e-5)
    assert float(hidden_match(t, t)) == 0.0
    with pytest.raises(ValueError, match="every student layer"):
        hidden_match({5: t[3]}, t)
    student, targets = torch.randn(4, 11), torch.tensor([1, 2, 3, 4])
    ce = torch.nn.functional.cross_entropy(student, targets, reduction="sum")
    parts = example_loss(student, targets, None, student_states=s, teacher_states=t,
                         match_hidden=0.5)  # fmt: skip
    assert torch.isclose(parts.loss_sum, ce + 0.5 * hidden_match(s, t), atol=1e-5)
    assert parts.hidden_sum == pytest.approx(float(hidden_match(s, t)), rel=1e-5)
    with pytest.raises(ValueError, match="match_hidden needs"):
        example_loss(student, targets, match_hidden=1.0)


@pytest.mark.parametrize("spec", SPECS)
def test_response_states_are_the_upper_layers_at_the_response_rows(tiny, spec):
    """--match-hidden's states: the layers from the cutoff up under SPEED, every layer at
    full depth, at the rows whose final states give the response logits."""
    ids = torch.tensor(random_prompt(40, seed=5))
    vis = visibility_for(spec, tiny.shape)
    full_rule = visibility_for("full", tiny.shape)
    speed_states: dict[int, torch.Tensor] = {}
    full_states: dict[int, torch.Tensor] = {}
    logits = response_logits(tiny.backbone, ids, 31, vis, 3, 3, speed_states)
    response_logits(tiny.backbone, ids, 31, full_rule, 3, 3, full_states)
    layers = tiny.shape.num_layers
    assert sorted(full_states) == list(range(layers))
    first = 0 if vis.lcut >= layers else vis.lcut  # full depth: every layer
    assert sorted(speed_states) == list(range(first, layers))
    for layer, rows in speed_states.items():
        assert rows.shape == full_states[layer].shape == (9, tiny.shape.hidden_size)
    last = tiny.backbone.logits(tiny.backbone.final_norm(full_states[layers - 1][None])[0])
    full_logits = response_logits(tiny.backbone, ids, 31, full_rule, 3, 3)
    assert torch.allclose(last, full_logits, atol=1e-5)
    if vis.lcut >= layers:  # full depth: the states are the teacher's own
        assert torch.allclose(logits, full_logits, atol=1e-5)


def test_match_hidden_pulls_speed_toward_full_depth(tiny):
    """--match-hidden: a small step along its gradient lowers the hidden-state error."""
    from speedkv.train.data import Example

    weights = LoraWeights(copy.deepcopy(tiny.hf_model), r=4, alpha=8)
    spec = "speed:lcut=2,anchors=bos,deep=1"
    objective = SpeedObjective(weights, visibility_for(spec, tiny.shape), match_hidden=1.0)
    example = Example(torch.tensor(random_prompt(30, seed=8)), 24, None, "test")
    before = objective([example])
    assert before["hidden_sum"] > 1e-4  # untrained SPEED differs from full depth
    # the gradient of the hidden-state term alone (loss_sum also holds the cross-entropy)
    states: dict[int, torch.Tensor] = {}
    teacher: dict[int, torch.Tensor] = {}
    response_logits(weights.backbone, example.ids, 24, objective.vis, None, None, states)
    with torch.no_grad(), weights.reference() as reference:
        response_logits(reference, example.ids, 24, objective.full, None, None, teacher)
    weights.model.zero_grad()
    hidden_match(states, teacher).backward()
    lora = [p for n, p in weights.model.named_parameters() if "lora_B" in n]
    with torch.no_grad():
        for param in lora:
            param.sub_(param.grad * 1e-3 / max(float(param.grad.abs().max()), 1e-9))
    assert objective([example])["hidden_sum"] < before["hidden_sum"]
    with pytest.raises(ValueError, match="not combined"):
        SpeedObjective(weights, objective.vis, keep_full=1.0, match_hidden=1.0)


def test_only_full_and_speed_can_be_trained(tiny):
    with pytest.raises(UserError, match="supports the methods 'full' and 'speed'"):
        visibility_for("pop:lcut=3", tiny.shape)
    full = visibility_for("full", tiny.shape)
    assert full.lcut == tiny.shape.num_layers
    speed = visibility_for("speed:lcut=2,anchors=sink:3,deep=header", tiny.shape)
    assert (speed.lcut, speed.anchors, speed.deep) == (2, 3, "header")
    assert speed.spec == "speed:lcut=2,anchors=sink:3,deep=header,selfonly=false"


# -- data (smol_tokenizer: conftest) ------------------------------------------------------------
def test_mix_spec_parsing():
    from speedkv.train.data import DEFAULT_WEIGHTS, parse_mix

    assert parse_mix("builtin") == DEFAULT_WEIGHTS
    assert parse_mix("data.jsonl") is None and parse_mix("builtin-mix.jsonl") is None
    weights = parse_mix("builtin:needle=3,instruct=0")
    assert weights["needle"] == 3 and weights["instruct"] == 0
    assert weights["continue"] == DEFAULT_WEIGHTS["continue"]
    for bad, message in [
        ("builtin:nosuch=1", "no task 'nosuch'"),
        ("builtin:needle=x", "must be a number"),
        ("builtin:needle=-1", "must be >= 0"),
        (
            "builtin:" + ",".join(f"{task}=0" for task in DEFAULT_WEIGHTS),
            "at least one task",
        ),
    ]:
        with pytest.raises(UserError, match=message):
            parse_mix(bad)


def test_builtin_mix_is_seeded_fits_and_never_uses_evaluation_text(smol_tokenizer):
    from speedkv.prompts.haystack import essays, sentences
    from speedkv.train.data import DEFAULT_WEIGHTS, build_mix, tokenize_all

    def answer(conversations):
        return [("An answer.", True) for _ in conversations]

    args = (smol_tokenizer, 24, DEFAULT_WEIGHTS, 700)
    first = build_mix(*args, seed=1, responder=answer, progress=False)
    assert first == build_mix(*args, seed=1, responder=answer, progress=False)
    assert first != build_mix(*args, seed=2, responder=answer, progress=False)
    examples, dropped = tokenize_all(smol_tokenizer, first, 700)
    assert dropped == 0 and len(examples) == 24
    assert all(e.prompt_len >= 1 and e.response_len >= 1 for e in examples)
    assert {e.kind for e in examples} <= set(DEFAULT_WEIGHTS)
    # the default text is Python's documentation: no essay sentence (RULER's haystack, and
    # speedkv's evaluation text) is in any record
    text = json.dumps(first)
    long_sentences = [s for t in essays().values() for s in sentences(t) if len(s) > 60]
    assert long_sentences and not any(json.dumps(s)[1:-1] in text for s in long_sentences)
    essay_mix = build_mix(*args, seed=1, responder=answer, progress=False, text="essays")
    assert any(json.dumps(s)[1:-1] in json.dumps(essay_mix) for s in long_sentences)


def test_extra_tasks_join_a_mix_only_when_named(smol_tokenizer):
    from speedkv.train.data import DEFAULT_WEIGHTS, EXTRA_TASKS, build_mix, mix_spec, parse_mix
    from speedkv.train.tasks import WORDS

    assert set(EXTRA_TASKS) == {"strings", "codedfreq", "toplist"}
    assert mix_spec(parse_mix("builtin")) == mix_spec(DEFAULT_WEIGHTS)  # recorded runs resume
    weights = parse_mix("builtin:strings=1,codedfreq=1,toplist=1,needle=0,continue=0,instruct=0")
    weights = {k: v for k, v in weights.items() if k in EXTRA_TASKS}
    records = build_mix(smol_tokenizer, 12, weights, 900, seed=3, progress=False)
    assert {r["kind"] for r in records} == {"strings", "codedfreq", "toplist"}
    for record in records:
        prompt, answer = (m["content"] for m in record["messages"])
        if record["kind"] == "strings":  # the value asked for is in the prompt, copied exactly
            value = answer.rsplit(" ", 1)[-1].rstrip(".")
            assert value in prompt and value not in WORDS
        else:  # the named words are the most frequent ones, most frequent first
            named = answer.split(": ", 1)[1].rstrip(".").split(", ")
            body = prompt.split("\n\n")[1]
            lines = body.split("\n")  # a numbered list, or one run of words
            words = [line.split(". ", 1)[-1] for line in lines] if len(lines) > 1 else body.split()
            counts = {w: words.count(w) for w in set(words)}
            ranked = sorted(counts.values(), reverse=True)
            assert [counts[w] for w in named] == ranked[: len(named)]
            assert all(w.isalpha() and w.islower() for w in named)


def test_chat_and_raw_records_tokenise_as_inference_does(smol_tokenizer):
    from speedkv.hf.text import encode_messages
    from speedkv.train.data import tokenize_record

    tok = smol_tokenizer
    user = [{"role": "user", "content": "What is the pass key?"}]
    record = {"kind": "t", "messages": user + [{"role": "assistant", "content": "It is 42."}]}
    example = tokenize_record(tok, record)
    encoded = encode_messages(tok, user)
    assert example.ids[: example.prompt_len].tolist() == encoded.ids
    assert example.header_tokens == encoded.header_tokens
    assert example.turn_tokens == encoded.turn_tokens and 3 < example.turn_tokens < len(encoded.ids)
    assert tok.decode(example.ids[example.prompt_len :]) == "It is 42.<|im_end|>"
    cut = tokenize_record(tok, {**record, "eos": False})
    assert tok.decode(cut.ids[cut.prompt_len :]) == "It is 42."
    raw = tokenize_record(tok, {"prompt": "Once upon a time", "response": " there was"})
    assert raw.ids.tolist() == tok("Once upon a time")["input_ids"] + tok(" there was")["input_ids"]
    assert raw.prompt_len == len(tok("Once upon a time")["input_ids"]) and raw.header_tokens is None
    assert raw.turn_tokens is None


def test_user_jsonl_is_validated_line_by_line(tmp_path):
    from speedkv.train.data import read_jsonl

    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({"prompt": "x", "response": "y"}) + "\n")
    assert [r["kind"] for r in read_jsonl(path)] == ["chat", "raw"]
    cases = [
        ("{not json", "data.jsonl:2 is not valid JSON"),
        (json.dumps({"messages": good["messages"][:1]}), "ending with the assistant"),
        (json.dumps({"text": "x"}), "needs 'messages'"),
        (json.dumps([1, 2]), "must be a JSON object"),
    ]
    for line, message in cases:
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(UserError, match=message):
            read_jsonl(path)
    with pytest.raises(UserError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


# -- adapters ---------------------------------------------------------------------------------
def test_adapter_method_mismatch_warns_and_shape_mismatch_refuses(tiny, tmp_path, capsys):
    from speedkv.cli.common import bind
    from speedkv.core.registry import parse_spec
    from speedkv.hf.adapters import INFO_NAME, apply_adapter, read_adapter_info

    lora_copy(tiny).save(tmp_path)
    spec = "speed:lcut=3,anchors=bos,deep=1,selfonly=false"
    record = {"method": spec, "model_shape": {"num_layers": tiny.shape.num_layers}}
    (tmp_path / INFO_NAME).write_text(json.dumps(record))
    assert read_adapter_info(tmp_path)["method"] == spec
    merged = apply_adapter(tiny, tmp_path)
    assert merged.trained_method == spec
    assert bind(parse_spec("speed:lcut=3,deep=1"), merged).spec() == spec  # spelt shorter
    assert "warning" not in capsys.readouterr().err
    assert bind(parse_spec("speed"), merged).spec() == spec  # what it leaves unset: trained
    assert bind(parse_spec("full"), merged).spec() == "full"
    assert f"trained for '{spec}' but runs with 'full'" in capsys.readouterr().err
    assert merged.hf_model is not tiny.hf_model
    assert not merged.backbone.prepacked
    tiny.backbone.prepack_decode(True)
    try:  # the merged copy decodes as its base does, prepacked weights included
        assert apply_adapter(tiny, tmp_path).backbone.prepacked
    finally:
        tiny.backbone.prepack_decode(False)
    (tmp_path / INFO_NAME).write_text(json.dumps({**record, "model_shape": {"num_layers": 99}}))
    with pytest.raises(UserError, match="num_layers=99"):
        apply_adapter(tiny, tmp_path)
    with pytest.raises(UserError, match="no adapter_config.json"):
        read_adapter_info(tmp_path / "nowhere")


def test_demo_runs_the_adapters_kind_of_method_on_it(tiny_model_dir, tmp_path, capsys):
    from speedkv import load_model
    from speedkv.cli.demo import run_demo
    from speedkv.core.registry import parse_spec
    from speedkv.hf.adapters import INFO_NAME, apply_adapter

    base = load_model(str(tiny_model_dir), dtype="float32")
    lora_copy(base).save(tmp_path)
    trained = "speed:lcut=2,anchors=bos,deep=1,selfonly=false"
    record = {"method": trained, "model_shape": {"num_layers": base.shape.num_layers}}
    (tmp_path / INFO_NAME).write_text(json.dumps(record))
    adapted = apply_adapter(base, tmp_path)
    methods = [parse_spec(m) for m in ("speed", "speed:lcut=3", "streamingllm:sink=4,window=64")]
    report = run_demo(base, methods, 300, 2, True, adapted)
    rows = [row["method"] for row in report["rows"]]
    assert rows[0] == "full" and rows[1] == f"{trained} + adapter"  # bare speed: fitted
    assert rows[2].startswith("speed:lcut=3,") and rows[2].endswith(" + adapter")
    assert rows[3].startswith("streamingllm") and "adapter" not in rows[3]
    assert "lcut=3 runs it on a layout it never saw" in capsys.readouterr().err


# -- a whole run ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer, saved as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=smol_tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(config).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def adapter_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def tiny_run(model_dir, **options):
    """The configuration of a 4-step run on the tiny model with checkpoints at step 2 and
    distillation; `options` override it. Called with `out=` to get one."""
    from speedkv.train.trainer import TrainConfig

    settings = {
        "model": str(model_dir), "method": "speed:lcut=2,anchors=bos,deep=1", "data": "builtin",
        "steps": 4, "seq_len": 512, "save_every": 2, "distill": 0.5, "bf16": False,
        "save_dtype": "float32", **options,
    }  # fmt: skip
    return lambda out: TrainConfig(out=str(out), **settings)


def test_a_run_trains_checkpoints_and_resumes_exactly(tiny_model_dir, tmp_path):
    from speedkv.train.trainer import run_training

    config = tiny_run(tiny_model_dir, log_every=1, probe_every=2)

    out = tmp_path / "run"
    record = run_training(config(out))
    assert record["status"] == "done" and record["steps"] == 4
    assert record["method"] == "speed:lcut=2,anchors=bos,deep=1,selfonly=false"
    assert record["data"]["records"] == 4 and record["tokens_per_s"] > 0
    losses = [h for h in record["log_history"] if "loss" in h]
    assert [h["step"] for h in losses] == [1, 2, 3, 4]
    assert all("ce" in h and "kl" in h and "wall_s" in h for h in losses)
    probes = [h for h in record["log_history"] if "probe_passkey_acc" in h]
    assert [h["step"] for h in probes] == [0, 2, 4]  # before training, then every 2 steps
    assert all(0 <= h["probe_passkey_acc"] <= 1 and h["probe_ppl"] > 1 for h in probes)
    for name in ("adapter_config.json", "training.json", "loss.png", "data.jsonl", "run.json"):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "checkpoint-2" / "training.json").is_file()
    finished = adapter_weights(out)

    # train-compare reads the probes of a finished run, and of a checkpoint mid-run
    from speedkv.train.compare import run_label, run_probes
    from speedkv.train.plots import plot_probe_comparison

    done = run_probes(out)
    assert done["finished"] and [p["step"] for p in done["probes"]] == [0, 2, 4]
    assert run_label(done) == "run (speed:lcut=2,anchors=bos)"  # runs differing in anchor differ
    assert [p["ppl"] for p in done["probes"]] == [h["probe_ppl"] for h in probes]
    midway = run_probes(out / "checkpoints" / "checkpoint-2")
    assert not midway["finished"] and [p["step"] for p in midway["probes"]] == [0, 2]
    plot_probe_comparison([done, midway], tmp_path / "probes.png", "step")
    assert (tmp_path / "probes.png").stat().st_size > 10_000
    with pytest.raises(UserError, match="holds no training run"):
        run_probes(tmp_path)

    with pytest.raises(UserError, match="already holds a training run"):
        run_training(config(out))
    changed = config(out)
    changed.lr = 1e-3
    with pytest.raises(UserError, match="these differ: lr"):
        run_training(changed, resume=True)

    # lose everything after step 2, resume: the same adapter comes out
    shutil.rmtree(out / "checkpoints" / "checkpoint-4")
    (out / "adapter_model.safetensors").unlink()
    resumed = run_training(config(out), resume=True)
    assert resumed["steps"] == 4
    again = adapter_weights(out)
    assert finished.keys() == again.keys()
    for key in finished:
        assert torch.allclose(finished[key], again[key], atol=1e-6), key


def model_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_full_parameter_run_trains_checkpoints_resumes_and_loads_as_a_model(
    tiny_model_dir, tmp_path
):
    """--full: every weight moves, checkpoints hold the model, a resumed run ends with the
    same weights, and the result is a model directory (not an adapter)."""
    from speedkv.hf.adapters import read_adapter_info
    from speedkv.hf.loading import load_model
    from speedkv.train.trainer import run_training

    config = tiny_run(
        tiny_model_dir, log_every=2, probe_every=4, lr=1e-3, full_parameters=True,
        gradient_checkpointing=True,
    )  # fmt: skip

    out = tmp_path / "run"
    record = run_training(config(out))
    assert record["status"] == "done" and record["steps"] == 4
    assert record["format"] == "speedkv-model/1" and "lora" not in record
    start = load_model(str(tiny_model_dir), dtype="float32", device="cpu", progress=False)
    parameters = sum(p.numel() for p in start.hf_model.parameters())
    assert record["full_parameters"]["trainable_parameters"] == parameters
    assert record["recipe"]["gradient_checkpointing"] is True
    assert [h["step"] for h in record["log_history"] if "loss" in h] == [2, 4]
    assert all(h["kl"] > 0 for h in record["log_history"] if "loss" in h)  # a teacher ran
    assert [h["step"] for h in record["log_history"] if "probe_ppl" in h] == [0, 4]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json"):
        assert (out / name).is_file(), name
    assert not (out / "adapter_config.json").exists()
    assert (out / "checkpoints" / "checkpoint-2" / "model.safetensors").is_file()
    finished = model_weights(out)
    before = start.hf_model.state_dict()
    moved = [k for k in finished if not torch.allclose(finished[k], before[k])]
    assert len(moved) == len(finished)  # every saved tensor was trained

    trained = load_model(str(out), dtype="float32", device="cpu", progress=False)
    assert trained.shape == start.shape
    with pytest.raises(UserError, match="is a model directory"):
        read_adapter_info(out)

    shutil.rmtree(out / "checkpoints" / "checkpoint-4")
    (out / "model.safetensors").unlink()
    resumed = run_training(config(out), resume=True)
    assert resumed["steps"] == 4
    again = model_weights(out)
    for key in finished:
        assert torch.allclose(finished[key], again[key], atol=1e-5), key


def test_full_parameter_training_refuses_what_it_cannot_do(
    tiny_model_dir, monkeypatch, capsys, tmp_path
):
    """LoRA options with --full, a model that is not a causal LM, and a run that cannot fit
    in memory: one sentence each, exit 2."""
    from transformers import BertConfig, BertModel

    from speedkv.cli import app as cli

    bert = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=37, vocab_size=99)).save_pretrained(bert)  # fmt: skip
    cases = [
        (["--lora-r", "8"], "--full trains every weight; --lora-r applies to LoRA only"),
        (["--lora-alpha", "8", "--target-modules", "q_proj"], "--lora-alpha, --target-modules"),
        (["--model", str(bert)], "model architecture 'bert' is not supported"),
        (
            ["--model", str(tiny_model_dir), "--batch", "100000", "--seq-len", "2048"],
            "full-parameter training of",
        ),
    ]
    for extra, message in cases:
        out = tmp_path / f"x{len(extra)}"
        argv = ["speedkv", "train", "--full", "--out", str(out), "--threads", "1", *extra]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as stop:
            cli.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and "Traceback" not in err, err
        assert "available; use --gradient-checkpointing" in err or "--batch" not in extra


def test_cli_rejects_bad_training_options_before_loading(monkeypatch, capsys, tmp_path):
    from speedkv.cli import app as cli

    cases = [
        (["--method", "pop:lcut=20"], "supports the methods 'full' and 'speed'"),
        (["--method", "speed:lcut"], "malformed method spec"),
        (["--distill", "2"], "distill must be in [0, 1]"),
        (["--keep-full", "-1"], "keep-full must be >= 0"),
        (["--keep-full", "1", "--method", "full"], "with --method full"),
        (["--match-hidden", "-1"], "match-hidden must be >= 0"),
        (["--match-hidden", "1", "--method", "full"], "no SPEED layers"),
        (["--match-hidden", "1", "--keep-full", "1"], "not combined"),
        (["--data", "builtin:nosuch=1"], "no task 'nosuch'"),
        (["--data", str(tmp_path / "none.jsonl")], "neither"),
        (["--lora-r", "0"], "lora-r must be at least 1"),
        (["--target-modules", ","], "target-modules must name"),
        (["--save-dtype", "float16"], "save-dtype must be"),
    ]
    for extra, message in cases:
        monkeypatch.setattr(sys, "argv", ["speedkv", "train", "--out", str(tmp_path / "x"), *extra])
        with pytest.raises(SystemExit) as stop:
            cli.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and "Traceback" not in err, err


def test_layer_token_share_counts_what_speed_skips(tiny):
    from speedkv.train.data import Example
    from speedkv.train.stepbench import layer_token_ratio

    batch = [Example(torch.arange(100), 90, None, "t"), Example(torch.arange(50), 40, 4, "t")]
    vis = visibility_for("speed:lcut=2,anchors=bos,deep=header", tiny.shape)
    # lcut * T + (L - lcut) * (anchor + header + response) per example, over L * T
    expected = (2 * 150 + 4 * ((1 + 1 + 10) + (1 + 4 + 10))) / (6 * 150)
    assert layer_token_ratio(tiny.shape, vis, batch) == pytest.approx(expected)
    assert layer_token_ratio(tiny.shape, visibility_for("full", tiny.shape), batch) == 1.0


@pytest.mark.real_model
def test_training_forward_matches_engine_on_smollm2(smollm2):
    from speedkv.prompts.haystack import haystack_text

    text = haystack_text(smollm2.tokenizer, 400, split="calib")
    ids = smollm2.tokenizer(text)["input_ids"]
    prompt, response = ids[:380], ids[380:400]
    spec = "speed:lcut=22,anchors=bos,deep=1"
    expected = engine_response_logits(Engine(smollm2), spec, prompt, response)
    vis = visibility_for(spec, smollm2.shape)
    with torch.no_grad():
        got = response_logits(smollm2.backbone, torch.tensor(prompt + response), 380, vis)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got, expected, atol=2e-3, rtol=0), (got - expected).abs().max()


def test_train_compare_rejects_bad_arguments(monkeypatch, capsys, tmp_path):
    from speedkv.cli import app as cli

    cases = [
        ([str(tmp_path)], "holds no training run"),
        ([str(tmp_path), "--x", "hours"], "--x must be 'minutes' or 'step'"),
        ([str(tmp_path), "--plot", str(tmp_path / "p.svg")], "give a path ending in .png"),
    ]
    for args, message in cases:
        monkeypatch.setattr(sys, "argv", ["speedkv", "train-compare", *args])
        with pytest.raises(SystemExit) as stop:
            cli.main()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and "Traceback" not in err, err


def test_loss_plot_of_a_run_shorter_than_one_log_interval(tmp_path):
    """A 2-step run with --log-every 5 logs no loss; its loss.png still gets written (it once
    failed on the empty history)."""
    from speedkv.train.plots import plot_history

    path = tmp_path / "loss.png"
    plot_history([{"step": 0, "probe_ppl": 30.0, "probe_passkey_acc": 0.5}], path, "tiny")
    assert path.stat().st_size > 1000


def test_a_run_shorter_than_one_log_interval_still_logs_its_loss(tmp_path):
    """--steps 2 with --log-every 5 logs at step 2, so the run's summary has a loss and a
    speed (it once printed 'None tokens/s, final loss None')."""
    from speedkv.train.trainer import TrainConfig, training_arguments

    def logging_steps(steps, epochs=1):
        config = TrainConfig(out=str(tmp_path), steps=steps, epochs=epochs, log_every=5)
        return training_arguments(config, tmp_path, device="cpu").logging_steps

    assert logging_steps(2) == 2
    assert logging_steps(600) == 5
    assert logging_steps(None) == 5  # by epochs: the step count is not known up front


def test_spelled_deep_keeps_a_resumed_run_on_the_suffix_it_was_trained_with(tmp_path):
    """A run.json written before the default deep suffix became 64 holds a SPEED spec without
    `deep=`, which meant deep=1 then: resuming it under the new default must be refused, and
    resuming it with deep=1 spelled out must go on."""
    from speedkv.train.trainer import TrainConfig, _check_run_dir, spelled_deep

    assert spelled_deep("speed", 64) == "speed:deep=64"
    assert spelled_deep("speed:lcut=2,anchors=bos", 64) == "speed:lcut=2,anchors=bos,deep=64"
    assert spelled_deep("speed:deep=turn,lcut=2", 64) == "speed:deep=turn,lcut=2"
    assert spelled_deep("full", 64) == "full"
    old = TrainConfig(out=str(tmp_path), method="speed:lcut=2,anchors=bos")
    (tmp_path / "run.json").write_text(json.dumps(dataclasses.asdict(old)))
    now = TrainConfig(out=str(tmp_path), method=spelled_deep(old.method, 64))
    with pytest.raises(UserError, match="these differ: method"):
        _check_run_dir(tmp_path, now, resume=True, last=None)
    paper = TrainConfig(out=str(tmp_path), method="speed:lcut=2,anchors=bos,deep=1")
    _check_run_dir(tmp_path, paper, resume=True, last=None)


def test_probes_run_in_autos_dtype_for_transformers_layers(word_model, monkeypatch):
    """Most of a probe is a teacher-forced forward through transformers' own layers: on a CPU
    without bf16 instructions it runs in float32, even where speedkv's decode kernel would
    make `auto` bfloat16 for the engine."""
    from speedkv.kernels import cpu
    from speedkv.train.probe import Probe

    class Weights:
        def inference_copy(self):
            return copy.deepcopy(word_model.hf_model).to(torch.bfloat16)

    monkeypatch.setattr(cpu, "cpu_decodes_bf16_natively", lambda: True)
    probe = Probe.__new__(Probe)  # its prompts are not needed here
    probe.tokenizer = word_model.tokenizer
    for bf16_instructions, expected in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(cpu, "cpu_has_bf16_matmul", lambda b=bf16_instructions: b)
        model = probe.inference_model(Weights())
        assert {p.dtype for p in model.hf_model.parameters()} == {expected}
