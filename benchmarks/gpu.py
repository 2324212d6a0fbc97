#!/usr/bin/env python3
"""The GPU check, as one command: the engine's reference tests on the device, then `full`
against SPEED-24 (BoS anchor) at the paper's scale, Llama-3.1-8B's shape with random bfloat16
weights, beside transformers' own `generate` (SDPA), and where a step's time goes.

    python benchmarks/gpu.py --out OUT                         # on a GPU
    python benchmarks/gpu.py --tiny --device cpu --out OUT     # the same steps, tiny, anywhere

It runs from the source tree (nothing is installed; the engine's tests pass on transformers
5.17, the newest a lent GPU machine has) and writes, under OUT:

- `exactness.json`: the outcome of every reference test run with `--device` (the float32
  tests of tests/test_engine_equivalence.py, test_batch.py, test_prefix_reuse.py and
  test_methods_equivalence.py on tiny random Llama and Qwen2 models),
- `efficiency.json`: TTFT, TPOT (64 new tokens) and KV bytes per method and prompt length,
  batch 1, with same-run ratios against `full` and SPEED's layer limits; a length or method
  that runs out of memory or past the time budget is recorded as such,
- `profile.json`: torch's profiler over one prefill and one decode step per method: the
  operators that took the most device time, and how often the host waited for the device.

Time does not depend on the weights' values, so random weights measure what a trained model
would cost. `pytest` must be importable; `--wheels DIR` installs it from wheel files there
first when it is not (a lent GPU machine reaches no package index).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from speedkv.core.engine import Engine, Request  # noqa: E402
from speedkv.core.registry import make_policy  # noqa: E402
from speedkv.core.sampling import SamplingParams  # noqa: E402
from speedkv.hf.loading import LoadedModel  # noqa: E402

TEST_FILES = [
    "tests/test_engine_equivalence.py",
    "tests/test_batch.py",
    "tests/test_prefix_reuse.py",
    "tests/test_methods_equivalence.py",
]
# Llama-3.1-8B: 32 layers, 32 query and 8 KV heads of 128, hidden 4096, MLP 14336
PAPER_SHAPE = dict(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
)
TINY_SHAPE = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=10000.0,
)
PAPER_LENGTHS = [16384, 32768, 65536, 131072]
# profiler events where the host waits for the device
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item")
RATIOS = {
    "ttft_s": "ttft_ratio",
    "tpot_s": "tpot_ratio",
    "kv_bytes": "kv_ratio",
    "kv_bytes_final": "kv_final_ratio",
}
TINY_LENGTHS = [64, 128]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder the JSON results go to")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny shape and short prompts")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default by shape)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per run (64; tiny: 8)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds the efficiency part may take; later runs are skipped",
    )
    p.add_argument("--skip", default="", help="parts to skip: exactness, efficiency, profile")
    p.add_argument("--wheels", type=Path, help="wheel files to install pytest from")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    facts = machine(args.device)
    log(
        f"device: {facts['device_name']}; torch {facts['torch']}; "
        f"transformers {facts['transformers']}"
    )
    if "exactness" not in skip:
        write(args.out / "exactness.json", {**facts, **exactness(args)})
    if skip >= {"efficiency", "profile"}:
        return 0
    shape = TINY_SHAPE if args.tiny else PAPER_SHAPE
    lengths = (
        [int(n) for n in args.lengths.split(",")]
        if args.lengths
        else (TINY_LENGTHS if args.tiny else PAPER_LENGTHS)
    )
    new = args.new_tokens or (8 if args.tiny else 64)
    start = time.perf_counter()
    model = random_model(shape, max(lengths) + new, args.device)
    log(f"random model built in {time.perf_counter() - start:.1f} s")
    lcut = shape["num_hidden_layers"] * 3 // 4  # the paper's 24 of 32
    methods = ["full", f"speed:lcut={lcut},anchors=bos"]
    if "efficiency" not in skip:
        result = efficiency(model, methods, lengths, new, args.budget_s)
        write(args.out / "efficiency.json", {**facts, "shape": shape, **result})
    if "profile" not in skip:
        write(args.out / "profile.json", {**facts, **profile(model, methods, min(lengths))})
    return 0


# -- the reference tests on the device -----------------------------------------------------------
def exactness(args) -> dict:
    if importlib.util.find_spec("pytest") is None:
        if args.wheels is None:
            return {"error": "pytest is not installed here; give --wheels DIR"}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--find-links",
                str(args.wheels),
                "pytest",
            ],
            check=True,
        )
    report = args.out / "exactness.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        *TEST_FILES,
        "--device",
        args.device,
        "-m",
        "not real_model",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    outcomes = read_junit(report) if report.exists() else {}
    failed = {name: why for name, why in outcomes.items() if why not in ("passed", "skipped")}
    summary = {
        "passed": sum(why == "passed" for why in outcomes.values()),
        "skipped": sum(why == "skipped" for why in outcomes.values()),
        "failed": len(failed),
        "seconds": round(seconds, 1),
        "returncode": done.returncode,
        "failures": failed,
        "tail": done.stdout[-3000:] if done.returncode else "",
    }
    report.unlink(missing_ok=True)
    log(
        f"reference tests on {args.device}: {summary['passed']} passed, "
        f"{summary['failed']} failed, {summary['skipped']} skipped in {seconds:.0f} s"
    )
    return {"exactness": summary}


def read_junit(path: Path) -> dict[str, str]:
    """Each test case's outcome from pytest's JUnit XML: passed, skipped, or the failure."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = any(c.tag == "skipped" for c in case)
        outcomes[name] = (
            problem.get("message", "failed")[:500]
            if problem is not None
            else "skipped"
            if skipped
            else "passed"
        )
    return outcomes


# -- efficiency at the paper's shape ---------------------------------------------------------------
def random_model(shape: dict, positions: int, device: str) -> LoadedModel:
    """A Llama of `shape` with transformers' own random initialisation, built directly on the
    device in bfloat16 (an 8B model never exists in float32 or on the host)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    hf.to(device).eval().requires_grad_(False)  # buffers HF made on the host, if any
    return LoadedModel(name="random-llama", hf_model=hf, tokenizer=None, source="memory")


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Random ids after a BoS token (SPEED's anchor is position 0)."""
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()


def efficiency(
    model: LoadedModel, methods: list[str], lengths: list[int], new: int, budget_s: float
) -> dict:
    engine = Engine(model)
    vocab, layers = model.shape.vocab_size, model.shape.num_layers
    for method in [*methods, "hf"]:  # first-call costs (kernel selection, allocator) out
        run_one(engine, method, prompt(min(lengths), vocab, 0), 4)
    start, rows = time.perf_counter(), []
    for n in lengths:
        ids = prompt(n, vocab, n)
        for method in [*methods, "hf"]:
            if time.perf_counter() - start > budget_s:
                rows.append({"method": method, "length": n, "status": "skipped: time budget"})
                continue
            row = {"method": method, "length": n, **run_one(engine, method, ids, new)}
            rows.append(row)
            log(
                f"{method} @ {n}: {row['status']}, TTFT {row.get('ttft_s')}, "
                f"TPOT {row.get('tpot_s')}, KV {row.get('kv_bytes')}"
            )
    for row in rows:  # same-run ratios against full
        base = next(
            (
                r
                for r in rows
                if r["method"] == "full"
                and r["length"] == row["length"]
                and r.get("status") == "ok"
            ),
            None,
        )
        if base and row.get("status") == "ok":
            for key, ratio in RATIOS.items():
                if row[key] is not None:
                    row[ratio] = row[key] / base[key]
    speed = make_policy(methods[1], model.shape)
    anchors, deep = speed.rule.anchors, int(speed.rule.deep)
    limits = {
        n: {
            "ttft": speed.rule.lcut / layers,
            "kv": (speed.rule.lcut * n + (layers - speed.rule.lcut) * (anchors + deep))
            / (layers * n),
        }
        for n in lengths
    }
    return {
        "methods": [*methods, "hf"],
        "new_tokens": new,
        "runs": rows,
        "layer_limits": limits,
        "seconds": round(time.perf_counter() - start, 1),
    }


def run_one(engine: Engine, method: str, ids: list[int], new: int) -> dict:
    """One timed generation; out-of-memory is a result, not a crash."""
    device = engine.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        if method == "hf":  # its cache is read once, at the end
            tensor = torch.tensor([ids], device=device)
            r = engine.backbone.hf_generate_timed(tensor, new)
            row = {
                "ttft_s": r["ttft_s"],
                "tpot_s": r["tpot_s"],
                "kv_bytes": None,
                "kv_bytes_final": r["kv_bytes_final"],
            }
        else:
            policy = make_policy(method, engine.shape)
            sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
            g = engine.generate([Request(ids, policy, sampling)])[0]
            row = {
                "ttft_s": g.ttft_s,
                "tpot_s": g.tpot_s,
                "kv_bytes": g.kv_bytes,
                "kv_bytes_final": g.kv_bytes_final,
            }
    except torch.OutOfMemoryError:
        return {"status": "out of memory"}
    row["status"] = "ok"
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


# -- where a step's time goes -------------------------------------------------------------------
def profile(model: LoadedModel, methods: list[str], length: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = Engine(model)
    device = engine.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ids = prompt(length, model.shape.vocab_size, 7)
    result = {"length": length}
    for method in methods:
        policy = make_policy(method, model.shape)
        done = engine.prefill_ids(ids, policy, spare=4)  # warm
        parts = {}
        for part in ("prefill", "decode"):
            with torch_profile(activities=activities) as prof:
                if part == "prefill":
                    done = engine.prefill_ids(ids, policy, spare=4)
                else:
                    engine.decode_step([done.cache], [policy], [5], [length])
                if device.type == "cuda":
                    torch.cuda.synchronize()
            parts[part] = summarise(prof, device.type == "cuda")
        result[method] = parts
    return result


def summarise(prof, cuda: bool) -> dict:
    """The operators with the most device time (CPU time on a CPU) and the host's waits."""
    events = prof.key_averages()
    attr = "device_time_total" if cuda else "cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:15]
    waits = sum(e.count for e in events if any(w in e.key for w in WAITS))
    return {
        "top": [
            {"op": e.key, "ms": round(getattr(e, attr, 0.0) / 1e3, 3), "calls": e.count}
            for e in top
        ],
        "host_waits": waits,
        "launches": sum(e.count for e in events if "cudaLaunchKernel" in e.key),
    }


def machine(device: str) -> dict:
    import transformers

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {
        "device": device,
        "device_name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2))
    log(f"wrote {path}")


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
