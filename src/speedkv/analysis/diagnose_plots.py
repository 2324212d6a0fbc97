"""Figures of the layer-wise cutoff diagnostic (matplotlib, Agg backend).

- attention_heatmap.png: like the SPEED paper's Figure 1, layer x decode step of the attention
  mass generated tokens give prefill tokens, for full attention and for SPEED at the chosen
  cutoff, on one colour scale;
- layer_signals.png: each signal across layers, with the candidate cutoffs marked.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

SIGNAL_COLOURS = {
    "prefill": "tab:blue",
    "prompt_end": "tab:cyan",
    "bos": "tab:red",
    "decode": "tab:green",
    "self": "tab:gray",
}


def _array(rows) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=float)


def heatmap(result: dict, path: Path) -> None:
    variants = result["variants"]
    maps = {name: _array(v["heatmap_prefill"]) for name, v in variants.items()}
    top = max(np.nanmax(m) if np.isfinite(m).any() else 0.0 for m in maps.values()) or 1.0
    fig, axes = plt.subplots(1, len(maps), figsize=(5.2 * len(maps), 4.6), sharey=True)
    for ax, (name, grid) in zip(np.atleast_1d(axes), maps.items()):
        image = ax.imshow(
            grid,
            origin="lower",
            aspect="auto",
            vmin=0,
            vmax=top,
            cmap="viridis",
            interpolation="nearest",
        )
        title = "Full attention" if name == "full" else variants[name]["spec"]
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("decode step")
        if name != "full":
            ax.axhline(result["lcut"] - 0.5, color="white", linestyle="--", linewidth=1)
    np.atleast_1d(axes)[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="attention to prefill tokens")
    fig.suptitle("Decode-to-prefill attention per layer and decode step", fontsize=11)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def layer_signals(result: dict, path: Path) -> None:
    full, speed = result["variants"]["full"], result["variants"]["speed"]
    L = result["model_layers"]
    layers, states = np.arange(L), np.arange(L + 1)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    ax = axes[0, 0]
    for name, values in full["attention"].items():
        ax.plot(layers, _array([values])[0], label=name, color=SIGNAL_COLOURS.get(name))
    ax.plot(
        layers,
        _array([speed["attention"]["prefill"]])[0],
        color=SIGNAL_COLOURS["prefill"],
        linestyle=":",
        label=f"prefill, SPEED lcut={result['lcut']}",
    )
    ax.set_title("attention mass of generated tokens (full attention)", fontsize=10)
    ax.set_ylabel("share of attention")
    ax.legend(fontsize=7, ncol=2)
    panels = [
        (axes[0, 1], layers, "prompt_entropy", "conditional prompt entropy (normalised)"),
        (axes[1, 0], states, "token_curvature", "token-trajectory curvature (degrees)"),
        (axes[1, 1], states, "depth_curvature", "curvature across layers (degrees)"),
    ]
    for ax, xs, key, title in panels:
        ax.plot(xs, _array([full[key]])[0], color="black", label="full")
        ax.plot(xs, _array([speed[key]])[0], color="tab:orange", linestyle=":", label="SPEED")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    marks = dict(result["candidates"])
    marks.setdefault(f"lcut={result['lcut']}", result["lcut"])
    styles = ["--", "-.", (0, (1, 1)), (0, (5, 2, 1, 2))]
    for ax in axes.flat:
        for (label, cut), style in zip(marks.items(), styles):
            ax.axvline(cut - 0.5, color="tab:purple", linestyle=style, linewidth=1, label=None)
            ax.text(
                cut - 0.4,
                0.98,
                label,
                rotation=90,
                va="top",
                fontsize=6,
                color="tab:purple",
                transform=ax.get_xaxis_transform(),
            )
    for ax in axes[1]:
        ax.set_xlabel("layer (curvature: at the state entering it)")
    fig.suptitle("Layer-wise cutoff diagnostic (candidate cutoffs: first layer not kept)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_figures(result: dict, out: Path) -> list[Path]:
    paths = [out / "attention_heatmap.png", out / "layer_signals.png"]
    heatmap(result, paths[0])
    layer_signals(result, paths[1])
    return paths
