"""The efficiency figures of `speedkv bench`."""

from __future__ import annotations

from pathlib import Path


def measured_cells(result: dict, method: str, metric: str) -> list[dict]:
    """The method's cells that have a value for `metric`."""
    return [c for c in result["cells"] if c["method"] == method and c[metric] is not None]


def format_axis(ax, metric: str, label: str) -> None:
    """Log-2 prompt lengths on x; TTFT also on a log y (it spans orders of magnitude)."""
    ax.set_xscale("log", base=2)
    if metric == "ttft_s":
        ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def method_styles(plt, methods: list[str]) -> dict[str, dict]:
    """A colour and a marker per method: a dozen methods outrun any default colour cycle."""
    return {
        m: dict(color=plt.cm.tab20(i % 20), marker="osD^v<>ph*Xd"[i % 12])
        for i, m in enumerate(methods)
    }


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    panels = [
        ("ttft_s", "TTFT (s)", 1.0),
        ("tpot_s", "TPOT (ms)", 1e3),
        ("kv_bytes", "KV at first token (MiB)", 2**-20),
    ]
    methods = result["methods"]
    style = method_styles(plt, methods)
    legend_rows = (len(methods) + 1) // 2
    height = 4.2 + 0.17 * legend_rows
    fig, axes = plt.subplots(1, 3, figsize=(15, height))
    for ax, (metric, label, scale) in zip(axes, panels):
        for method in methods:
            cells = measured_cells(result, method, metric)
            if not cells:
                continue
            x = [c["length"] for c in cells]
            y = [c[metric] * scale for c in cells]
            err = [
                [(c[metric] - c[metric + "_min"]) * scale for c in cells],
                [(c[metric + "_max"] - c[metric]) * scale for c in cells],
            ]
            ax.errorbar(x, y, yerr=err, capsize=3, label=method, **style[method])
        format_axis(ax, metric, label)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.suptitle(
        f"{result['config']['model']} ({result['dtype']}), medians of "
        f"{result['config']['repeats']} repeats, min-max bars"
    )
    fig.tight_layout(rect=(0, (0.17 * legend_rows + 0.1) / height, 1, 1))
    fig.savefig(out / "efficiency.png", dpi=120)
    for metric, label, scale in panels:
        f2, ax = plt.subplots(figsize=(6, 4.2))
        for method in methods:
            cells = measured_cells(result, method, metric)
            if cells:
                ax.plot(
                    [c["length"] for c in cells],
                    [c[metric] * scale for c in cells],
                    label=method,
                    **style[method],
                )
        format_axis(ax, metric, label)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
        f2.savefig(out / f"{metric.split('_')[0]}.png", dpi=120, bbox_inches="tight")
        plt.close(f2)
    plt.close(fig)
