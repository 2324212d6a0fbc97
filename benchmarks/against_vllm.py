"""speedkv's default engine against vLLM-CPU, turn about: ratios that a noisy CPU still gives.

    .venv/bin/python benchmarks/against_vllm.py --rounds 5 --out runs/against-vllm

On a shared CPU the speed of the same work can drift by 1.5-2x within minutes, so two engines
timed one after the other (benchmarks/peers.py) can differ by the drift alone. Here vLLM stays
loaded in its own process (`benchmarks/vllm_peer.py --serve`, in vLLM's environment: make
vllm-venv) and the engines take turns request by request (speedkv.bench.paired): at each
length, each round runs speedkv `full`, speedkv SPEED-22 (both on prepacked weights, the CLI's
default) and vLLM `full` (compiled, prefix caching off) once, in an order rotated from round to
round. A round gives its own ratios; the table shows their median and range over the rounds.
Same token ids for every engine, greedy, EOS ignored, the same thread count.

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
from pathlib import Path

import torch
from peers import SPEED, progress, row  # the script beside this one (its folder is on sys.path)

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv._openmp import peer_environment
from speedkv.bench.machine import machine_facts
from speedkv.bench.paired import paired_ratio, turn_about
from speedkv.prompts.builders import exact_chat_prompt
from speedkv.vllm.timing import READY, RESULT

HERE = Path(__file__).resolve().parent
SPEEDKV = "speedkv prepacked"


class ServedVllm:
    """vllm_peer.py --serve: one loaded vLLM engine answering one job at a time."""

    def __init__(self, python: str, model_dir: str, jobs: list[dict], args):
        self.tmp = tempfile.TemporaryDirectory()
        sizing = Path(self.tmp.name) / "jobs.json"  # sizes the engine and its warm-up
        sizing.write_text(json.dumps(jobs))
        command = [
            python,
            str(HERE / "vllm_peer.py"),
            "--model",
            model_dir,
            "--dtype",
            args.dtype,
            "--mode",
            "default",
            "--threads",
            str(args.threads),
            "--repeats",
            "1",
            "--requests",
            str(sizing),
            "--out",
            str(Path(self.tmp.name) / "unused.json"),
            "--serve",
        ]
        print(f"[against-vllm] {' '.join(command)}", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=peer_environment(),  # vLLM on its own OpenMP defaults, not speedkv's
        )
        self.about = json.loads(self._answer(READY))

    def _answer(self, marker: str) -> str:
        """The payload of the next line that starts with `marker`; vLLM's own prints pass."""
        for line in self.process.stdout:
            if line.startswith(marker):
                return line[len(marker) :]
            print(line, end="", file=sys.stderr)
        raise RuntimeError(f"vllm_peer.py --serve stopped (exit {self.process.wait()})")

    def run(self, job: dict) -> dict:
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return json.loads(self._answer(RESULT))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)
        self.tmp.cleanup()


def ratio_cells(rows: list[dict], mine: tuple[str, str], theirs: str, n: int) -> str:
    """Median (range) over the rounds of speedkv's TTFT and TPOT over vLLM's, round by round."""
    by_round = {}
    for r in rows:
        if r["length"] == n and (r["engine"], r["method"]) in (mine, (theirs, "full")):
            by_round.setdefault(r["repeat"], {})[r["engine"]] = r
    pairs = [p for p in by_round.values() if len(p) == 2]
    cells = ""
    for key in ("ttft_s", "tpot_s"):
        if not pairs:
            cells += " – |"
            continue
        got = paired_ratio([p[mine[0]][key] for p in pairs], [p[theirs][key] for p in pairs])
        cells += f" {got.median:.2f} ({got.min:.2f}-{got.max:.2f}) |"
    return cells


def tables(rows: list[dict], lengths: list[int], vllm: str) -> str:
    methods = [("full", "`full`"), (SPEED, f"`{SPEED}`")]
    lines = [
        "| engine | method |" + "".join(f" TTFT {n} s | TPOT {n} ms |" for n in lengths),
        "|---|---|" + "---:|---:|" * len(lengths),
    ]
    for engine, method in [(SPEEDKV, m) for m, _ in methods] + [(vllm, "full")]:
        cells = ""
        for n in lengths:
            mine = [
                r for r in rows if (r["engine"], r["method"], r["length"]) == (engine, method, n)
            ]
            cells += (
                f" {statistics.median(r['ttft_s'] for r in mine):.2f} |"
                f" {1000 * statistics.median(r['tpot_s'] for r in mine):.1f} |"
            )
        lines.append(f"| {engine} | `{method}` |{cells}")
    rounds = len({r["repeat"] for r in rows})
    lines += [
        "",
        f"Against {vllm} `full`, round by round: the median (and range) of {rounds} "
        "rounds' ratios; below 1 is faster.",
        "",
        "| speedkv method |" + "".join(f" TTFT {n} ratio | TPOT {n} ratio |" for n in lengths),
        "|---|" + "---:|---:|" * len(lengths),
    ]
    for method, label in methods:
        lines.append(
            f"| {label} |" + "".join(ratio_cells(rows, (SPEEDKV, method), vllm, n) for n in lengths)
        )
    agree = [
        r["output_ids"] == v["output_ids"]
        for r in rows
        if (r["engine"], r["method"]) == (SPEEDKV, "full")
        for v in rows
        if v["engine"] == vllm and (v["length"], v["repeat"]) == (r["length"], r["repeat"])
    ]
    lines += [
        "",
        f"Greedy tokens of vLLM equal to speedkv `full`'s in {sum(agree)} of "
        f"{len(agree)} requests (bfloat16: near-ties may go either way).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,8128", help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens a request")
    parser.add_argument("--rounds", type=int, default=5, help="turns of every engine and length")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--vllm-python",
        default=".venv-vllm/bin/python",
        help="the Python of an environment with vllm-cpu (make vllm-venv)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/against-vllm"))
    args = parser.parse_args()
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM environment at {args.vllm_python}: run `make vllm-venv` first")
    torch.set_num_threads(args.threads)
    model = load_model("smollm2-135m", dtype=args.dtype, progress=False)
    engine = Engine(model, prepack=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: exact_chat_prompt(model.tokenizer, n) for n in lengths}
    jobs = {
        n: {"name": f"b1-{n}", "prompts": [ids], "max_new_tokens": args.new_tokens}
        for n, ids in prompts.items()
    }
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    policies = {m: engine.policy(m) for m in ("full", SPEED)}
    for policy in policies.values():  # warm-up on a short prompt
        engine.generate([Request(prompts[min(lengths)][:256], policy, sampling)])
    served = ServedVllm(args.vllm_python, model.source, list(jobs.values()), args)
    vllm = f"vLLM-CPU {served.about['vllm_version']}"
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine_facts(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "vllm": served.about,
        "rows": [],
    }

    def run_speedkv(method: str, n: int) -> tuple:
        g = engine.generate([Request(prompts[n], policies[method], sampling)])[0]
        return SPEEDKV, method, n, g.ttft_s, g.tpot_s, g.output_ids

    def run_vllm(n: int) -> tuple:
        job = served.run(jobs[n])
        return vllm, "full", n, job["ttft_s"], job["tpot_s"], job["output_ids"][0]

    def record(turn: int, _arm: str, done: tuple) -> None:
        engine_name, method, n, ttft, tpot, output_ids = done
        result["rows"].append(row(engine_name, method, n, turn, ttft, tpot, output_ids))
        progress(result["rows"][-1])
        (args.out / "results.json").write_text(json.dumps(result, indent=1))

    try:
        for n in lengths:  # the engines in turn at each length, the order rotated each round
            arms = {
                "full": lambda n=n: run_speedkv("full", n),
                SPEED: lambda n=n: run_speedkv(SPEED, n),
                "vllm": lambda n=n: run_vllm(n),
            }
            turn_about(arms, args.rounds, warmup=0, after=record)  # warmed up above
    finally:
        served.close()
    table = tables(result["rows"], lengths, vllm)
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
