"""speedkv's default engine against vLLM-CPU, turn about: ratios that a noisy CPU still gives.

    .venv/bin/python benchmarks/against_vllm.py --rounds 5 --out runs/against-vllm

On a shared CPU the speed of the same work can drift by 1.5-2x within minutes, so two engines
timed one after the other (benchmarks/peers.py) can differ by the drift alone. Here vLLM stays
loaded in its own process (`benchmarks/vllm_peer.py --serve`, in vLLM's environment: make
vllm-venv) and the engines take turns request by request: each round runs every length once on
speedkv `full`, speedkv SPEED-22 (both on prepacked weights, the CLI's default) and vLLM
`full` (compiled, prefix caching off), in an order rotated from round to round. A round gives
its own ratios; the table shows their median and range over the rounds. Same token ids for
every engine, greedy, EOS ignored, the same thread count.

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

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv._openmp import peer_environment
from speedkv.bench.machine import machine_facts
from speedkv.prompts.builders import exact_chat_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import SPEED, progress, row  # noqa: E402  (the scripts beside this one)
from vllm_peer import READY, RESULT  # noqa: E402  (stdlib only at import: runs in any venv)

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
    cells = ""
    for key in ("ttft_s", "tpot_s"):
        ratios = [p[mine[0]][key] / p[theirs][key] for p in by_round.values() if len(p) == 2]
        cells += (
            f" {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
            if ratios
            else " – |"
        )
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

    def run_speedkv(method: str, n: int, turn: int) -> dict:
        g = engine.generate([Request(prompts[n], policies[method], sampling)])[0]
        return row(SPEEDKV, method, n, turn, g.ttft_s, g.tpot_s, g.output_ids)

    def run_vllm(n: int, turn: int) -> dict:
        job = served.run(jobs[n])
        return row(vllm, "full", n, turn, job["ttft_s"], job["tpot_s"], job["output_ids"][0])

    turns = [
        lambda n, t: run_speedkv("full", n, t),
        lambda n, t: run_speedkv(SPEED, n, t),
        run_vllm,
    ]
    try:
        for turn in range(args.rounds):
            for n in lengths:
                shift = turn % len(turns)  # rotated: no engine always runs first
                for run in turns[shift:] + turns[:shift]:
                    result["rows"].append(run(n, turn))
                    progress(result["rows"][-1])
            (args.out / "results.json").write_text(json.dumps(result, indent=1))
    finally:
        served.close()
    table = tables(result["rows"], lengths, vllm)
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
