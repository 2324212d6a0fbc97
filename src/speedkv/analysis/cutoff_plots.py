"""The figure of `speedkv choose-lcut --plot`: fidelity against the cutoff, one line per sweep
(e.g. one per anchor choice), with the budget and each sweep's chosen cutoff marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# metric -> axis label; a budget on the same key is drawn as a line
PANELS = {
    "agreement": "top-1 agreement with full",
    "ppl_ratio": "perplexity ratio to full (log)",
}


def sweep_label(result: dict) -> str:
    """`anchors=...` as the user wrote it (older JSON has only the chosen spec, or a count)."""
    if "anchors_spec" in result:
        return f"anchors={result['anchors_spec']}"
    for part in (result.get("spec") or "").split(","):
        if part.startswith("anchors="):
            return part
    return f"{result['anchors']} anchor tokens"


def plot_cutoff_sweeps(results: list[dict], path: Path) -> Path:
    """Agreement and perplexity ratio per cutoff for every sweep in `results` (choose-lcut's
    JSON); sweeps should share a model, else the x axes mean different depths."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2))
    for ax, (metric, label) in zip(axes, PANELS.items()):
        for i, result in enumerate(results):
            cuts = sorted(int(c) for c in result["cutoffs"])
            values = [result["cutoffs"][str(c)][metric] for c in cuts]
            colour = plt.cm.tab10(i % 10)
            ax.plot(cuts, values, marker="o", markersize=3, color=colour, label=sweep_label(result))
            if result["lcut"] is not None:
                chosen = result["cutoffs"][str(result["lcut"])][metric]
                ax.plot([result["lcut"]], [chosen], marker="*", markersize=14, color=colour)
        bound = results[0]["budget"].get(metric)
        if bound is not None:
            ax.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"budget {bound:g}")
        if metric == "ppl_ratio":
            ax.set_yscale("log")
        ax.set_xlabel("lcut (prompt layers)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    first = results[0]
    fig.suptitle(
        f"choose-lcut on {first.get('model', 'the model')}: {first['passages']} calibration "
        f"passages of {first['prompt_tokens']}+{first['new_tokens']} tokens (star: chosen)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
