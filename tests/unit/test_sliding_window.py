"""Sliding-window models (Mistral's `sliding_window`, Qwen2's `use_sliding_window` with
`max_window_layers`, Gemma 3's local layers interleaved with global ones): the engine applies
each layer's window by absolute position, so full attention equals transformers' own
`generate` past the window, and SPEED -- whose windowed upper layers see the full-depth rows
inside their window -- equals the dense reference, on every path the engine takes (masked
prefill chunks, prefix reuse, decode batches, a cache out of position order, recorded steps,
one native call per layer). Also tiny-config checks of two config features the real
checkpoints use: Llama 3's rope scaling and tied embeddings."""

from __future__ import annotations

from types import SimpleNamespace

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

from speedkv.analysis.dense import speed_dense_forward, speed_hidden
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.backbone import shape_of
from speedkv.hf.loading import LoadedModel

from conftest import random_prompt, tiny_model
from helpers import check_equals_hf_generate, greedy_with_logits, hf_generate

WINDOW = 48
N = 300  # prompt tokens: six windows, so the anchors are far outside every window
NEW = 8
LOCAL, GLOBAL = "sliding_attention", "full_attention"
# the windowed families: Mistral windows every layer; Qwen2 (use_sliding_window) the layers
# from max_window_layers on, so layers 0-2 here attend to everything and 3-5 to the window;
# Gemma 3 two local layers, then a global one, twice (each type with its own rotary base)
FAMILIES = {
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW}),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 3},
    ),
    "gemma3_text": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"sliding_window": WINDOW, "layer_types": [LOCAL, LOCAL, GLOBAL] * 2},
    ),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
}


# what switches the window off in each family (Mistral ignores the Qwen2 switch; Gemma 3
# switches layers, not the window: transformers cannot build a local layer without one)
WINDOW_OFF = {"sliding_window": None, "use_sliding_window": False}
GEMMA_WINDOW_OFF = {"layer_types": [GLOBAL] * 6}


def build(family: str, seed: int = 0, device: torch.device | str = "cpu", **config) -> LoadedModel:
    """A tiny random model of `family` (FAMILIES' window settings, then `config`) on `device`,
    scaled as conftest's tiny models are so that greedy choices are decisive."""
    _, _, settings = FAMILIES[family]
    return tiny_model(family, seed, device, **{**settings, **config})


@pytest.fixture(scope="module", params=["mistral", "qwen2", "gemma3_text"])
def windowed(request, device) -> LoadedModel:
    return build(request.param, device=device)


@pytest.fixture(scope="module")
def unwindowed(windowed) -> LoadedModel:
    """The same weights with the window switched off: what an engine ignoring it computes."""
    family = windowed.hf_model.config.model_type
    off = GEMMA_WINDOW_OFF if family == "gemma3_text" else WINDOW_OFF
    plain = build(family, device=windowed.backbone.device, **off)
    assert plain.shape.windows == ()
    return plain


@pytest.fixture(scope="module")
def engine(windowed) -> Engine:
    return Engine(windowed, chunk_size=32)  # prompts span several chunks and several windows


# -- reading the window ---------------------------------------------------------------------
def test_windows_are_read_as_transformers_reads_them():
    layers = {"num_hidden_layers": 4}
    assert shape_of(MistralConfig(sliding_window=48, **layers)).windows == (48,) * 4
    assert shape_of(MistralConfig(sliding_window=None, **layers)).windows == ()
    assert shape_of(LlamaConfig(**layers)).windows == ()
    # Qwen2 checkpoints carry a window they do not use unless use_sliding_window is true
    assert shape_of(Qwen2Config(sliding_window=48, **layers)).windows == ()
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=48, max_window_layers=2, **layers)
    shape = shape_of(qwen)
    assert shape.windows == (None, None, 48, 48)
    assert [shape.window(i) is not None for i in range(4)] == [
        kind == "sliding_attention" for kind in qwen.layer_types
    ]
    from transformers import Qwen3Config

    qwen3 = Qwen3Config(use_sliding_window=True, sliding_window=48, max_window_layers=3, **layers)
    assert shape_of(qwen3).windows == (None, None, None, 48)
    # a raw config.json (as the vLLM backend reads one) gives the same
    raw = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 101,
           "max_position_embeddings": 512, "num_hidden_layers": 4,
           "sliding_window": 48}  # fmt: skip
    assert shape_of(SimpleNamespace(**raw, use_sliding_window=False)).windows == ()
    on = SimpleNamespace(**raw, use_sliding_window=True, max_window_layers=1)
    assert shape_of(on).windows == (None, 48, 48, 48)
    assert shape_of(SimpleNamespace(**{**raw, "model_type": "mistral"})).windows == (48,) * 4
    # Gemma 3: the layers layer_types names local; a config without them (older checkpoints,
    # a raw config.json) every sliding_window_pattern-th layer global, as transformers derives
    gemma = Gemma3TextConfig(sliding_window=48, num_hidden_layers=7, head_dim=16)
    assert gemma.layer_types == [LOCAL] * 5 + [GLOBAL] + [LOCAL]
    assert shape_of(gemma).windows == (48,) * 5 + (None, 48)
    mixed = Gemma3TextConfig(sliding_window=48, layer_types=[GLOBAL, LOCAL] * 2, **layers)
    assert shape_of(mixed).windows == (None, 48, None, 48)
    raw_gemma = SimpleNamespace(**{**raw, "model_type": "gemma3_text", "head_dim": 16})
    assert shape_of(raw_gemma).windows == (48,) * 4  # 4 layers: none is a 6th
    patterned = SimpleNamespace(**vars(raw_gemma), sliding_window_pattern=2)
    assert shape_of(patterned).windows == (48, None, 48, None)


# -- full attention against transformers ----------------------------------------------------
def test_full_attention_on_a_windowed_model_equals_hf_generate(windowed, unwindowed, engine):
    """`full`, and SPEED at lcut = L, give transformers' own greedy tokens on a prompt six
    windows long; the window changes those tokens (so this fails on an engine that ignores
    it). A windowed layer keeps only what the next token's window reaches, as transformers'
    cache does; a layer without one keeps every row."""
    ids = random_prompt(N, seed=2)
    L = windowed.shape.num_layers
    specs = ["full", f"speed:lcut={L},anchors=bos,deep=1", f"speed:lcut={L},anchors=none,deep=5"]
    check_equals_hf_generate(engine, ids, specs, NEW)
    assert hf_generate(unwindowed.hf_model, ids, NEW, min_new_tokens=NEW) != hf_generate(
        windowed.hf_model, ids, NEW, min_new_tokens=NEW
    )
    request = Request(ids, make_policy("full", windowed.shape), SamplingParams(NEW))
    windows = [windowed.shape.window(layer) for layer in range(L)]
    assert engine.generate([request])[0].layer_lengths == [
        N if w is None else w - 1 for w in windows
    ]


def test_the_dense_reference_at_lcut_L_is_the_models_own_forward(windowed):
    ids = torch.tensor(random_prompt(N, seed=4))
    L = windowed.shape.num_layers
    dense, positions = speed_dense_forward(windowed.backbone, ids, N, L)
    with torch.inference_mode():
        own = windowed.hf_model(ids[None].to(windowed.backbone.device)).logits[0].float()
    assert positions.tolist() == list(range(N))
    assert torch.allclose(dense, own, atol=1e-4, rtol=0), (dense - own).abs().max()


# -- SPEED against the dense reference ------------------------------------------------------
@pytest.mark.parametrize(
    "n, lcut, anchors, deep, selfonly",
    [
        (N, 2, ("bos", 1), 1, False),  # the anchor is 300 positions behind a 48-token window
        (N, 3, ("none", 0), 5, False),
        (N, 0, ("sink:4", 4), 3, False),  # every layer upper: the sinks fall out of every window
        (N, 4, ("bos", 1), 64, False),  # a deep suffix longer than the window
        (N, 2, ("bos", 1), 1, True),  # SelfOnly: the anchor, when the window still holds it
        (45, 2, ("bos", 1), 2, False),  # shorter than the window: wholly at full depth
        (60, 2, ("sink:4", 4), 2, False),  # a sink still in the deep suffix's window: full depth
        (120, 3, ("sink:4", 4), 4, False),  # the sinks left the window before the deep suffix
    ],
)
def test_speed_on_a_windowed_model_equals_the_dense_reference(
    windowed, unwindowed, engine, n, lcut, anchors, deep, selfonly
):
    name, count = anchors
    ids = random_prompt(n, seed=lcut + deep)
    spec = f"speed:lcut={lcut},anchors={name},deep={deep},selfonly={str(selfonly).lower()}"
    policy = make_policy(spec, windowed.shape)
    tokens, logits, _ = greedy_with_logits(engine, ids, policy, steps=NEW)
    sequence = torch.tensor(ids + tokens[:-1])
    dense, positions = speed_dense_forward(
        windowed.backbone, sequence, n, lcut, count, deep, selfonly
    )
    dense = dense[positions >= n - 1]  # the rows that predict new tokens
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()
    # where some windowed layer holds rows further apart than its window, the window shapes
    # the answer: the same rule without it gives other logits
    last, first_deep = len(sequence) - 1, int(positions.min())
    spans = [
        last - (0 if layer < lcut else first_deep) for layer in range(windowed.shape.num_layers)
    ]
    if any(w is not None and span >= w for span, w in zip(spans, windowed.shape.windows)):
        # the same rows at full depth, attending without the window
        keep = policy.rule.full_depth(torch.arange(len(sequence)), n, deep)
        h, _ = speed_hidden(unwindowed.backbone, sequence, n, policy.rule, full_depth=keep)
        plain = unwindowed.backbone.logits(h)
        assert (plain[positions >= n - 1] - dense).abs().max() > 1e-2


@pytest.mark.parametrize("anchors", [0, 1, 4])
@pytest.mark.parametrize("deep", [1, 2, 64])
def test_an_upper_windowed_layer_sees_a_run_of_consecutive_rows(anchors, deep):
    """What makes SPEED exact on a paged kernel's own window (vLLM's): under the rule, every
    row an upper windowed layer computes sees a run of consecutive rows of those it holds,
    and a deep row sees no anchor, or the prompt runs wholly at full depth."""
    from speedkv.methods.speed import SpeedRule

    rule = SpeedRule(lcut=2, anchors=anchors, deep=deep, window=WINDOW)
    for prompt in range(1, 3 * WINDOW, 7):
        pos = torch.arange(prompt + 10)  # the prompt and ten generated tokens
        held = pos[rule.full_depth(pos, prompt, deep)]
        seen = rule.upper_visibility(held, held, WINDOW)
        for row in range(held.numel()):
            index = seen[row].nonzero().squeeze(1)
            assert torch.equal(index, torch.arange(int(index[0]), int(index[-1]) + 1))
        if rule.deep_for(prompt, deep) < prompt:  # shallow rows between anchors and deep
            assert not seen[held >= anchors][:, held < anchors].any()


def test_a_short_prompt_on_a_windowed_model_runs_as_full_attention(windowed, engine):
    """A prompt whose anchor would still sit in its deep suffix's window runs wholly at full
    depth: SPEED's answer is full attention's, logits included."""
    ids = random_prompt(40, seed=5)
    speed = make_policy("speed:lcut=2,anchors=bos,deep=1", windowed.shape)
    assert speed.rule.deep_for(len(ids), 1) == len(ids)
    tokens, logits, _ = greedy_with_logits(engine, ids, speed, steps=NEW)
    full_tokens, full_logits, _ = greedy_with_logits(
        engine, ids, make_policy("full", windowed.shape), steps=NEW
    )
    assert tokens == full_tokens
    assert torch.allclose(logits, full_logits, atol=1e-4, rtol=0)


def test_a_question_on_a_cached_document_equals_the_dense_reference(windowed, engine):
    """Prefix reuse: the question's rows attend, inside the window, to a cached document's
    rows (masked prefill over a base cache); full equals itself from scratch."""
    doc, question = random_prompt(N, seed=11), random_prompt(9, seed=12)
    spec = "speed:lcut=3,anchors=bos,deep=2"
    cached = engine.prefill(doc, spec, chat=False)
    again = engine.generate(cached, question, max_new_tokens=NEW, min_new_tokens=NEW)
    ids = doc + question + again.output_ids[:-1]
    pos = torch.arange(len(ids))
    full = (pos < 1) | (pos >= N - 2) & (pos < N) | (pos >= N + 9 - 2)  # one suffix a prefill
    rule = make_policy(spec, windowed.shape).rule
    h, kept = speed_hidden(windowed.backbone, torch.tensor(ids), N + 9, rule, full_depth=full)
    reference = windowed.backbone.logits(h)[kept >= N + 9 - 1]
    assert reference.argmax(-1).tolist() == again.output_ids

    cached = engine.prefill(doc, "full", chat=False)
    reused = engine.generate(cached, question, max_new_tokens=NEW, min_new_tokens=NEW)
    assert reused.reused_tokens == N
    assert reused.output_ids == hf_generate(windowed.hf_model, doc + question, NEW,
                                            min_new_tokens=NEW)  # fmt: skip


def test_a_prefix_store_reuses_a_windowed_cache_only_where_its_windows_find_their_rows(windowed):
    """A finished conversation's cache dropped what its windows left behind: the next turn,
    which continues it from its end, reuses it; a prompt that shares only its first tokens
    does not, and recomputes. Both equal transformers' tokens."""
    from collections import OrderedDict

    from speedkv.core.prefix import PrefixCache

    store = PrefixCache(max_bytes=2**30)
    engine = Engine(windowed, chunk_size=64, prefix_cache=store)
    first, sampling = random_prompt(N, seed=21), SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    turn = engine.generate([Request(first, make_policy("full", windowed.shape), sampling)])[0]
    finished = next(e for e in store._entries.values() if len(e) > N)  # prompt and answer
    windows = [windowed.shape.window(layer) for layer in range(windowed.shape.num_layers)]
    assert any(layer.dropped_below > 0 for layer in finished.cache.layers)
    assert finished.cache.covers(windows, len(finished)) and not finished.cache.covers(windows, 40)
    store._entries = OrderedDict((k, e) for k, e in store._entries.items() if e is finished)
    ids = [*first, *turn.output_ids[:-1], *random_prompt(7, seed=22)]
    again = engine.generate([Request(ids, make_policy("full", windowed.shape), sampling)])[0]
    assert again.reused_tokens == len(finished)
    assert again.output_ids == hf_generate(windowed.hf_model, ids, NEW, min_new_tokens=NEW)
    store._entries = OrderedDict((k, e) for k, e in store._entries.items() if e is finished)
    short = [*first[:40], *random_prompt(30, seed=23)]
    fresh = engine.generate([Request(short, make_policy("full", windowed.shape), sampling)])[0]
    assert fresh.reused_tokens == 0
    assert fresh.output_ids == hf_generate(windowed.hf_model, short, NEW, min_new_tokens=NEW)


# -- decode paths ----------------------------------------------------------------------------
def test_a_batch_of_lengths_on_both_sides_of_the_window_decodes_as_each_alone(windowed, engine):
    prompts = [random_prompt(n, seed=n) for n in (N, 20, 45)]
    specs = ["full", "speed:lcut=2,anchors=bos,deep=1", "full"]
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)

    def requests(members):
        return [Request(prompts[i], make_policy(specs[i], windowed.shape), sampling)
                for i in members]  # fmt: skip

    together = [g.output_ids for g in engine.generate(requests(range(3)))]
    assert together == [engine.generate(requests([i]))[0].output_ids for i in range(3)]


def test_a_window_over_entries_out_of_position_order_is_a_mask(windowed, engine):
    """Where a cache's entries are not in position order (eviction, per-head retention),
    the window cannot be a run of slots: decode masks by position and gets the same logits."""
    ids = random_prompt(N, seed=6)
    policy = make_policy("full", windowed.shape)
    ordered = engine.prefill_ids(ids, policy, spare=2)
    scrambled = engine.prefill_ids(ids, make_policy("full", windowed.shape), spare=2)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for kv in scrambled.cache.layers:
            kv.keep(torch.randperm(kv.length, generator=generator).to(kv.k.device))
    assert all(kv.in_order() for kv in ordered.cache.layers)
    assert not any(kv.in_order() for kv in scrambled.cache.layers)
    token = int(ordered.logits.argmax())
    want = engine.decode_step([ordered.cache], [policy], [token], [N])
    got = engine.decode_step([scrambled.cache], [policy], [token], [N])
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("n", [40, N])  # a window that starts to bite mid-recording; one that bites
def test_recorded_steps_on_a_windowed_model_equal_the_engines(windowed, n):
    """The recorded decode step masks the window by the device position (on a CPU it runs
    eagerly, as the GPU records it)."""
    specs = ["full", "speed:lcut=2,anchors=bos,deep=1"]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = {}
    for mode in ("never", "always"):
        engine = Engine(windowed, chunk_size=64, recorded_decode=mode)
        requests = [Request(random_prompt(n, seed=9), make_policy(s, windowed.shape), sampling)
                    for s in specs]  # fmt: skip
        results[mode] = [(g.output_ids, g.kv_bytes_final) for g in engine.generate(requests)]
    assert results["always"] == results["never"]


def test_one_native_call_per_layer_reads_the_window_as_a_narrower_buffer(monkeypatch):
    """bfloat16 weights packed for speedkv's decode layer: each layer runs as one native call
    over the slots inside the window, bit for bit the layer run in parts."""
    from test_decode_kernels import NATIVE_SHAPED, logits_per_step

    from speedkv.kernels import attention, native, tuning
    from speedkv.kernels.tuning import KernelChoice

    ops = native.native_ops()
    if ops is None or not hasattr(ops, "decode_layer") or not hasattr(ops, "packed_linear"):
        pytest.skip("no native decode layer here (no compiler, or neither AVX512-BF16 nor AVX2)")
    monkeypatch.setattr(tuning, "kernel_choice", lambda: KernelChoice())
    monkeypatch.setattr(tuning, "engine_kernels", lambda: ops)
    monkeypatch.setattr(attention, "engine_kernels", lambda: ops)
    model = build("mistral", sliding_window=16, **NATIVE_SHAPED)
    model.hf_model.to(torch.bfloat16)
    native_engine = Engine(model, prepack=True)
    prompts = [random_prompt(n, seed=n) for n in (9, 23, 40)]
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1"]
    in_parts, used = logits_per_step(native_engine, prompts, specs, 5, one_call=False)
    assert not any(used)
    in_one_call, used = logits_per_step(native_engine, prompts, specs, 5, one_call=True)
    assert used and all(used)
    for a, b in zip(in_one_call, in_parts):
        assert torch.equal(a, b)


# -- the analysis tools ----------------------------------------------------------------------
def test_the_diagnostic_and_the_cutoff_sweep_follow_the_window(windowed):
    """The layer-wise trace's attention weights are transformers' own (eager, windowed); its
    SPEED logits are the dense reference's; the shared-pass sweep equals each cutoff alone."""
    from speedkv.analysis.cutoff import separate_logits, shared_logits
    from speedkv.analysis.diagnose import CATEGORIES, trace

    prompt, ids = 100, random_prompt(110, seed=8)
    t = trace(windowed.backbone, ids, prompt)
    with torch.inference_mode():
        out = windowed.hf_model(torch.tensor([ids], device=windowed.backbone.device),
                                output_attentions=True)  # fmt: skip
    ref = torch.stack([a[0, :, prompt:, :].float() for a in out.attentions])  # [L, H, g, T]
    assert torch.allclose(t.mass["bos"], ref[..., 0].mean(1), atol=1e-5)
    assert torch.allclose(t.mass["prompt_end"], ref[..., prompt - 1].mean(1), atol=1e-5)
    total = sum(t.mass[c] for c in CATEGORIES)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-5)

    t = trace(windowed.backbone, ids, prompt, 2, anchors=1, deep=1)
    dense, pos = speed_dense_forward(windowed.backbone, torch.tensor(ids), prompt, 2)
    assert torch.allclose(t.logits, dense[pos >= prompt], atol=1e-5)

    sequence, cuts = torch.tensor(ids), list(range(windowed.shape.num_layers + 1))
    shared = {c: lg for c, lg, _ in shared_logits(windowed.backbone, sequence, prompt, cuts)}
    alone = {c: lg for c, lg, _ in separate_logits(windowed.backbone, sequence, prompt, cuts)}
    for cut in cuts:
        assert torch.allclose(shared[cut], alone[cut], atol=1e-5), cut


# -- Llama 3's rope scaling and tied embeddings ---------------------------------------------
LLAMA3 = {
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": True,
}  # fmt: skip


def test_llama3_rope_scaling_and_tied_embeddings_follow_transformers():
    model = build("llama", **LLAMA3)
    hf = model.hf_model
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert hf.model.rotary_emb.rope_type == "llama3"
    engine = Engine(model, chunk_size=32)
    ids = random_prompt(150, seed=7)  # past original_max_position_embeddings
    check_equals_hf_generate(engine, ids, ["full", "speed:lcut=6,anchors=bos,deep=1"], NEW)
    policy = make_policy("speed:lcut=3,anchors=bos,deep=1", model.shape)
    tokens, logits, _ = greedy_with_logits(engine, ids, policy, steps=NEW)
    dense, positions = speed_dense_forward(model.backbone, torch.tensor(ids + tokens[:-1]), 150, 3)
    dense = dense[positions >= 149]
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()
