"""Which kernel runs each kind of work on this machine, chosen by measuring the candidates.

speedkv's native kernels were written on one CPU; on another, torch's own kernels (oneDNN with
AMX on recent Intel Xeons) may be faster at some of the work. The first time the kernels are
built on a machine, and whenever `speedkv tune` runs, each kind of work that has several
candidates is timed on representative bfloat16 shapes:

- `prefill_attention`: speedkv's flash-style kernel or torch's scaled_dot_product_attention,
- `decode_attention`: speedkv's batch kernel or torch's kernels sequence by sequence,
- `layer_ops`: speedkv's fused norms / rotary / SiLU or torch's separate operations,
- `decode_linear`: speedkv's packed one-row kernel or oneDNN on the plain weight, at 1, 4, 8
  and 32 rows: batches up to the largest row count the native kernel won at use it. Larger batches
  go to oneDNN, or where the CPU has AMX and it wins at 32 rows, to speedkv's tile kernel on
  the same packed copy. Where the native kernel is not used at all, the prepacked copy is
  oneDNN's own layout.
- `prefill_linear`: a prefill chunk's bfloat16 products as they are, or in float32 rounded
  once (where oneDNN runs bfloat16 without AMX, its float32 kernels can be faster).

Candidates are timed in alternating rounds (the fastest round of each: on a shared CPU a round
can only be slowed), and torch's kernel replaces a native one only when it is more than 10 %
faster. On a quiet machine the rounds run as the engine will: on its threads, by the wall
clock. Where other processes keep the cores busy, a round on several threads loses whole time
slices (about 12 ms) whenever one thread waits at a barrier for another that was descheduled,
and that can fall on every round of one candidate: there the rounds run on one thread and count
that thread's CPU time, which other processes do not inflate (every candidate splits its work
over threads by rows, heads or blocks, so one thread ranks them as several do). The choice is
stored beside the built kernels (in the directory the compiler's target names, one file per
thread count and setting of the variables that change torch's kernels) and used by every later
process. `SPEEDKV_KERNELS=native` uses
every native kernel that builds, `torch` none, `auto` (the default) the measured choice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from speedkv.kernels import linear, native
from speedkv.kernels.catalogue import KINDS, operators_of
from speedkv.kernels.config import ALL_ROWS, KernelConfig
from speedkv.kernels.cpu import SWITCH, onednn_bf16
from speedkv.kernels.layer_ops import rms_norm
from speedkv.locks import exclusive
from speedkv.log import log

NATIVE, TORCH = "native", "torch"
TILES = "tiles"  # decode batches above the native rows: the AMX tile kernel on the packed copy
ROWS = (1, 4, 8, 32)  # decode batch sizes the linear layers are timed at
TUNER_VERSION = 2  # raised when what is measured changes, so stored choices are measured again
BFLOAT16, FLOAT32 = "bfloat16", "float32"  # the candidates of prefill_linear


@dataclass
class KernelChoice:
    """The kernel chosen for each kind of work, and the timings that chose it (ms)."""

    prefill_attention: str = NATIVE
    decode_attention: str = NATIVE
    layer_ops: str = NATIVE
    decode_linear: str = NATIVE  # torch: the prepacked copy is oneDNN's layout, not speedkv's
    # decode batches of up to this many rows use the prepacked weights, larger ones the plain
    # weights through oneDNN
    decode_linear_native_rows: int = ALL_ROWS
    decode_linear_batches: str = TORCH  # larger batches: oneDNN on the plain weight, or TILES
    prefill_linear: str = BFLOAT16  # or FLOAT32: products upcast, rounded once
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    clock: str = ""  # how the timings were taken (see `race_clock`)

    @classmethod
    def torch_only(cls) -> KernelChoice:
        """No native kernel: every batch decodes on oneDNN's prepacked copy, as without them."""
        return cls(TORCH, TORCH, TORCH, TORCH)

    def hidden_operators(self) -> set[str]:
        """Native operators the engine should not use here."""
        torch_kinds = [kind for kind in KINDS if getattr(self, kind) == TORCH]
        return {op for kind in torch_kinds for op in operators_of(kind)}

    @property
    def tiles_for_batches(self) -> bool:
        """Whether decode batches above the native rows run on the AMX tile kernel."""
        return (
            self.decode_linear == NATIVE
            and 0 < self.decode_linear_native_rows < ALL_ROWS
            and self.decode_linear_batches == TILES
        )

    def lines(self) -> list[str]:
        rows = self.decode_linear_native_rows
        linear = (
            "oneDNN for every batch" if self.decode_linear == TORCH or rows == 0
            else "native for every batch" if rows >= ALL_ROWS
            else f"native for batches of up to {rows} rows, "
            + ("AMX tiles on the same copy" if self.tiles_for_batches else "oneDNN") + " above"
        )  # fmt: skip
        if not onednn_bf16() and "oneDNN" in linear:  # bfloat16 layers cannot use it
            linear += " (bfloat16 weights on torch's kernels: this CPU's oneDNN takes none)"
        prefill = self.prefill_attention
        ops = native.native_ops()
        if prefill == NATIVE and ops is not None and hasattr(ops, "prefill_attention_unit"):
            prefill += f" (products on {ops.prefill_attention_unit()})"
        one_call = hasattr(ops, "decode_layer") and "decode_layer" not in self.hidden_operators()
        products = f"{self.prefill_linear} products"
        if not onednn_bf16():
            products = "bfloat16 weights in float32 products (this CPU's oneDNN takes none)"
        return [
            f"prefill attention: {prefill}",
            f"decode attention: {self.decode_attention}",
            f"layer small operations: {self.layer_ops}",
            f"decode linear layers: {linear}",
            "decode layers: " + ("one native call each" if one_call else "in parts"),
            f"prefill linear layers: {products}",
            *([f"timed on {self.clock}"] if self.clock else []),
        ]


def mode() -> str:
    """SPEEDKV_KERNELS: auto (the measured choice), native or torch."""
    chosen = os.environ.get(SWITCH, "auto").lower()
    return chosen if chosen in ("auto", NATIVE, TORCH) else "auto"


@functools.cache
def kernel_choice() -> KernelChoice:
    """The choice in force in this process (see the module's docstring)."""
    ops = native.native_ops()
    if ops is None or mode() == TORCH:
        return KernelChoice.torch_only()
    if mode() == NATIVE:
        return KernelChoice()
    path = choice_path()
    stored = _stored(path)
    if stored is not None:
        return stored
    with exclusive(path.with_suffix(".lock"), 600) as held:
        stored = _stored(path) if held else None  # another process may have measured
        if stored is not None:
            return stored
        choice = measure(ops)
        if held:
            _store(path, choice)
    return choice


def _store(path: Path, choice: KernelChoice) -> None:
    path.write_text(json.dumps(asdict(choice), indent=2))


def _stored(path: Path) -> KernelChoice | None:
    """The choice stored at `path`; None if there is none or another version wrote it (one
    that chose between other kinds of work)."""
    try:
        stored = json.loads(path.read_text())
        if set(stored) != {f.name for f in fields(KernelChoice)}:
            return None
        return KernelChoice(**stored)
    except (OSError, TypeError, ValueError):
        return None


@functools.cache
def engine_kernels() -> native.NativeKernels | None:
    """The native operators the engine uses here: those built, less the ones whose kind of
    work torch's kernels do faster on this machine."""
    ops = native.native_ops()
    if ops is None:
        return None
    hidden = kernel_choice().hidden_operators()
    kept = {name: getattr(ops, name) for name in ops.names if name not in hidden}
    return native.NativeKernels(kept) if kept else None


def engine_config() -> KernelConfig:
    """What an engine on a CPU runs on here: the native operators it uses and how the
    measured choice splits the products between kernels (built now if need be, not in the
    first request's decode)."""
    choice, ops = kernel_choice(), engine_kernels()
    rows = choice.decode_linear_native_rows
    # a stored choice outlives a kernel whose library was since lost: use what loaded
    tiles = choice.tiles_for_batches and hasattr(ops, "tile_linear")
    return KernelConfig(ops=ops, native_linear_rows=rows, tiles_above=rows if tiles else None,
                        float32_products=choice.prefill_linear == FLOAT32)  # fmt: skip


# settings that change torch's own kernels, so a choice measured under others does not hold
TORCH_KERNEL_SETTINGS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def choice_path() -> Path:
    """Where this machine's choice is stored: beside its kernels, one file per thread count
    (as set, by OMP_NUM_THREADS or --threads), setting of the variables that change torch's
    kernels, version of the kernels' sources and of this tuner (a new version is measured
    again)."""
    settings = ",".join(
        [f"threads={torch.get_num_threads()}",
         *(f"{k}={os.environ.get(k, '')}" for k in TORCH_KERNEL_SETTINGS),
         f"sources={native.sources_key()}", f"tuner={TUNER_VERSION}"]
    )  # fmt: skip
    digest = hashlib.sha256(settings.encode()).hexdigest()[:8]
    return native.kernels_root() / f"choice-{digest}.json"


def tune() -> KernelChoice:
    """Measure again and store the choice (`speedkv tune`)."""
    ops = native.native_ops()
    if ops is None:
        return KernelChoice.torch_only()
    choice = measure(ops)
    _store(choice_path(), choice)
    kernel_choice.cache_clear()
    engine_kernels.cache_clear()
    return choice


def measure(ops) -> KernelChoice:
    """Time every candidate of every kind of work on this machine (about ten seconds)."""
    threads, clock = race_clock()
    log(f"timing speedkv's kernels against torch's on this machine (once; {clock})")
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _measure(ops, KernelChoice(clock=clock))
    finally:
        torch.set_num_threads(saved_threads)


def race_clock() -> tuple[int, str]:
    """The threads the candidates are timed on, and how that is said: the engine's, by the
    wall clock, on a quiet machine; one thread, by its CPU time, where the 1-minute load
    average says other processes want more of the cores than the engine's threads leave."""
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads > 1 and load > max((cores or 1) - threads, 0) + 0.5:
        return 1, f"1 thread by its CPU time (load {load:.1f} on {cores} cores)"
    return threads, f"{threads} thread{'s' * (threads > 1)} by the wall clock"


def _measure(ops, choice: KernelChoice) -> KernelChoice:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    timings = choice.timings

    if native.has_prefill_kernel(ops):  # 8 query / 2 KV heads of 64 over 1024 tokens
        q = torch.randn(8, 1024, 64, dtype=bf16)
        k, v = torch.randn(2, 1024, 64, dtype=bf16), torch.randn(2, 1024, 64, dtype=bf16)
        timings["prefill_attention"] = _race({
            NATIVE: lambda: ops.causal_attention(q, k, v, 0.125),
            TORCH: lambda: F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, enable_gqa=True),
        })  # fmt: skip
        choice.prefill_attention = _faster(timings["prefill_attention"])
    else:
        choice.prefill_attention = TORCH

    if hasattr(ops, "decode_attention"):  # 8 sequences of 2048 cached tokens
        q = torch.randn(8, 8, 64, dtype=bf16)
        keys = [torch.randn(2, 2048, 64, dtype=bf16) for _ in range(8)]
        packed = q.view(8, 2, 4, 64)  # a KV head's query heads as one block, as torch runs it
        timings["decode_attention"] = _race({
            NATIVE: lambda: ops.decode_attention(q, keys, keys, 0.125),
            TORCH: lambda: [F.scaled_dot_product_attention(
                packed[b][None], keys[b][None], keys[b][None]) for b in range(8)],
        })  # fmt: skip
        choice.decode_attention = _faster(timings["decode_attention"])
    else:
        choice.decode_attention = TORCH

    if hasattr(ops, "rms_norm"):  # a decode step's and a prefill chunk's norms and SiLU
        weight = torch.randn(2048, dtype=bf16)

        def small_ops(rows: int, use) -> Callable[[], object]:
            h, up = torch.randn(rows, 2048, dtype=bf16), torch.randn(rows, 4096, dtype=bf16)
            if use is None:
                return lambda: (rms_norm(h, weight, 1e-5),
                                F.silu(up[:, :2048]) * up[:, 2048:])  # fmt: skip
            return lambda: (use.rms_norm(h, weight, 1e-5), use.silu_mul(up))

        decode, chunk = (
            _race({NATIVE: small_ops(8, ops), TORCH: small_ops(8, None)}),
            _race({NATIVE: small_ops(512, ops), TORCH: small_ops(512, None)}),
        )
        timings["layer_ops"] = {name: decode[name] + chunk[name] for name in decode}
        choice.layer_ops = _faster(timings["layer_ops"])
    else:
        choice.layer_ops = TORCH

    if native.has_linear_kernel(ops):  # a 2048 x 2048 bfloat16 weight
        plain = (torch.randn(2048, 2048, dtype=bf16), None)
        packed = linear.prepacked(plain, ops)
        wins = 0
        for rows in ROWS:
            x = torch.randn(rows, 2048, dtype=bf16)
            pair = _race({NATIVE: lambda x=x: linear.apply_linear(x, packed),
                          TORCH: lambda x=x: linear.apply_linear(x, plain)})  # fmt: skip
            timings[f"decode_linear_{rows}"] = pair
            if _faster(pair) == NATIVE and wins == rows_before(rows):
                wins = rows
        choice.decode_linear_native_rows = wins if wins < ROWS[-1] else ALL_ROWS
        choice.decode_linear = NATIVE if wins else TORCH
        if hasattr(ops, "tile_linear") and choice.decode_linear == NATIVE and wins < ROWS[-1]:
            x = torch.randn(ROWS[-1], 2048, dtype=bf16)  # batches above: tiles on the same copy
            pair = _race({TILES: lambda: ops.tile_linear(x, packed[0], None),
                          TORCH: lambda: linear.apply_linear(x, plain)})  # fmt: skip
            timings[f"decode_linear_{ROWS[-1]}_rows_on_tiles"] = pair
            choice.decode_linear_batches = _faster(pair, kept=TILES, challenger=TORCH)
    else:
        choice.decode_linear = TORCH

    if onednn_bf16():  # a prefill chunk's rows (elsewhere they are always upcast)
        x, w = torch.randn(512, 2048, dtype=bf16), torch.randn(2048, 2048, dtype=bf16)
        timings["prefill_linear"] = pair = _race({
            BFLOAT16: lambda: F.linear(x, w),
            FLOAT32: lambda: linear.linear_in_float32(x, w, None),
        })  # fmt: skip
        choice.prefill_linear = _faster(pair, kept=BFLOAT16, challenger=FLOAT32)
    return choice


def rows_before(rows: int) -> int:
    """The row count timed before `rows` (0 before the first)."""
    index = ROWS.index(rows)
    return ROWS[index - 1] if index else 0


# a challenger must beat the kept candidate by this much to replace it: torch's kernel a native
# one (the native kernels are fused, and save memory traffic around them that an isolated
# timing does not see), float32 prefill products bfloat16 ones (the upcast copies are not free)
MARGIN = 0.9


def _faster(pair: dict[str, float], kept: str = NATIVE, challenger: str = TORCH) -> str:
    """The candidate to use: `challenger` only where it beats `kept` by the margin."""
    return challenger if pair[challenger] < MARGIN * pair[kept] else kept


def _race(candidates: dict[str, Callable[[], object]], rounds: int = 9) -> dict[str, float]:
    """The fastest of each candidate's rounds (ms), timed in alternating rounds after a
    warm-up call each. Noise only adds time, and on a CPU shared with other busy processes a
    round can lose whole scheduler time slices (about 12 ms here, more than most candidates
    take), which can fall on one candidate's rounds more than the other's. A candidate that fails
    here loses (infinite time): torch's bfloat16 attention raises on an AMX CPU whose ATen is
    kept to AVX2 (`ATEN_CPU_CAPABILITY=avx2`: "pack_vnni2 is only supported when avx512 is
    supported")."""
    # one thread's CPU time where the race runs on one thread (see `race_clock`)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in candidates}
    failed = {}
    for name, run in candidates.items():
        try:
            run()
        except RuntimeError as error:
            failed[name] = float("inf")
            log(f"{name} kernel failed here, so it is not chosen: {str(error).splitlines()[0]}")
    candidates = {name: run for name, run in candidates.items() if name not in failed}
    for _ in range(rounds):
        for name, run in candidates.items():
            start = clock()
            run()
            times[name].append(clock() - start)
    measured = {name: min(spent) * 1e3 for name, spent in times.items() if spent}
    return measured | failed
