#!/usr/bin/env python3
"""SPEED inside vLLM against stock vLLM, in one run: time to first token at 4K and 8K tokens.

Run it with the interpreter of the environment that has vLLM and speedkv (`make vllm-venv`):

    .venv-vllm/bin/python benchmarks/vllm_speed.py --out benchmarks/vllm

Each configuration runs in a fresh process (benchmarks/vllm_peer.py, both cores bound, bf16,
prefix caching off, every job repeated): stock vLLM eager, stock vLLM compiled (its default),
and vLLM with speedkv's SPEED plugin (eager: which rows go up is decided per step). Prompts are
chat prompts of exact lengths from the evaluation essays. The ratio that matters is SPEED over
stock eager (the same kernels, minus the upper layers' prompt rows); its layer limit is lcut/L.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    from speedkv.hf.loading import load_tokenizer, model_directory
    from speedkv.prompts.builders import exact_chat_prompt
    from speedkv.vllm.args import engine_args, model_shape

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="speed:lcut=22,anchors=bos")
    p.add_argument("--lengths", default="4096,8128", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compiled", action="store_true", help="skip stock vLLM compiled")
    p.add_argument("--out", type=Path, default=HERE / "vllm")
    args = p.parse_args()

    directory = model_directory(args.model, progress=False)
    shape = model_shape(directory)
    tokenizer = load_tokenizer(directory)
    lengths = [int(x) for x in args.lengths.split(",")]
    jobs = [
        {"name": f"ttft_{n}", "prompts": [exact_chat_prompt(tokenizer, n, start=101)],
         "max_new_tokens": args.new_tokens}
        for n in lengths
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "jobs.json").write_text(json.dumps(jobs))
    speed = engine_args(args.method, directory)
    configs = {"stock-eager": ("eager", None)}
    if not args.no_compiled:
        configs["stock-compiled"] = ("default", None)
    configs[args.method] = ("eager", speed.get("hf_overrides"))
    runs = {}
    for label, (mode, overrides) in configs.items():
        out = args.out / f"{label.replace(':', '_').replace(',', '_').replace('=', '')}.json"
        command = [
            sys.executable, str(HERE / "vllm_peer.py"), "--model", str(directory),
            "--dtype", "bfloat16", "--mode", mode, "--threads", str(args.threads),
            "--requests", str(args.out / "jobs.json"), "--out", str(out),
            "--repeats", str(args.repeats),
        ]  # fmt: skip
        if overrides:
            command += ["--hf-overrides", json.dumps(overrides)]
        print(f"== {label}", flush=True)
        subprocess.run(command, check=True)
        runs[label] = json.loads(out.read_text())
    rows = table(runs, args.method, shape.num_layers, speed, lengths)
    command = " ".join([".venv-vllm/bin/python benchmarks/vllm_speed.py", *sys.argv[1:]])
    record = {"model": args.model, "method": args.method, "lengths": lengths, "rows": rows,
              "command": command}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    (args.out / "README.md").write_text(render(record))
    print(render(record))
    return 0


def table(runs: dict, method: str, layers: int, speed: dict, lengths: list[int]) -> list[dict]:
    lcut = speed.get("hf_overrides", {}).get("speedkv_lcut", layers)
    stock = {j["name"]: j for j in runs["stock-eager"]["jobs"]}
    rows = []
    for label, run in runs.items():
        for job in run["jobs"]:
            n = max(job["prompt_lens"])
            base = stock[job["name"]]
            samples = job["samples"].get("ttft_metrics_s") or [job["ttft_s"]]
            rows.append({
                "config": label,
                "prompt_tokens": n,
                "ttft_s": job["ttft_s"],
                "ttft_samples_s": samples,
                "tpot_ms": None if job["tpot_s"] is None else 1e3 * job["tpot_s"],
                "ttft_vs_stock_eager": job["ttft_s"] / base["ttft_s"],
                "layer_limit": lcut / layers if label == method else 1.0,
                "upper_rows": run.get("upper_rows"),
                "same_tokens_as_stock": job["output_ids"] == base["output_ids"],
            })  # fmt: skip
    return rows


def render(record: dict) -> str:
    lines = [
        f"# SPEED in vLLM against stock vLLM ({record['model']}, bf16, 2 cores)",
        "",
        f"Measured by `{record['command']}` (one run; every configuration in a fresh process, "
        "median of the repeats). TTFT ratio is against stock vLLM eager in the same run; the "
        "layer limit is lcut / L.",
        "",
        "| configuration | prompt tokens | TTFT s | TPOT ms | TTFT / stock eager | layer limit |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        tpot = "-" if r["tpot_ms"] is None else f"{r['tpot_ms']:.1f}"
        lines.append(
            f"| {r['config']} | {r['prompt_tokens']} | {r['ttft_s']:.2f} | {tpot} | "
            f"{r['ttft_vs_stock_eager']:.3f} | {r['layer_limit']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
