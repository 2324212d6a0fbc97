"""What `speedkv bench-reuse` writes: results.json and .csv (as `speedkv bench`), a markdown
table and report, and reuse.png."""

from __future__ import annotations

from pathlib import Path

from speedkv.bench.plots import format_axis, method_styles, pyplot
from speedkv.bench.report import fmt, machine_sentence, measured_with, write_cells

TARGET = 0.10  # a question over a cached document should take at most this share of scratch


def write_outputs(result: dict, out: Path) -> None:
    write_cells(result, out)
    (out / "table.md").write_text(markdown_table(result))
    (out / "report.md").write_text(report_markdown(result))
    plot(result, out)


def markdown_table(result: dict) -> str:
    """One row per method and document length: medians, and the ratios."""
    lines = [
        "| method | document tokens | question tokens | document prefill s | TTFT from scratch s "
        "| TTFT reused s | reused / scratch | KV of the document MiB | document prefill x full "
        "| from scratch x full | reused x full | KV x full | same tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| `{c['method']}` | {c['document_tokens']} | {c['question_tokens']:.0f} | "
            f"{c['document_prefill_s']:.3f} | {c['scratch_ttft_s']:.3f} | "
            f"{c['reused_ttft_s']:.3f} | **{c['reuse_ratio']:.3f}** | "
            f"{c['document_kv_bytes'] / 2**20:.2f} | {fmt(c['document_prefill_vs_full'], '.3f')} "
            f"| {fmt(c['scratch_ttft_vs_full'], '.3f')} | {fmt(c['reused_ttft_vs_full'], '.3f')} "
            f"| {fmt(c['document_kv_vs_full'], '.3f')} | {100 * c['same_tokens']:.0f}% |"
        )
    return "\n".join(lines) + "\n"


def report_markdown(result: dict, images: str = ".") -> str:
    cfg = result["config"]
    return "\n".join(
        [
            f"# Asking a cached document, `{cfg['model']}` ({result['dtype']})",
            "",
            *measured_with(result, "speedkv bench-reuse"),
            f"Per method and document length: the document (a chat turn of its own) prefilled "
            f"once, then {cfg['questions']} questions, each asked over the cached document and "
            f"from scratch (the same token ids), back to back, in alternating order; "
            f"{cfg['new_tokens']} new tokens each. Medians over {cfg['repeats']} repeats (and "
            "the questions); reused / scratch is the median of each pair's ratio, x full the "
            f"median ratio to full's run of the same repeat and question. "
            f"{machine_sentence(result)}",
            "",
            markdown_table(result),
            f"![TTFT reused and from scratch, their ratio, and the document's KV]({images}/"
            "reuse.png)",
            "",
        ]
    )


def plot(result: dict, out: Path) -> None:
    """TTFT from scratch (dashed) and reused (solid); reused / scratch with the 10 % target;
    the document's KV."""
    plt = pyplot()
    methods = result["methods"]
    style = method_styles(plt, methods)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for method in methods:
        cells = [c for c in result["cells"] if c["method"] == method]
        if not cells:
            continue
        x = [c["document_tokens"] for c in cells]
        for mode, line in (("scratch", "--"), ("reused", "-")):
            y = [c[f"{mode}_ttft_s"] for c in cells]
            err = [
                [c[f"{mode}_ttft_s"] - c[f"{mode}_ttft_s_min"] for c in cells],
                [c[f"{mode}_ttft_s_max"] - c[f"{mode}_ttft_s"] for c in cells],
            ]
            axes[0].errorbar(
                x, y, yerr=err, capsize=3, ls=line, label=f"{method}, {mode}", **style[method]
            )
        axes[1].plot(x, [c["reuse_ratio"] for c in cells], label=method, **style[method])
        axes[2].plot(
            x, [c["document_kv_bytes"] / 2**20 for c in cells], label=method, **style[method]
        )
    format_axis(axes[0], "ttft_s", "TTFT of a question (s)")
    format_axis(axes[1], "ttft_s", "TTFT reused / from scratch")
    axes[1].axhline(TARGET, color="black", lw=0.8, ls=":", label=f"{TARGET:.0%} target")
    format_axis(axes[2], "kv_bytes", "KV of the cached document (MiB)")
    for ax in axes:
        ax.set_xlabel("document tokens")
    axes[0].legend(fontsize=6)
    axes[1].legend(fontsize=6)
    cfg = result["config"]
    fig.suptitle(
        f"{cfg['model']} ({result['dtype']}): a ~{_question_tokens(result)}-token question "
        f"over a cached document; medians of {cfg['repeats']} repeats x {cfg['questions']} "
        "questions, min-max bars"
    )
    fig.tight_layout()
    fig.savefig(out / "reuse.png", dpi=120)
    plt.close(fig)


def _question_tokens(result: dict) -> int:
    cells = result["cells"]
    return round(sum(c["question_tokens"] for c in cells) / len(cells)) if cells else 0
