"""Does speedkv's SnapKV agree with kvpress's SnapKVPress? Same prompts, same settings.

    .venv/bin/python benchmarks/kvpress_snapkv.py --kvpress-python .venv-kvpress/bin/python \\
        --tasks ruler/niah_single_1,ruler/qa_1 --first 3 --out runs/kvpress-snapkv

kvpress's side is benchmarks/kvpress_peer.py's kvpress half: its pipeline, query-aware (the
question appended to the context, question=""), SnapKVPress at --ratio, with the positions it
keeps per layer and KV head recorded (and those its own scoring keeps when run in float32).
speedkv's side runs `snapkv:retain=1-ratio,window=64,kernel=5,pool=avg,gqa=true` (kvpress's
window and kernel, its average over each KV head's query heads) on the same token ids, three
ways:
  protocol: kvpress's order of work: the context and question prefilled and compressed, then
    the chat template's end and the answer prefix fed uncompressed, then greedy decoding;
  whole: the whole prompt prefilled and compressed at once, as `speedkv eval` runs a method
    (the observation window then ends with the answer prefix, not the question);
  full: full attention, beside kvpress's press=None, for how far the two engines' answers
    differ without any compression.
Reported: answers equal, scores, and the overlap of the kept positions per layer and KV head
(protocol against kvpress), with how close to the cut the positions only one side keeps lie.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType


def _kvpress_peer() -> ModuleType:
    """benchmarks/kvpress_peer.py, loaded from its file: a script run by path in two
    environments (speedkv's and kvpress's), not a package module. Nothing is added to sys.path."""
    path = Path(__file__).resolve().with_name("kvpress_peer.py")
    spec = importlib.util.spec_from_file_location("kvpress_peer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


peer = _kvpress_peer()

WINDOW, KERNEL = 64, 5  # SnapKVPress's defaults


def our_spec(ratio: float) -> str:
    return f"snapkv:retain={1 - ratio:g},window={WINDOW},kernel={KERNEL},pool=avg,gqa=true"


def greedy(engine, policy, prefill, rest: list[int], start: int, new: int) -> list[int]:
    """Feed `rest` (not compressed: the policy compresses at prefill only) after a prefill of
    `start` tokens, then decode greedily up to `new` tokens or an end token."""
    cache, logits, position = prefill.cache, prefill.logits, start
    for token in rest:
        logits = engine.decode_step([cache], [policy], [token], [position])[0]
        position += 1
    out: list[int] = []
    while len(out) < new:
        token = int(logits.argmax())
        out.append(token)
        if token in engine.eos_ids:
            break
        logits = engine.decode_step([cache], [policy], [token], [position])[0]
        position += 1
    return out


def ours(args, samples: list, rows: dict) -> dict:
    """speedkv's answers and kept positions on the prompts kvpress answered."""
    import torch

    from speedkv import Engine, load_model
    from speedkv.core.engine import Request
    from speedkv.core.registry import make_policy
    from speedkv.core.sampling import SamplingParams
    from speedkv.evals import ruler

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="bfloat16", progress=False)
    engine = Engine(model)
    spec = our_spec(args.ratio)
    out = {}
    for task, index, sample in samples:
        key = peer.job_key(task, args.length, index)
        row = rows[(key, peer.method_name("snapkv", args.ratio, "aware"))]
        new = ruler.task_spec(task).tokens_to_generate
        ids, cut = sample.prompt.ids, row["context_tokens"]
        policy = make_policy(spec, model.shape)
        scores: dict[int, torch.Tensor] = {}
        entry_scores = policy.entry_scores

        def recorded(layer, view, entry_scores=entry_scores, scores=scores):
            scores[layer] = entry_scores(layer, view)
            return scores[layer]

        policy.entry_scores = recorded  # this prompt's policy only
        t0 = time.perf_counter()
        prefill = engine.prefill_ids(ids[:cut], policy, spare=len(ids) - cut + new)
        kept = [layer.positions().tolist() for layer in prefill.cache.layers]
        tokens = greedy(engine, policy, prefill, ids[cut:], cut, new)
        protocol_s = time.perf_counter() - t0
        text = model.tokenizer.decode(tokens, skip_special_tokens=True)
        answers = {"protocol": text}
        for name, method in (("whole", spec), ("full", "full")):
            request = Request(
                ids,
                make_policy(method, model.shape),
                SamplingParams(max_new_tokens=new),
                sample.prompt.header_tokens,
                sample.prompt.turn_tokens,
            )
            answers[name] = engine.generate([request])[0].text
        out[key] = {
            "answers": answers,
            "kept": kept,
            "scores": {layer: s.tolist() for layer, s in scores.items()},
            "protocol_s": protocol_s,
        }
        peer.log(f"speedkv {key}: {answers}")
    return out


def overlap(ours_kept: list[list[list[int]]], theirs: dict) -> list[list[float]]:
    """|ours ∩ theirs| / |theirs| per layer and KV head."""
    table = []
    for layer, heads in enumerate(ours_kept):
        row = []
        for head, positions in enumerate(heads):
            other = set(theirs[str(layer)][head])
            row.append(len(other & set(positions)) / len(other))
        table.append(row)
    return table


def margins(scores: list[list[float]], kept: list[int], other: list[int], window_start: int):
    """For positions one side keeps and the other drops (before the window): how far their
    score (ours, float32) lies from our cut, relative to the cut's score."""
    out = []
    for head, row in enumerate(scores):
        keep_n = sum(1 for p in kept[head] if p < window_start)
        cut = sorted(row, reverse=True)[keep_n - 1]
        diff = set(kept[head]) ^ set(other[head])
        out += [abs(row[p] - cut) / cut for p in diff if p < window_start]
    return out


def short(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= 48 else text[:45] + "...")


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    parser.add_argument("--tasks", default="ruler/niah_single_1,ruler/qa_1")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=20, help="the sample files' count")
    parser.add_argument("--first", type=int, default=3, help="samples per task compared")
    parser.add_argument("--ratio", type=float, default=peer.DEFAULT_RATIO)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ruler-data")
    parser.add_argument("--out", default="runs/kvpress-snapkv")
    args = parser.parse_args()

    from speedkv._openmp import peer_environment
    from speedkv.evals import ruler
    from speedkv.hf.loading import load_tokenizer, model_directory

    peer.kvpress_versions(args.kvpress_python)
    model_dir = str(model_directory(args.model, progress=False))
    samples = peer.prepare_samples(args, load_tokenizer(model_dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, kept_path = out / "kvpress-results.jsonl", out / "kvpress-kept.jsonl"
    if not results.exists():
        jobs = {
            "model": model_dir,
            "threads": args.threads,
            "presses": ["snapkv"],
            "ratios": [args.ratio],
            "settings": ["aware"],
            "jobs": peer.make_jobs(samples, args.length),
        }
        (out / "jobs.json").write_text(json.dumps(jobs))
        command = [args.kvpress_python, peer.SCRIPT, "--run", str(out / "jobs.json")]
        command += ["--results", str(results), "--kept", str(kept_path)]
        env = {**peer_environment(), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
        subprocess.run(command, env=env, check=True)
    rows = {(r["job"], r["method"]): r for r in peer.read_results(results)}
    kept = {r["job"]: r for r in map(json.loads, kept_path.read_text().splitlines())}
    # speedkv's side is saved per kernel choice: a run under SPEEDKV_KERNELS=torch beside the
    # default one shows how much our own kept sets move with the forward's rounding alone
    kernels = os.environ.get("SPEEDKV_KERNELS", "auto")
    speedkv = json.loads(json.dumps(ours(args, samples, rows)))  # layer keys as JSON has them
    (out / f"speedkv-{kernels}.json").write_text(json.dumps(speedkv))
    others = {
        path.stem.removeprefix("speedkv-"): json.loads(path.read_text())
        for path in sorted(out.glob("speedkv-*.json"))
        if path.stem != f"speedkv-{kernels}"
    }

    lines, same = [], {"protocol": 0, "whole": 0, "full": 0}
    layers_equal, overlaps, overlaps32, gaps, gaps32 = 0, [], [], [], []
    heads = 0
    for task, index, sample in samples:
        key = peer.job_key(task, args.length, index)
        press = rows[(key, peer.method_name("snapkv", args.ratio, "aware"))]
        none = rows[(key, peer.method_name(peer.NONE, None, "aware"))]
        mine = speedkv[key]
        theirs = {"protocol": press["answer"], "whole": press["answer"], "full": none["answer"]}
        for name in same:
            same[name] += mine["answers"][name].strip() == theirs[name].strip()
        window_start = press["context_tokens"] - WINDOW
        table = overlap(mine["kept"], kept[key]["kept"])
        table32 = overlap(mine["kept"], kept[key]["kept_float32"])
        for layer, row in enumerate(table):
            heads += len(row)
            layers_equal += sum(1 for x in row if x == 1.0)
            overlaps += row
            overlaps32 += table32[layer]
            scores = mine["scores"][str(layer)]
            gaps += margins(
                scores, mine["kept"][layer], kept[key]["kept"][str(layer)], window_start
            )
            gaps32 += margins(
                scores, mine["kept"][layer], kept[key]["kept_float32"][str(layer)], window_start
            )
        score = {n: ruler.score(task, a, sample.outputs) for n, a in mine["answers"].items()}
        lines.append(
            f"| {task.removeprefix('ruler/')} #{index} | {short(press['answer'])} "
            f"({ruler.score(task, press['answer'], sample.outputs):.2f}) | "
            f"{short(mine['answers']['protocol'])} ({score['protocol']:.2f}) | "
            f"{short(mine['answers']['whole'])} ({score['whole']:.2f}) | "
            f"{short(none['answer'])} / {short(mine['answers']['full'])} | "
            f"{mean(x for r in table for x in r):.4f} | {mean(x for r in table32 for x in r):.4f} |"
        )
    n = len(samples)
    gaps.sort()
    gaps32.sort()
    report = [
        f"# speedkv SnapKV ({our_spec(args.ratio)}) against kvpress SnapKVPress "
        f"(compression_ratio={args.ratio:g}), query-aware, {n} prompts",
        "",
        "| sample | kvpress | speedkv, kvpress's order | speedkv, whole prompt | "
        "full: kvpress / speedkv | kept overlap | overlap with kvpress in float32 |",
        "|---|---|---|---|---|---:|---:|",
        *lines,
        "",
        f"- answers equal: protocol {same['protocol']}/{n}, whole prompt {same['whole']}/{n}, "
        f"full attention {same['full']}/{n}",
        f"- kept positions, mean overlap over {heads} (prompt, layer, KV head) sets: "
        f"{mean(overlaps):.4f} (kvpress as it runs), {mean(overlaps32):.4f} (its scores in "
        f"float32); identical sets: {layers_equal}/{heads}",
        f"- positions kept by one side only: {len(gaps)} (float32: {len(gaps32)}); their "
        f"distance from our cut relative to it, median "
        f"{gaps[len(gaps) // 2] if gaps else float('nan'):.4f}, 90th percentile "
        f"{gaps[int(0.9 * len(gaps))] if gaps else float('nan'):.4f}",
    ]
    for name, other in others.items():
        shared = [k for k in speedkv if k in other]
        sets = [
            len(set(a) & set(b)) / len(set(b))
            for k in shared
            for mine_layer, other_layer in zip(speedkv[k]["kept"], other[k]["kept"])
            for a, b in zip(mine_layer, other_layer)
        ]
        equal = sum(
            speedkv[k]["answers"]["protocol"] == other[k]["answers"]["protocol"] for k in shared
        )
        report.append(
            f"- speedkv with SPEEDKV_KERNELS={kernels} against {name}: mean kept overlap "
            f"{mean(sets):.4f}, protocol answers equal {equal}/{len(shared)}"
        )
    text = "\n".join(report)
    (out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
