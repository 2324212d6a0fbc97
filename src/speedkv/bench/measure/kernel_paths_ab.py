"""speedkv's batch-1 TTFT and TPOT under each kernel setting, this tree against earlier
revisions, in alternating processes: on a shared machine whose speed drifts by tens of percent
within minutes, only figures taken turn about in the same window compare.

Each round runs one process per (revision, setting), in an order rotated from round to round
(speedkv.bench.paired): SmolLM2 on prepacked weights (the CLI's default), `full` and SPEED-22
at each length, 32 new tokens. The table gives the medians over
the rounds. Settings: `auto` (the measured kernel choice, bfloat16), `torch`
(SPEEDKV_KERNELS=torch), `onednn-without-amx` (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) and
`float32` (the measured choice on float32 weights: what `--dtype auto` loads on a CPU without
AVX512-BF16 or AMX).

    speedkv measure kernel-paths-ab --before HEAD~3 --rounds 3 --out runs/kernel-paths-ab
    speedkv measure kernel-paths-ab --before 3f8b57f,HEAD --settings auto,torch,float32

Each earlier revision is checked out in a temporary git worktree and imported from there.
The revisions are this checkout's: it runs from an editable install (`make install`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]  # the checkout: ROOT/src/speedkv/bench/measure/
SETTINGS = {
    "auto": {},
    "torch": {"SPEEDKV_KERNELS": "torch"},
    "onednn-without-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "float32": {"KERNEL_PATHS_DTYPE": "float32"},
}
METHODS = {"full": "full", "SPEED-22": "speed:lcut=22,anchors=bos"}


def measure(lengths: list[int]) -> dict:
    """One process's figures (run with --child)."""
    import torch

    from speedkv import Engine, Request, SamplingParams, load_model
    from speedkv.prompts.builders import exact_chat_prompt

    torch.set_num_threads(2)
    dtype = os.environ.get("KERNEL_PATHS_DTYPE", "bfloat16")
    model = load_model("smollm2-135m", dtype=dtype, progress=False)
    engine = Engine(model, prepack=True)
    sampling = SamplingParams(max_new_tokens=32, ignore_eos=True)
    figures = {}
    for name, spec in METHODS.items():
        policy = engine.policy(spec)
        engine.generate([Request(exact_chat_prompt(model.tokenizer, 256), policy, sampling)])
        for n in lengths:
            prompt = exact_chat_prompt(model.tokenizer, n)
            g = engine.generate([Request(prompt, policy, sampling)])[0]
            figures[f"{name} {n}"] = {"ttft_s": g.ttft_s, "tpot_ms": g.tpot_s * 1e3}
    return figures


def run_one(source: Path, setting: str, lengths: str) -> dict:
    env = {**os.environ, **SETTINGS[setting], "PYTHONPATH": str(source / "src")}
    # this file run by path, not `-m speedkv.bench.measure.kernel_paths_ab`: earlier revisions
    # may not have the module. Its top imports only the standard library, so the child's
    # `speedkv` is the one on PYTHONPATH, the revision's own.
    command = [sys.executable, __file__, "--child", "--lengths", lengths]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # an earlier revision may not run a setting on this machine
        from speedkv.errors import last_said  # not at the top: children import older trees

        return {"error": last_said(done.stderr, done.returncode)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], lengths: list[int]) -> str:
    keys = [f"{m} {n}" for m in METHODS for n in lengths]
    head = "| code | setting | rounds | " + " | ".join(
        f"{k} TTFT s | {k} TPOT ms" for k in keys
    ) + " |"  # fmt: skip
    lines = [head, "|---|---|---:|" + "---:|" * (2 * len(keys))]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["code"], r["setting"]), []).append(r["figures"])
    for (code, setting), runs in groups.items():
        failed = [f["error"] for f in runs if "error" in f]
        runs = [f for f in runs if "error" not in f]
        if not runs:
            lines.append(f"| {code} | {setting} | 0 | fails: {failed[0][:120]} |")
            continue
        cells = []
        for k in keys:
            cells.append(f"{statistics.median(f[k]['ttft_s'] for f in runs):.2f}")
            cells.append(f"{statistics.median(f[k]['tpot_ms'] for f in runs):.1f}")
        lines.append(f"| {code} | {setting} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure kernel-paths-ab", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--before", default="HEAD", help="earlier revisions (git), comma-separated")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--lengths", default="2048,8128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/kernel-paths-ab"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.child:
        print(json.dumps(measure(lengths)))
        return
    if not (ROOT / ".git").exists():
        parser.error(f"{ROOT} is not a git checkout: run this from an editable install")
    from speedkv.bench.paired import turn_about  # not at the top: children import older trees

    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    revisions = args.before.split(",")
    with tempfile.TemporaryDirectory() as folder:
        trees = [Path(folder) / f"before-{i}" for i in range(len(revisions))]
        for tree, revision in zip(trees, revisions):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                            revision], check=True, capture_output=True)  # fmt: skip
        sources = {f"before ({r})": tree for r, tree in zip(revisions, trees)}
        sources["this tree"] = ROOT
        # every (setting, code) once a round, in an order rotated from round to round
        arms = {
            (setting, code): functools.partial(run_one, source, setting, args.lengths)
            for setting in args.settings.split(",")
            for code, source in sources.items()
        }

        def record(round_: int, arm: tuple[str, str], figures: dict) -> None:
            setting, code = arm
            rows.append({"round": round_, "code": code, "setting": setting, "figures": figures})
            said = figures.get("error") or ", ".join(
                f"{k} {v['ttft_s']:.2f} s / {v['tpot_ms']:.1f} ms" for k, v in figures.items()
            )
            print(f"[kernel-paths-ab] round {round_ + 1}/{args.rounds} {setting} {code}: {said}",
                  flush=True)  # fmt: skip
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))

        try:
            turn_about(arms, args.rounds, warmup=0, after=record)  # each process warms up itself
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], check=False)  # fmt: skip
    text = table(rows, lengths)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
