"""speedkv against engines a user could pick instead, in one run on the same prompts: time to
first token and per token at batch 1, and decode throughput of batches.

    make bench-peers
    # or: .venv/bin/python benchmarks/peers.py --out benchmarks/peers

Engines: speedkv's own (`full` and SPEED-22; decode on prepacked weights, the CLI's default,
and on the plain ones), the model's own
transformers `generate`, vLLM's CPU build in its default (torch.compile) and eager modes --
run by benchmarks/vllm_peer.py in vLLM's own environment (`make vllm-venv`), since vLLM pins
an older transformers -- llama.cpp when its Python binding and a GGUF are given, and OpenVINO
GenAI's LLMPipeline (benchmarks/openvino_peer.py, `make openvino-venv`: bfloat16 weights,
compute and KV cache, prefix caching off) when its environment is given, once as it is and
once with its own KV-cache eviction at SPEED-22's share of the KV cache. Every engine gets the
same token ids (chat prompts of exact lengths), greedy decoding, EOS ignored, 2 threads.
speedkv runs first, then each peer in its own process: one invocation, the CPU otherwise idle,
so the ratios are same-run figures.

Batch-1 TTFT counts from the call to the first token; TPOT is the mean time per later token.
Batch throughput: the wall time of generating 1 token for B prompts (t1: the prefills) and N
tokens (tN), for each engine the same way; decode tokens/s = B (N - 1) / (tN - t1), from the
medians of t1 and tN over the repeats. The limit rows are the fastest this machine could run
each speedkv method (its measured matmul rate, read bandwidth and one-row product rate, taken
first in the same run); every peer runs `full`, so `full`'s limit row is theirs too.

Writes OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv._openmp import peer_environment
from speedkv.bench.machine import machine_facts
from speedkv.bench.roofline import MachineLimits, measure_limits
from speedkv.prompts.builders import exact_chat_prompt

HERE = Path(__file__).resolve().parent
SPEED = "speed:lcut=22,anchors=bos,deep=1"
LIMIT = "limit of this machine"


def speedkv_batch1(engine: Engine, prompts: dict[int, list[int]], args) -> list[dict]:
    """TTFT/TPOT of speedkv (each mode and method) and of transformers' generate."""
    model = engine.model
    rows = []
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for mode in ("prepacked", "plain"):
        model.backbone.prepack_decode(mode == "prepacked")
        for method in ("full", SPEED):
            policy = engine.policy(method)
            # warm-up on a short prompt
            engine.generate([Request(prompts[min(prompts)][:256], policy, sampling)])
            for n, ids in prompts.items():
                for repeat in range(args.repeats):
                    g = engine.generate([Request(ids, policy, sampling)])[0]
                    rows.append(
                        row(f"speedkv {mode}", method, n, repeat, g.ttft_s, g.tpot_s, g.output_ids)
                        | {
                            "kv_bytes": g.kv_bytes,
                            "kv_bytes_final": g.kv_bytes_final,
                            "flops_prefill": g.flops_prefill,
                        }  # fmt: skip
                    )
                    progress(rows[-1])
    model.backbone.prepack_decode(False)
    for n, ids in prompts.items():
        for repeat in range(args.repeats):
            out = model.backbone.hf_generate_timed(torch.tensor([ids]), args.new_tokens)
            rows.append(
                row(
                    "transformers generate",
                    "full",
                    n,
                    repeat,
                    out["ttft_s"],
                    out["tpot_s"],
                    out["output_ids"],
                )
            )
            progress(rows[-1])
    return rows


def speedkv_batches(engine: Engine, batches: dict[int, list[list[int]]], args) -> list[dict]:
    """Batch throughput of speedkv `full` on prepacked weights (the CLI's default)."""
    rows = []
    engine.model.backbone.prepack_decode(True)
    policy = engine.policy("full")
    for size, prompts in batches.items():
        for repeat in range(args.repeats):
            t1 = run_batch(engine, policy, prompts, 1)
            tn = run_batch(engine, policy, prompts, args.batch_new_tokens)
            rows.append(batch_row("speedkv prepacked", size, repeat, t1, tn, args))
            progress(rows[-1])
    engine.model.backbone.prepack_decode(False)
    return rows


def run_batch(engine: Engine, policy, prompts: list[list[int]], new_tokens: int) -> float:
    """Wall time of generating `new_tokens` for every prompt, decoding as one batch."""
    sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([Request(ids, policy, sampling) for ids in prompts])
    return time.perf_counter() - start


def jobs_for(prompts, batches, args) -> list[dict]:
    """The prompts as the peer scripts take them."""
    return [
        {"name": f"b1-{n}", "prompts": [ids], "max_new_tokens": args.new_tokens}
        for n, ids in prompts.items()
    ] + [
        {"name": f"batch-{size}", "prompts": ps, "max_new_tokens": args.batch_new_tokens}
        for size, ps in batches.items()
    ]


def run_peer(command: list[str], jobs: list[dict]) -> dict:
    """Run a peer script over `jobs` in its own process; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        requests, out = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        requests.write_text(json.dumps(jobs))
        command = [*command, "--requests", str(requests), "--out", str(out)]
        print(f"[peers] {' '.join(command)}", file=sys.stderr, flush=True)
        # the peer on its own OpenMP defaults, not the spin count speedkv chose for itself
        subprocess.run(command, check=True, env=peer_environment())
        return json.loads(out.read_text())


def peer_rows(engine: str, result: dict, args, method: str = "full") -> list[dict]:
    """A peer's per-job medians as rows of ours."""
    rows = []
    for job in result["jobs"]:
        kind, size = job["name"].split("-")
        if kind == "b1":
            rows.append(
                row(
                    engine,
                    method,
                    int(size),
                    "median",
                    job["ttft_s"],
                    job["tpot_s"],
                    job["output_ids"][0],
                )
            )
        else:
            rows.append(
                batch_row(engine, int(size), "median", job["wall_1_s"], job["wall_s"], args)
            )
        progress(rows[-1])
    return rows


def peer_command(python: str, script: str, args, *options: str) -> list[str]:
    """A peer script's command line: its own options, then the threads and repeats all share."""
    return [python, str(HERE / script), *options, "--threads", str(args.threads),
            "--repeats", str(args.repeats)]  # fmt: skip


def vllm_rows(mode: str, model_dir: str, jobs: list[dict], args) -> list[dict]:
    command = peer_command(args.vllm_python, "vllm_peer.py", args, "--model", model_dir,
                           "--dtype", args.dtype, "--mode", mode)  # fmt: skip
    result = run_peer(command, jobs)
    return peer_rows(f"vLLM-CPU {result.get('vllm_version', '')} {mode}", result, args)


def llamacpp_rows(jobs: list[dict], args) -> list[dict]:
    command = peer_command(args.llamacpp_python, "llamacpp_peer.py", args, "--gguf", args.gguf)
    result = run_peer(command, [j for j in jobs if len(j["prompts"]) == 1])
    return peer_rows(f"llama.cpp {result.get('version', '')} bf16 GGUF", result, args)


def openvino_rows(jobs: list[dict], args) -> list[dict]:
    """OpenVINO GenAI as it is, then with its KV-cache eviction at --openvino-eviction."""
    command = peer_command(args.openvino_python, "openvino_peer.py", args,
                           "--model", args.openvino_model)  # fmt: skip
    result = run_peer(command, jobs)
    version = ".".join(result["version"].split("-")[0].split(".")[:3])
    engine = f"OpenVINO GenAI {version} bf16"
    rows = with_settings(peer_rows(engine, result, args), result)
    if args.openvino_eviction:
        fraction = f"{args.openvino_eviction:g}"
        result = run_peer([*command, "--kv-fraction", fraction], jobs)
        # its own method: the table's token check and ratios are for `full` rows only
        method = f"cache-eviction:kv={fraction}"
        rows += with_settings(peer_rows(f"{engine} + eviction", result, args, method), result)
    return rows


def with_settings(rows: list[dict], result: dict) -> list[dict]:
    """The peer's versions and read-back settings on each of its rows, kept in results.json."""
    settings = {key: value for key, value in result.items() if key != "jobs"}
    return [r | {"settings": settings} for r in rows]


def limit_rows(rows: list[dict], limits: MachineLimits, weight_bytes: int) -> list[dict]:
    """The fastest this machine could run each of speedkv's methods at each length: prefill
    FLOPs at the measured matmul rate, and a decode step's weight bytes at the measured
    matrix-vector rate plus its mean K/V read at the read bandwidth. Every peer runs `full`,
    so `full`'s limit is theirs too."""
    out = []
    for r in rows:
        if r["kind"] != "batch1" or r["engine"] != "speedkv prepacked" or r["repeat"] != 0:
            continue
        kv_read = (r["kv_bytes"] + r["kv_bytes_final"]) / 2
        ttft = limits.prefill_bound_s(r["flops_prefill"])
        tpot = limits.decode_bound_s(weight_bytes, kv_read)
        out.append(
            row(LIMIT, r["method"], r["length"], "bound", ttft, tpot, []) | {"kind": "limit"}
        )
    return out


def row(engine, method, n, repeat, ttft, tpot, output_ids) -> dict:
    return {
        "kind": "batch1",
        "engine": engine,
        "method": method,
        "length": n,
        "repeat": repeat,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "output_ids": list(output_ids),
    }


def batch_row(engine, size, repeat, t1, tn, args) -> dict:
    new = args.batch_new_tokens
    return {
        "kind": "batch",
        "engine": engine,
        "batch": size,
        "repeat": repeat,
        "t1_s": t1,
        "tn_s": tn,
        "new_tokens": new,
        "decode_tokens_per_s": size * (new - 1) / (tn - t1) if tn > t1 else None,
        "e2e_tokens_per_s": size * new / tn,
    }


def progress(r: dict) -> None:
    if r["kind"] == "batch1":
        text = f"{r['length']} tokens: TTFT {r['ttft_s']:.2f} s, TPOT {1000 * r['tpot_s']:.1f} ms"
    else:
        text = f"batch {r['batch']}: {r['decode_tokens_per_s'] or 0:.1f} decode tokens/s"
    method = f" {r['method']}" if r.get("method") not in (None, "full") else ""
    print(f"[peers] {r['engine']}{method}: {text}", file=sys.stderr, flush=True)


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def batch_rates(runs: list[dict]) -> tuple[float | None, float | None]:
    """Decode and end-to-end tokens/s from the median wall times of the repeats: a rate per
    repeat would divide by the difference of two noisy prefills."""
    t1, tn = median(runs, "t1_s"), median(runs, "tn_s")
    if t1 is None or tn is None:
        return None, None
    size, new = runs[0]["batch"], runs[0]["new_tokens"]
    return (size * (new - 1) / (tn - t1) if tn > t1 else None), size * new / tn


def tables(rows: list[dict], lengths: list[int], limits: dict | None = None) -> str:
    b1 = [r for r in rows if r["kind"] == "batch1"]
    keys = list(dict.fromkeys((r["engine"], r["method"]) for r in b1))
    reference = {
        r["length"]: r["output_ids"]
        for r in reversed(b1)
        if r["engine"] == "speedkv plain" and r["method"] == "full"
    }
    head = (
        "| engine | method |"
        + "".join(f" TTFT {n} s | TPOT {n} ms |" for n in lengths)
        + " same tokens as speedkv plain `full` |"
    )
    lines = [head, "|---|---|" + "---:|---:|" * len(lengths) + "---:|"]
    if limits:
        lines = [
            f"Limits measured in the same run: {limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s read, "
            f"{limits['matmul_flops_s'] / 1e12:.3f} TFLOP/s {limits['dtype']} matmul, "
            f"{(limits['gemv_bytes_s'] or 0) / 1e9:.1f} GB/s of weights in one-row products "
            f"({limits['decode_weight_bytes'] / 2**20:.0f} MiB a decode step).",
            "",
            *lines,
        ]
    for engine, method in keys:
        cells, same = [], []
        for n in lengths:
            mine = [r for r in b1 if (r["engine"], r["method"], r["length"]) == (engine, method, n)]
            ttft, tpot = median(mine, "ttft_s"), median(mine, "tpot_s")
            cells.append(f" {ttft:.2f} | {1000 * tpot:.1f} |" if mine else " – | – |")
            if mine and method == "full" and n in reference:
                same.append(mine[0]["output_ids"] == reference[n])
        agree = f"{sum(same)}/{len(same)}" if same else "–"
        lines.append(f"| {engine} | `{method}` |" + "".join(cells) + f" {agree} |")
    for method in dict.fromkeys(r["method"] for r in rows if r["kind"] == "limit"):
        cells = ""
        for n in lengths:
            bound = [
                r
                for r in rows
                if r["kind"] == "limit" and (r["method"], r["length"]) == (method, n)
            ]
            cells += (
                f" {bound[0]['ttft_s']:.2f} | {1000 * bound[0]['tpot_s']:.1f} |"
                if bound
                else " – | – |"
            )
        lines.append(f"| *{LIMIT}* | `{method}` |{cells} |")
    peer = next((e for e, _ in keys if e.startswith("vLLM") and e.endswith("default")), None)
    if peer is not None:
        lines += ["", f"Against {peer}, same run (medians of each; below 1 is faster):", ""]
        lines += [
            "| engine | method |" + "".join(f" TTFT {n} ratio | TPOT {n} ratio |" for n in lengths),
            "|---|---|" + "---:|---:|" * len(lengths),
        ]
        for engine, method in keys:
            if not engine.startswith("speedkv"):
                continue
            cells = ""
            for n in lengths:
                mine = [
                    r for r in b1 if (r["engine"], r["method"], r["length"]) == (engine, method, n)
                ]
                theirs = [r for r in b1 if (r["engine"], r["length"]) == (peer, n)]
                if not mine or not theirs:
                    cells += " – | – |"
                    continue
                ttft = median(mine, "ttft_s") / median(theirs, "ttft_s")
                tpot = median(mine, "tpot_s") / median(theirs, "tpot_s")
                cells += f" {ttft:.2f} | {tpot:.2f} |"
            lines.append(f"| {engine} | `{method}` |{cells}")
    batches = [r for r in rows if r["kind"] == "batch"]
    if batches:
        sizes = sorted({r["batch"] for r in batches})
        lines += [
            "",
            "| engine |"
            + "".join(f" decode tok/s, {b} seqs | end-to-end tok/s, {b} seqs |" for b in sizes),
            "|---|" + "---:|---:|" * len(sizes),
        ]
        for engine in dict.fromkeys(r["engine"] for r in batches):
            cells = ""
            for b in sizes:
                mine = [r for r in batches if r["engine"] == engine and r["batch"] == b]
                decode, e2e = batch_rates(mine)
                cells += f" {decode or 0:.1f} | {e2e or 0:.1f} |" if mine else " – | – |"
            lines.append(f"| {engine} |{cells}")
    return "\n".join(lines) + "\n"


def render(path: Path) -> None:
    """Print the tables of an earlier run's results.json again."""
    result = json.loads(path.read_text())
    lengths = sorted({r["length"] for r in result["rows"] if r["kind"] == "batch1"})
    print(tables(result["rows"], lengths, result.get("limits")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths",
        default="2048,8128",
        help="batch-1 prompt lengths (8128: the longest that leaves room for 64 new tokens in "
        "the model's 8192-token context, which vLLM enforces)",
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens at batch 1")
    parser.add_argument("--batches", default="8,32", help="batch sizes for throughput")
    parser.add_argument("--batch-length", type=int, default=2048, help="prompt length in batches")
    parser.add_argument(
        "--batch-new-tokens",
        type=int,
        default=128,
        help="new tokens per prompt in batches: enough that decoding, not the prefills' noise, "
        "sets the decode rate",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--vllm-python",
        default=".venv-vllm/bin/python",
        help="the Python of an environment with vllm-cpu (make vllm-venv); empty to skip vLLM",
    )
    parser.add_argument("--vllm-modes", default="default,eager")
    parser.add_argument(
        "--llamacpp-python",
        default="",
        help="the Python of an environment with llama-cpp-python "
        "(make llamacpp-venv); empty to skip llama.cpp",
    )
    parser.add_argument(
        "--gguf", default=".venv-llamacpp/smollm2-135m.bf16.gguf", help="the GGUF llama.cpp runs"
    )
    parser.add_argument(
        "--openvino-python",
        default="",
        help="the Python of an environment with openvino-genai "
        "(make openvino-venv); empty to skip OpenVINO",
    )
    parser.add_argument(
        "--openvino-model",
        default=".venv-openvino/smollm2-135m-ov",
        help="the OpenVINO IR folder OpenVINO GenAI runs (make openvino-venv writes it)",
    )
    parser.add_argument(
        "--openvino-eviction",
        type=float,
        default=0.733,
        help="KV budget of the OpenVINO row with GenAI's cache eviction, as a fraction of each "
        "prompt (default: SPEED-22's 22/30 of full's KV cache); 0 skips that row",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/peers"))
    parser.add_argument("--render", type=Path, help="only print the tables of this results.json")
    args = parser.parse_args()
    if args.render:
        return render(args.render)
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m", dtype=args.dtype, progress=False)
    engine = Engine(model, prepack=True)
    # measured first, on the CPU nothing else uses yet: the limit rows of the table
    limits = measure_limits(engine.device, model.dtype, prepacked=True)
    weight_bytes = model.backbone.decode_weight_bytes()
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: exact_chat_prompt(model.tokenizer, n) for n in lengths}
    batches = {
        int(b): [
            exact_chat_prompt(model.tokenizer, args.batch_length, start=40 * i)
            for i in range(int(b))
        ]
        for b in args.batches.split(",")
        if b
    }
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_facts(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "limits": asdict(limits) | {"decode_weight_bytes": weight_bytes},
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def keep(rows: list[dict]) -> None:
        """Write what is measured so far, so a peer that fails loses only itself."""
        result["rows"] += rows
        (args.out / "results.json").write_text(json.dumps(result, indent=1))

    speedkv = speedkv_batch1(engine, prompts, args) + speedkv_batches(engine, batches, args)
    keep(speedkv + limit_rows(speedkv, limits, weight_bytes))
    jobs = jobs_for(prompts, batches, args)
    if args.vllm_python:
        for mode in args.vllm_modes.split(","):
            keep(vllm_rows(mode, model.source, jobs, args))
    if args.llamacpp_python:
        keep(llamacpp_rows(jobs, args))
    if args.openvino_python:
        keep(openvino_rows(jobs, args))
    table = tables(result["rows"], lengths, result["limits"])
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
