"""The recordable decode step (core/graph_decode.py) against the engine's own decode step:
the same logits, step after step, for every method it takes, alone and in a mixed batch; and
a clear refusal for what it cannot follow; and the engine's generation loop through it, token
for token the same as through its own step. On the CPU the step runs eagerly; with
`--device cuda` it is recorded as a CUDA graph and replayed."""

import copy

import pytest
import torch

from speedkv.core.engine import Engine, Request
from speedkv.core.graph_decode import WIDTH, GraphDecode
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.kernels.attention import matmul_decode_attention

from conftest import random_prompt

STEPS = 6


def decode_both(
    engine, prompts: list[list[int]], specs: list[str], flash: bool = False, record=None
):
    """Greedy decode of each prompt under its method, once through Engine.decode_step and
    once through GraphDecode (recorded per `record`, GraphDecode's default: on a GPU), both
    fed the reference's tokens; the logits of every step."""
    shape = engine.shape
    ref = [make_policy(s, shape) for s in specs]
    rec = [make_policy(s, shape) for s in specs]
    ref_fill = [engine.prefill_ids(p, pol, spare=STEPS) for p, pol in zip(prompts, ref)]
    rec_fill = [engine.prefill_ids(p, pol, spare=STEPS) for p, pol in zip(prompts, rec)]
    positions = [f.next_position for f in ref_fill]
    caches = [f.cache for f in rec_fill]
    graph = GraphDecode(engine, caches, rec, positions, STEPS, record=record, flash=flash)
    tokens = [int(f.logits.argmax()) for f in ref_fill]
    steps = []
    for step in range(STEPS):
        want = engine.decode_step(
            [f.cache for f in ref_fill], ref, tokens, [p + step for p in positions]
        )
        got = graph.step(tokens)
        steps.append((want, got))
        tokens = want.argmax(-1).tolist()
    return steps, ref_fill, rec_fill


@pytest.mark.parametrize(
    "spec",
    [
        "full",
        "speed:lcut=3,anchors=bos,deep=1",
        "speed:lcut=2,anchors=sink:2,deep=3",
        "snapkv:retain=0.5,window=4,gqa=false",  # a cache kept per query head
        "fastkv:retain=0.5",
    ],
)
def test_recorded_step_equals_the_engines_step(tiny_engine, spec):
    steps, ref, rec = decode_both(tiny_engine, [random_prompt(37)], [spec])
    for want, got in steps:
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-4
    assert ref[0].cache.lengths() == rec[0].cache.lengths()
    assert ref[0].cache.nbytes() == rec[0].cache.nbytes()


def test_a_mixed_batch_equals_the_engines_batch(tiny_engine):
    prompts = [random_prompt(n, seed=n) for n in (11, 40)]
    steps, ref, rec = decode_both(tiny_engine, prompts, ["full", "speed:lcut=3,anchors=bos,deep=1"])
    for want, got in steps:
        assert (got - want).abs().max() < 1e-4
    assert [c.cache.lengths() for c in ref] == [c.cache.lengths() for c in rec]


def test_recorded_steps_run_out(tiny_engine):
    policy = make_policy("full", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(9), policy, spare=2)
    graph = GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], 2)
    graph.step([1])
    graph.step([2])
    with pytest.raises(RuntimeError, match="all 2 recorded decode steps are taken"):
        graph.step([3])


@pytest.mark.parametrize(
    "spec, spare, reason",
    [
        ("h2o:heavy=0.3,recent=0.3", 8, "changes its cache during decode"),
        ("swiftkv:k=2,acrosskv=2", 8, "does not append its own K/V"),
    ],
)
def test_what_a_recorded_step_cannot_follow_is_refused(tiny_engine, spec, spare, reason):
    policy = make_policy(spec, tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(30), policy, spare=spare)
    with pytest.raises(ValueError, match=reason):
        GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], 8)


def test_a_cache_without_room_for_the_steps_is_refused(tiny_engine):
    policy = make_policy("full", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(30), policy, spare=2)
    # one step more than the buffers hold (a GPU's prefill rounds them up to WIDTH)
    steps = min(kv.capacity - kv.length for kv in fill.cache.layers) + 1
    reason = f"no room for {steps} more tokens: prefill with spare >= {steps}"
    with pytest.raises(ValueError, match=reason):
        GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], steps)


def test_free_slots_are_zeroed_so_masked_entries_stay_finite(tiny_engine):
    policy = make_policy("full", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(9), policy, spare=4)
    with torch.inference_mode():  # what torch.empty may leave in a buffer's free slots
        for kv in fill.cache.layers:
            kv.v[:, kv.length :] = float("nan")
    graph = GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], 4)
    assert torch.isfinite(graph.step([1])).all()


# -- the engine's generation loop through recorded steps -----------------------------------------
def generate(tiny_engine, mode: str, specs: list[str], new: list[int], monkeypatch=None):
    """Greedy generations of one batch, the engine recording its decode steps per `mode`; and
    how many steps ran through Engine.decode_step instead."""
    engine = Engine(tiny_engine.model, chunk_size=16, recorded_decode=mode)
    eager = []
    if monkeypatch is not None:
        step = engine.decode_step
        monkeypatch.setattr(engine, "decode_step", lambda *a: eager.append(1) or step(*a))
    return engine.generate(batch(engine, specs, new)), len(eager)


def batch(engine, specs: list[str], new: list[int]) -> list[Request]:
    """One greedy request per method, each with its own prompt and token limit."""
    return [
        Request(random_prompt(23 + 9 * i, seed=i), make_policy(spec, engine.shape),
                SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (spec, n) in enumerate(zip(specs, new))
    ]  # fmt: skip


@pytest.mark.parametrize(
    "specs, new",
    [
        (["full"], [9]),
        (["speed:lcut=3,anchors=bos,deep=1"], [9]),
        # the first leaves after 4 steps: the other two go on through a second recording
        (["full", "speed:lcut=2,anchors=sink:2,deep=3", "fastkv:retain=0.5"], [5, 9, 12]),
    ],
)
def test_generation_through_recorded_steps_equals_the_engines(tiny_engine, specs, new, monkeypatch):
    want, _ = generate(tiny_engine, "never", specs, new)
    got, eager = generate(tiny_engine, "always", specs, new, monkeypatch)
    assert eager == 0
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids and len(g.output_ids) == len(w.output_ids)
        assert (g.kv_bytes, g.kv_bytes_final) == (w.kv_bytes, w.kv_bytes_final)


def test_a_batch_with_a_method_that_evicts_steps_eagerly(tiny_engine, monkeypatch):
    specs, new = ["full", "h2o:heavy=0.3,recent=0.3"], [6, 6]
    want, _ = generate(tiny_engine, "never", specs, new)
    got, eager = generate(tiny_engine, "always", specs, new, monkeypatch)
    assert eager == 5
    assert [g.output_ids for g in got] == [w.output_ids for w in want]


def test_a_cpu_engine_records_only_when_asked(tiny_engine, device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("on a GPU 'auto' records")
    _, eager = generate(tiny_engine, "auto", ["full"], [40], monkeypatch)
    assert eager == 39


def test_an_unknown_recorded_decode_mode_is_refused(tiny_engine, monkeypatch):
    with pytest.raises(UserError, match="'sometimes' is not one of auto, always, never"):
        Engine(tiny_engine.model, recorded_decode="sometimes")
    monkeypatch.setenv("SPEEDKV_RECORDED_ATTENTION", "fast")
    with pytest.raises(UserError, match="recorded attention 'fast' is not one of flash, matmul"):
        Engine(tiny_engine.model)


def test_buffers_are_widened_to_an_aligned_width_and_keep_their_entries(tiny_engine):
    policy = make_policy("speed:lcut=3,anchors=bos,deep=1", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(37), policy, spare=5)
    before = [(kv.keys().clone(), kv.positions().clone()) for kv in fill.cache.layers]
    odd = [kv.capacity % WIDTH for kv in fill.cache.layers]
    # a GPU's prefill allocates them that wide already, so that recording copies nothing
    assert (not any(odd)) if tiny_engine.device.type == "cuda" else any(odd)
    GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], 5)
    for kv, (keys, positions) in zip(fill.cache.layers, before):
        assert kv.capacity % WIDTH == 0
        assert torch.equal(kv.keys(), keys) and torch.equal(kv.positions(), positions)


def test_a_step_that_cannot_be_recorded_falls_back_to_launching_kernels(
    tiny_engine, monkeypatch, capsys
):
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(Engine, "records_graphs", True)  # as on a GPU
    monkeypatch.setattr("speedkv.core.engine.GraphDecode", refuse)
    want, _ = generate(tiny_engine, "never", ["full"], [20])
    engine = Engine(tiny_engine.model, chunk_size=16, recorded_decode="auto")
    got = engine.generate(batch(engine, ["full"], [20]))
    assert got[0].output_ids == want[0].output_ids
    assert engine.recorded_decode == "never"
    assert "cannot be recorded here, so they run kernel by kernel" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="stream is capturing"):  # asked for: no fallback
        generate(tiny_engine, "always", ["full"], [20])


# -- flash attention with a device length (CUDA only: a CPU stands in for torch's kernel) -------
def stand_in_flash(reads_to: str = "live"):
    """torch's variable-length flash attention as the recorded step calls it (one query per
    sequence, the sequences' buffers side by side), computed per sequence and head;
    `reads_to="width"` reads each whole buffer, as a kernel ignoring the lengths would."""

    def run(q, k, v, query_starts, key_starts, max_q, max_k, dropout, causal, debug, **kw):
        live, batch = kw["seqused_k"], q.shape[0]
        assert live.dtype == torch.int32 and live.shape == (batch,) and max_q == 1
        assert query_starts.tolist() == list(range(batch + 1))
        assert key_starts.tolist() == [b * max_k for b in range(batch + 1)]
        assert k.shape[0] == batch * max_k
        outs = []
        for b in range(batch):
            n = int(live[b]) if reads_to == "live" else max_k
            part = slice(b * max_k, b * max_k + n)
            keys, values = k[part].transpose(0, 1), v[part].transpose(0, 1)
            outs.append(matmul_decode_attention(q[b, :, None], keys, values, per_head=True))
        return torch.stack(outs)[:, :, 0], None, None, None, None

    return run


@pytest.mark.parametrize(
    "kernel, used",
    [(stand_in_flash(), "flash"), (stand_in_flash("width"), "matmul"), (None, "matmul")],
)
def test_flash_with_a_device_length_runs_only_where_it_matches(tiny_engine, monkeypatch,
                                                               kernel, used):  # fmt: skip
    def missing(*args, **kwargs):
        raise RuntimeError("no flash attention here")

    monkeypatch.setattr("speedkv.core.graph_decode.flash_takes", lambda cache: True)
    monkeypatch.setattr("speedkv.core.graph_decode._NO_FLASH", set())
    calls = []
    counted = lambda *a, **kw: calls.append(1) or (kernel or missing)(*a, **kw)  # noqa: E731
    monkeypatch.setattr("speedkv.kernels.attention._varlen_flash", counted)
    specs = ["full", "speed:lcut=3,anchors=bos,deep=1"]
    prompts = [random_prompt(n, seed=n) for n in (11, 40)]
    # not recorded: a graph cannot capture the stand-in's reads of the lengths on the host
    steps, ref, rec = decode_both(tiny_engine, prompts, specs, flash=True, record=False)
    for want, got in steps:
        assert (got - want).abs().max() < 1e-4
    # one probe, then (if it matched) one call for the whole batch per layer and step
    layers = tiny_engine.depth
    assert len(calls) == (1 + STEPS * layers if used == "flash" else 1)
    policy = make_policy("full", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(9), policy, spare=2)
    args = (tiny_engine, [fill.cache], [policy], [fill.next_position], 2)
    graph = GraphDecode(*args, record=False, flash=True)
    assert graph.attention == used
    fill = tiny_engine.prefill_ids(random_prompt(9), policy, spare=2)
    plain = GraphDecode(tiny_engine, [fill.cache], [policy], [fill.next_position], 2, record=False)
    assert plain.attention == "matmul"  # flash only when asked for


def test_a_flash_recording_that_fails_is_made_again_with_matrix_products(tiny_engine,
                                                                        monkeypatch):  # fmt: skip
    tried = []

    def record(graph):  # a GPU's recording, where flash attention cannot be recorded
        tried.append(graph.attention)
        if graph.attention == "flash":
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("speedkv.core.graph_decode.flash_takes", lambda cache: True)
    monkeypatch.setattr("speedkv.core.graph_decode._NO_FLASH", set())
    monkeypatch.setattr("speedkv.kernels.attention._varlen_flash", stand_in_flash())
    monkeypatch.setattr(GraphDecode, "_record", record)
    policy = make_policy("full", tiny_engine.shape)
    fill = tiny_engine.prefill_ids(random_prompt(9), policy, spare=2)
    args = (tiny_engine, [fill.cache], [policy], [fill.next_position], 2)
    graph = GraphDecode(*args, record=True, flash=True)
    assert tried == ["flash", "matmul"] and graph.attention == "matmul"
    again = GraphDecode(*args, record=True, flash=True)
    assert again.attention == "matmul" and tried[2:] == ["matmul"]  # not tried again


def test_half_precision_steps_attend_by_flash_where_asked_and_agree(tiny, device):
    """On a GPU, flash attention with device lengths inside a recorded step, a batch of
    different lengths and methods in one call per layer, against the masked matrix products;
    on a CPU both are the products (flash takes no CPU cache)."""
    from speedkv.hf.loading import LoadedModel

    half = LoadedModel(name="tiny-bf16", hf_model=copy.deepcopy(tiny.hf_model).to(torch.bfloat16),
                       tokenizer=None, source="memory")  # fmt: skip
    specs = ["speed:lcut=3,anchors=bos,deep=1", "full", "speed:lcut=2,anchors=sink:2,deep=3"]
    prompts = [random_prompt(n, seed=n) for n in (37, 20, 71)]
    runs = []
    # the same steps in float32 through the matrix products: what both roundings approximate
    for model, flash in ((half, True), (half, False), (tiny, False)):
        engine = Engine(model, chunk_size=16)
        policies = [make_policy(spec, engine.shape) for spec in specs]
        fills = [engine.prefill_ids(p, pol, spare=STEPS) for p, pol in zip(prompts, policies)]
        graph = GraphDecode(
            engine, [f.cache for f in fills], policies, [f.next_position for f in fills],
            STEPS, flash=flash,
        )  # fmt: skip
        steps = [graph.step([5 + step] * 3).float() for step in range(STEPS)]
        runs.append((graph.attention, torch.stack(steps)))
    (kind, with_flash), (_, products), (_, exact) = runs
    assert kind == ("flash" if device.type == "cuda" else "matmul")
    # flash keeps its weights in float32 where the products round them to bfloat16: it may
    # differ from them, but it must stay about as close to float32 as they do (a sequence
    # attending to another's part of the packed buffer would be off by the logits' scale)
    flash_error = (with_flash - exact).abs().max()
    products_error = (products - exact).abs().max()
    assert flash_error <= max(2 * products_error, 0.05 * exact.abs().max())


def test_a_batch_attends_by_flash_once_a_layer_and_stores_no_packed_views(tiny_engine,
                                                                         monkeypatch):  # fmt: skip
    """The batch's buffers packed side by side and attended in one call per layer give the
    engine's own tokens and byte counts; a finished sequence goes into the prefix store as a
    copy of its own, not as a view that would hold the whole batch's buffers."""
    if tiny_engine.device.type != "cpu":
        pytest.skip("float32 caches: a GPU attends by the matrix products (flash_takes)")
    from speedkv.core.prefix import PrefixCache

    monkeypatch.setattr("speedkv.core.graph_decode.flash_takes", lambda cache: True)
    monkeypatch.setattr("speedkv.core.graph_decode._NO_FLASH", set())
    calls = []
    kernel = stand_in_flash()
    monkeypatch.setattr(
        "speedkv.kernels.attention._varlen_flash",
        lambda *a, **kw: calls.append(1) or kernel(*a, **kw),
    )
    specs = ["full", "speed:lcut=2,anchors=sink:2,deep=3", "full"]
    new = [5, 9, 12]
    want, _ = generate(tiny_engine, "never", specs, new)
    store = PrefixCache(2**30, min_tokens=4)
    engine = Engine(tiny_engine.model, chunk_size=16, recorded_decode="always", prefix_cache=store)
    got = engine.generate(batch(engine, specs, new))
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids
        assert (g.kv_bytes, g.kv_bytes_final) == (w.kv_bytes, w.kv_bytes_final)
    # three recordings (3, then 2, then 1 sequences), each a probe and one call per layer and step
    steps = [4, 4, 3]  # steps taken by each recording until a sequence leaves or all finish
    assert len(calls) == sum(1 + s * tiny_engine.depth for s in steps)
    stored = [entry for entry in store._entries.values()]
    assert stored and not any(entry.cache.has_views() for entry in stored)
