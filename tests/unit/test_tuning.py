"""The kernel choice: measured once per machine and setting, stored, overridden by
SPEEDKV_KERNELS, and what the engine runs follows it (with the reference's tokens whatever
it says)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, fields

import pytest
import torch
from typer.testing import CliRunner

from speedkv.cli.app import app
from speedkv.kernels import cpu, native, tuning
from speedkv.kernels.tuning import ALL_ROWS, NATIVE, TORCH, KernelChoice

needs_kernels = pytest.mark.skipif(native.native_ops() is None, reason="no native kernels here")


@pytest.fixture(autouse=True)
def fresh_choice():
    tuning.kernel_choice.cache_clear()
    tuning.engine_kernels.cache_clear()
    yield
    tuning.kernel_choice.cache_clear()
    tuning.engine_kernels.cache_clear()


def test_a_kind_chosen_for_torch_hides_exactly_its_operators():
    choice = KernelChoice(prefill_attention=TORCH, layer_ops=TORCH)
    assert choice.hidden_operators() == {
        "causal_attention", "prefill_attention_unit",
        "rms_norm", "add_rms_norm", "silu_mul", "rotary_split",
        "decode_layer",  # a whole decode layer calls the small operations too
    }  # fmt: skip
    assert KernelChoice().hidden_operators() == set()
    assert KernelChoice.torch_only().hidden_operators() >= {
        "packed_linear", "decode_attention", "decode_layer", "tile_linear",
    }  # fmt: skip


def test_torch_kernels_only_still_decode_on_the_prepacked_copy(monkeypatch):
    """SPEEDKV_KERNELS=torch keeps oneDNN's prepacked weights for every batch (twice as fast per
    token as the plain ones), as before the kernel choice existed."""
    from speedkv.core.engine import Engine

    from conftest import tiny_model

    monkeypatch.setenv(native.SWITCH, "torch")
    backbone = Engine(tiny_model("llama"), prepack=True).backbone
    assert backbone.native_ops is None or "packed_linear" not in backbone.native_ops.names
    for rows in (1, 8, 64):
        assert backbone._layer_weights(0, prefill=False, rows=rows) is backbone.decode_weights()[0]
    assert backbone._layer_weights(0, prefill=False) is not backbone._plain_weights[0]


def test_torch_must_win_by_the_margin_to_replace_a_native_kernel():
    assert tuning._faster({NATIVE: 1.0, TORCH: 0.95}) == NATIVE
    assert tuning._faster({NATIVE: 1.0, TORCH: 0.85}) == TORCH
    assert tuning._faster({NATIVE: 1.0, TORCH: 2.0}) == NATIVE


def test_a_race_times_every_candidate_in_every_round():
    calls = {"a": 0, "b": 0}

    def count(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    timings = tuning._race({"a": count("a"), "b": count("b")}, rounds=5)
    assert calls == {"a": 6, "b": 6}  # a warm-up call each, then 5 rounds
    assert set(timings) == {"a", "b"} and all(t >= 0 for t in timings.values())


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("load", [0.0, 8.0])
def test_a_busy_machine_is_timed_on_one_thread_by_its_cpu_time(monkeypatch, two_threads, load):
    """Under load, rounds on several threads lose time slices at every barrier: the race runs on
    one thread instead, and a candidate that waits (as a descheduled one does) costs nothing."""
    monkeypatch.setattr(tuning.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(tuning.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    busy = load > 0
    threads, clock = tuning.race_clock()
    assert threads == (1 if busy else 2)
    assert clock.startswith("1 thread by its CPU time" if busy else "2 threads by the wall clock")

    seen = []
    monkeypatch.setattr(
        tuning, "_measure", lambda ops, choice: seen.append(torch.get_num_threads()) or choice
    )
    choice = tuning.measure(None)
    assert seen == [threads] and choice.clock == clock
    assert torch.get_num_threads() == 2  # the engine's threads are back
    assert f"timed on {clock}" in choice.lines()

    torch.set_num_threads(threads)
    waited = tuning._race({"waits": lambda: time.sleep(0.02)}, rounds=2)["waits"]
    assert (waited < 5) if busy else (waited >= 20)  # ms: a wait is not CPU time


@pytest.mark.parametrize("switch", ["torch", "native"])
def test_the_switch_overrides_the_measured_choice(monkeypatch, switch):
    monkeypatch.setenv(native.SWITCH, switch)
    monkeypatch.setattr(tuning, "measure", lambda ops: pytest.fail("measured under a switch"))
    choice = tuning.kernel_choice()
    if switch == "torch" or native.native_ops() is None:
        assert choice == KernelChoice.torch_only()
        assert tuning.engine_kernels() is None
    else:
        assert choice == KernelChoice()
        assert set(tuning.engine_kernels().names) == set(native.native_ops().names)


@needs_kernels
def test_the_choice_is_measured_once_and_stored_per_setting(monkeypatch, tmp_path):
    monkeypatch.setenv(native.SWITCH, "auto")
    monkeypatch.setattr(native, "kernels_root", lambda: tmp_path)
    measured = []

    def fake_measure(ops):
        measured.append(ops)
        return KernelChoice(layer_ops=TORCH, decode_linear_native_rows=8,
                            timings={"layer_ops": {NATIVE: 2.0, TORCH: 1.0}})  # fmt: skip

    monkeypatch.setattr(tuning, "measure", fake_measure)
    first = tuning.kernel_choice()
    stored = json.loads(tuning.choice_path().read_text())
    assert stored["layer_ops"] == TORCH and stored["decode_linear_native_rows"] == 8
    tuning.kernel_choice.cache_clear()
    assert tuning.kernel_choice() == first and len(measured) == 1  # read back, not measured
    kept = set(tuning.engine_kernels().names)
    assert "rms_norm" not in kept and "silu_mul" not in kept
    assert kept <= set(native.native_ops().names)

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # torch's kernels change
    tuning.kernel_choice.cache_clear()
    assert tuning.choice_path() != tmp_path / stored_name(first, tmp_path)
    tuning.kernel_choice()
    assert len(measured) == 2 and len(list(tmp_path.glob("choice-*.json"))) == 2

    monkeypatch.setattr(native, "sources_key", lambda: "kernels of another version")
    tuning.kernel_choice.cache_clear()
    tuning.kernel_choice()  # a choice between other kernels does not hold for these
    assert len(measured) == 3 and len(list(tmp_path.glob("choice-*.json"))) == 3


def stored_name(choice: KernelChoice, root) -> str:
    return next(root.glob("choice-*.json")).name


@needs_kernels
def test_a_stored_choice_of_another_version_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv(native.SWITCH, "auto")
    monkeypatch.setattr(native, "kernels_root", lambda: tmp_path)
    tuning.choice_path().write_text(json.dumps({"an_old_field": 1}))
    monkeypatch.setattr(tuning, "measure", lambda ops: KernelChoice(decode_attention=TORCH))
    assert tuning.kernel_choice().decode_attention == TORCH
    # one that did not choose every kind of work this version chooses
    older = {k: v for k, v in asdict(KernelChoice(layer_ops=TORCH)).items() if k != "layer_ops"}
    tuning.choice_path().write_text(json.dumps(older))
    tuning.kernel_choice.cache_clear()
    assert tuning.kernel_choice().decode_attention == TORCH  # measured again


@needs_kernels
def test_measuring_times_every_kind_of_work_here():
    choice = tuning.measure(native.native_ops())
    assert {"decode_attention", "layer_ops"} <= set(choice.timings)
    for kind in ("prefill_attention", "decode_attention", "layer_ops"):
        picked = getattr(choice, kind)
        assert picked in (NATIVE, TORCH)
        if kind in choice.timings:
            assert picked == tuning._faster(choice.timings[kind])
    if native.has_linear_kernel(native.native_ops()):
        assert {f"decode_linear_{rows}" for rows in tuning.ROWS} <= set(choice.timings)
        assert choice.decode_linear_native_rows in (0, *tuning.ROWS[:-1], ALL_ROWS)
    if cpu.onednn_bf16():
        pair = choice.timings["prefill_linear"]
        faster = tuning.FLOAT32 if pair["float32"] < tuning.MARGIN * pair["bfloat16"] else None
        assert choice.prefill_linear == (faster or tuning.BFLOAT16)


def test_the_engine_upcasts_prefill_products_where_that_was_measured_faster(monkeypatch):
    from speedkv.core.engine import Engine

    from conftest import tiny_model

    for chosen in (tuning.FLOAT32, tuning.BFLOAT16):
        choice = KernelChoice(prefill_linear=chosen)
        monkeypatch.setattr(tuning, "kernel_choice", lambda choice=choice: choice)
        engine = Engine(tiny_model("llama"))
        assert engine.backbone.kernels.float32_products == (chosen == tuning.FLOAT32)


@pytest.mark.parametrize("hidden", ["prefill_attention", "decode_attention", "layer_ops"])
def test_the_engine_follows_a_partial_choice_with_the_reference_tokens(monkeypatch, hidden):
    from speedkv.core.engine import Engine

    from conftest import random_prompt, tiny_model
    from helpers import check_equals_dense, check_equals_hf_generate

    choice = KernelChoice(**{hidden: TORCH})
    monkeypatch.setattr(tuning, "kernel_choice", lambda: choice)
    engine = Engine(tiny_model("llama"), chunk_size=16)
    kept = engine.backbone.native_ops
    assert kept is None or not choice.hidden_operators() & set(kept.names)
    ids = random_prompt(40)
    check_equals_hf_generate(engine, ids, ["full"], steps=6)
    check_equals_dense(engine, ids, "speed:lcut=2,anchors=bos,deep=1", steps=6, atol=1e-4)


def test_doctor_names_the_machine_and_the_choice():
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "cpu:" in result.output and "kernel choice" in result.output
    assert "decode linear layers:" in result.output and "decode layers:" in result.output
    facts = json.loads(CliRunner().invoke(app, ["doctor", "--json"]).output)
    assert {"cpu", "isa", "cores", "torch", "onednn", "kernels"} <= set(facts)


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_the_choice_says_where_bfloat16_layers_cannot_use_onednn(monkeypatch, onednn_bf16):
    """On an AVX2-only x86 CPU oneDNN takes no bfloat16 weights: where the choice names oneDNN
    for the linear layers, doctor says bfloat16 ones run on torch's kernels there."""
    monkeypatch.setattr(tuning, "onednn_bf16", lambda: onednn_bf16)
    (linear,) = [line for line in KernelChoice.torch_only().lines() if "decode linear" in line]
    assert linear.startswith("decode linear layers: oneDNN for every batch")
    assert ("this CPU's oneDNN takes none" in linear) == (not onednn_bf16)
    # where speedkv's kernel takes every batch, oneDNN is not named, nor what it cannot take
    (linear,) = [line for line in KernelChoice().lines() if "decode linear" in line]
    assert linear == "decode linear layers: native for every batch"
    (prefill,) = [line for line in KernelChoice().lines() if "prefill linear" in line]
    assert ("float32 products" in prefill) == (not onednn_bf16)


def test_the_choice_says_whether_decode_layers_run_in_one_call():
    """One native call a layer needs every decode kind native and the layer's kernel built."""
    assert "decode layers: in parts" in KernelChoice.torch_only().lines()
    assert "decode layers: in parts" in KernelChoice(layer_ops=TORCH).lines()
    ops = native.native_ops()
    built = ops is not None and hasattr(ops, "decode_layer")
    one_call = "decode layers: one native call each" in KernelChoice().lines()
    assert one_call == built


def test_a_candidate_that_fails_here_loses():
    """torch's bfloat16 attention raises on an AMX CPU whose ATen is kept to AVX2: the tuner
    must choose the other candidate, not stop."""

    def fails():
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

    timings = tuning._race({NATIVE: lambda: None, TORCH: fails}, rounds=3)
    assert timings[TORCH] == float("inf") and timings[NATIVE] < float("inf")
    assert tuning._faster(timings) == NATIVE


def test_tiles_take_larger_decode_batches_only_where_chosen_and_the_native_layout_is_used():
    tiles = KernelChoice(decode_linear_native_rows=8, decode_linear_batches=tuning.TILES)
    assert tiles.tiles_for_batches
    assert (
        "native for batches of up to 8 rows, AMX tiles on the same copy above" in tiles.lines()[3]
    )
    assert "tile_linear" not in tiles.hidden_operators()
    for other in (
        KernelChoice(decode_linear_native_rows=8),  # oneDNN above
        KernelChoice(decode_linear_batches=tuning.TILES),  # the one-row kernel for every batch
        KernelChoice.torch_only(),  # no packed copy of speedkv's layout at all
    ):
        assert not other.tiles_for_batches
    assert "tile_linear" in KernelChoice.torch_only().hidden_operators()


def test_auto_dtype_is_bfloat16_where_the_cpu_or_the_native_decode_kernel_takes_it(monkeypatch):
    """`--dtype auto` on a CPU: bfloat16 with AMX or AVX512-BF16, and with AVX2 and FMA where
    speedkv's decode kernel can be built (a compiler, native kernels not switched off); on
    torch's kernels alone bfloat16 decodes slower than float32 there, so float32."""
    from speedkv.hf import loading

    device = torch.device("cpu")
    monkeypatch.delenv(native.SWITCH, raising=False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: "/usr/bin/c++")
    for flags, expected in [
        ({"avx2", "fma"}, torch.bfloat16),
        ({"avx2", "fma", "avx512_bf16"}, torch.bfloat16),
        ({"amx_bf16"}, torch.bfloat16),
        ({"avx2"}, torch.float32),  # no FMA: the kernel's AVX2 form is not built
        ({"neon", "asimd"}, torch.float32),
    ]:
        monkeypatch.setattr(cpu, "_cpu_flags", lambda flags=flags: flags)
        assert loading.resolve_dtype("auto", device) == expected, flags
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv(native.SWITCH, "torch")
    assert loading.resolve_dtype("auto", device) == torch.float32
    monkeypatch.delenv(native.SWITCH)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)  # no compiler
    assert loading.resolve_dtype("auto", device) == torch.float32
    assert loading.resolve_dtype("bfloat16", device) == torch.bfloat16  # asked for: as asked


def test_auto_dtype_off_speedkvs_kernels_follows_the_cpus_bf16_instructions(monkeypatch):
    """`--backend vllm --dtype auto` and choose-lcut's sweep (transformers' own layers): their
    products do not run on speedkv's AVX2 decode kernel, and in bfloat16 they are a plain loop
    without AMX or AVX512-BF16, so there they get float32, while speedkv's own engine loads
    bfloat16 on the same CPU."""
    from speedkv.hf import loading
    from speedkv.hf.build import ModelOptions

    def dtype_without_native_decode(dtype: str) -> str:  # what vLLM and choose-lcut load
        return loading.dtype_name(ModelOptions(dtype=dtype, native_decode=False).torch_dtype())

    monkeypatch.delenv(native.SWITCH, raising=False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: False)
    for flags, expected in [
        ({"avx2", "fma"}, "float32"),
        ({"avx2", "fma", "avx512_bf16"}, "bfloat16"),
        ({"amx_bf16"}, "bfloat16"),
    ]:
        monkeypatch.setattr(cpu, "_cpu_flags", lambda flags=flags: flags)
        assert dtype_without_native_decode("auto") == expected, flags
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma"})
    assert loading.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16  # speedkv's own
    assert dtype_without_native_decode("bfloat16") == "bfloat16"  # asked for: as asked
    assert dtype_without_native_decode("fp32") == "float32"


def test_every_kernel_is_one_row_of_the_catalogue():
    """A kernel is its source in csrc/ and one row of kernels/catalogue.py, which the build,
    the tuner and the one-call decode layer read."""
    from speedkv.kernels import catalogue

    assert sorted(p.stem for p in native.CSRC.glob("*.cpp")) == sorted(native.KERNELS)
    assert list(native.KERNELS) == [kernel.name for kernel in catalogue.CATALOGUE]
    for kernel in catalogue.CATALOGUE:
        assert (native.CSRC / kernel.source).is_file()
        assert set(kernel.kinds) <= set(catalogue.KINDS), kernel.name
    assert set(catalogue.KINDS) <= {f.name for f in fields(KernelChoice)}
    registered = {op for kernel in catalogue.CATALOGUE for op in kernel.operators}
    assert set(catalogue.ONE_CALL_OPERATORS) <= registered
