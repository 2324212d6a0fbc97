"""What `speedkv bench` writes: results.json, results.csv, the markdown table and report."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from speedkv.bench.plots import plot

HF = "hf"  # pseudo-method: the model's own `generate`, as a baseline for our `full` loop


def write_outputs(result: dict, out: Path) -> None:
    write_cells(result, out)
    (out / "table.md").write_text(markdown_table(result))
    (out / "report.md").write_text(report_markdown(result))
    plot(result, out)


def write_cells(result: dict, out: Path) -> None:
    """results.json, and results.csv with a row per cell (method and length first)."""
    (out / "results.json").write_text(json.dumps(result, indent=2))
    cells = result["cells"]
    columns = ["method", "length", "repeats"] + [
        k for k in cells[0] if k not in ("method", "length", "repeats")
    ]
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(cells)


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    """A table cell: the value scaled and formatted, or a dash when there is none."""
    return "–" if value is None else format(value * scale, spec)


def markdown_table(result: dict) -> str:
    """Medians per cell, each ratio taken against full in the same repeat."""
    lines = [
        "| method | tokens | TTFT s | TTFT/limit | TPOT ms | TPOT/limit | KV read share "
        "| KV MiB | KV end MiB | peak RSS GiB | TTFT x | TPOT x | KV x | FLOPs x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| `{c['method']}` | {c['length']} | {fmt(c['ttft_s'], '.3f')} | "
            f"{fmt(c.get('ttft_x_bound'), '.2f')} | {fmt(c['tpot_s'], '.1f', 1e3)} | "
            f"{fmt(c.get('tpot_x_bound'), '.2f')} | {fmt(c.get('kv_read_share'), '.0%')} | "
            f"{fmt(c['kv_bytes'], '.2f', 2**-20)} | "
            f"{fmt(c['kv_bytes_final'], '.2f', 2**-20)} | "
            f"{fmt(c['peak_rss_bytes'], '.2f', 2**-30)} | {fmt(c['ttft_ratio'], '.3f')} | "
            f"{fmt(c['tpot_ratio'], '.3f')} | {fmt(c['kv_ratio'], '.3f')} | "
            f"{fmt(c['flops_prefill_ratio'], '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def report_markdown(result: dict, images: str = ".") -> str:
    """A self-contained report: command, machine, table and the efficiency figure."""
    cfg = result["config"]
    on_vllm = ", inside vLLM" if result.get("decode") == "vllm" else ""
    return "\n".join(
        [
            f"# Efficiency of every method on `{cfg['model']}` ({result['dtype']}{on_vllm})",
            "",
            *measured_with(result, "speedkv bench"),
            f"Model `{cfg['model']}` in {result['dtype']}; {cfg['new_tokens']} new tokens per run; "
            f"medians of {cfg['repeats']} repeats after one warm-up, methods interleaved within "
            f"each repeat; ratios against `full` from the same repeat. {machine_sentence(result)} "
            "FLOPs x is the prefill cost-model ratio (layer-token matmuls plus attention pairs).",
            *[line for note in result.get("notes", []) for line in ("", note)],
            "",
            limits_sentence(result),
            "",
            markdown_table(result),
            engine_vs_hf(result),
            f"![TTFT, TPOT and KV memory against prompt length]({images}/efficiency.png)",
            "",
        ]
    )


def measured_with(result: dict, default_command: str) -> list[str]:
    """The lines saying when and with which command a result was measured."""
    command = result["config"].get("command") or default_command
    return [f"Measured {result['date']} with:", "", "```bash", command, "```", ""]


def machine_sentence(result: dict) -> str:
    machine = result["machine"]
    flags = machine.get("isa")
    isa = f" ({', '.join(flags)})" if flags else ""
    return (
        f"Machine: {machine['cpu']}{isa}, {machine['threads']} threads, torch {machine['torch']}, "
        f"transformers {machine['transformers']}."
    )


def engine_vs_hf(result: dict) -> str:
    """Our `full` loop against the model's own `generate` (what users had before), per length."""
    cells = {(c["method"], c["length"]): c for c in result["cells"]}
    lengths = [n for n in result["config"]["lengths"] if (HF, n) in cells and ("full", n) in cells]
    if not lengths:
        return ""
    lines = [
        "Before and after: the model's own `generate` (HF) against our `full` loop, same run. "
        "full/HF is the median over repeats of the per-repeat ratio.",
        "",
        "| tokens | HF TTFT s | full TTFT s | full/HF TTFT | full TTFT/limit "
        "| HF TPOT ms | full TPOT ms | full/HF TPOT | full TPOT/limit |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        hf, full = cells[(HF, n)], cells[("full", n)]
        lines.append(
            f"| {n} | {hf['ttft_s']:.3f} | {full['ttft_s']:.3f} | {1 / hf['ttft_ratio']:.3f} "
            f"| {full['ttft_x_bound']:.2f} | {hf['tpot_s'] * 1e3:.1f} | {full['tpot_s'] * 1e3:.1f} "
            f"| {1 / hf['tpot_ratio']:.3f} | {full['tpot_x_bound']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def limits_sentence(result: dict) -> str:
    limits = result.get("limits")
    if not limits:
        return ""
    weights = f"{limits['decode_weight_bytes'] / 2**20:.0f} MiB"
    if limits.get("gemv_gb_s"):
        decode_rule = (
            f"{limits['gemv_gb_s']:.1f} GB/s of weights through matrix-vector products (the "
            "rate this CPU's kernels reach, below the raw bandwidth). TPOT/limit is TPOT over "
            f"weights {weights} / that rate + mean visible K/V / bandwidth"
        )
    else:
        decode_rule = f"TPOT/limit is TPOT over (weights {weights} + mean visible K/V) / bandwidth"
    return (
        f"Limits measured in the same run: {limits['bandwidth_gb_s']:.1f} GB/s read bandwidth, "
        f"{limits['matmul_tflop_s']:.3f} TFLOP/s {limits['dtype']} matmul, {decode_rule}; "
        "KV read share is the visible K/V's part of that step limit, what reading less K/V "
        "can save at most; TTFT/limit is TTFT over prefill FLOPs / matmul rate (1.00 would be "
        "the hardware's best)."
    )
