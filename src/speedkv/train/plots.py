"""The loss curve of a run (and its probe curves, when probes ran) as a PNG."""

from __future__ import annotations

from pathlib import Path

SMOOTH_POINTS = 10  # logged points in the moving average of the loss curves


def plot_history(history: list[dict], path: Path, title: str) -> None:
    """Loss (and its CE / KL parts) against steps, steps and wall minutes in the title;
    a second panel for probe results if there are any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [h for h in history if "loss" in h and "step" in h]
    probes = [h for h in history if any(k.startswith("probe_") for k in h)]
    panels = 2 if probes else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.6 * panels), squeeze=False)
    ax = axes[0][0]
    steps = [h["step"] for h in rows]
    parts = (
        ("loss", "loss"),
        ("ce", "cross-entropy"),
        ("kl", "KL to full depth"),
        ("kl_full", "full depth's KL to the untrained model"),
        ("hidden", "upper layers' hidden-state error"),
    )
    for index, (key, label) in enumerate(parts):
        values = [h.get(key) for h in rows]
        if not rows or None in values:  # a term the run did not have
            continue
        # one logged point averages a few one-example steps of mixed task kinds: the raw line
        # is mostly which examples they were, the moving average is the trend
        ax.plot(steps, values, color=f"C{index}", linewidth=0.8, alpha=0.3)
        ax.plot(steps, moving_average(values, SMOOTH_POINTS), color=f"C{index}", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss per response token\n(faint: as logged; bold: mean of {SMOOTH_POINTS})")
    if rows and rows[-1].get("wall_s"):
        title = f"{title}: {steps[-1]} steps in {rows[-1]['wall_s'] / 60:.1f} min"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", transform=ax.transAxes)
    if probes:
        left = axes[1][0]
        right = left.twinx()  # accuracies on the left, perplexity on the right
        keys = sorted({k for h in probes for k in h if k.startswith("probe_")})
        for index, key in enumerate(keys):
            points = [(h["step"], h[key]) for h in probes if key in h]
            axis = left if key.endswith("_acc") else right
            axis.plot(*zip(*points), marker="o", color=f"C{index}", label=key[len("probe_") :])
        left.set_ylim(-0.05, 1.05)
        left.set_ylabel("accuracy")
        right.set_ylabel("perplexity")
        left.set_xlabel("optimizer step")
        left.set_title("probes on calibration text (never eval)", fontsize=9)
        left.grid(alpha=0.3)
        handles = left.get_legend_handles_labels()
        extra = right.get_legend_handles_labels()
        left.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def moving_average(values: list[float], points: int) -> list[float]:
    """Mean of each value and up to `points - 1` before it (a trailing window)."""
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= points:
            total -= values[index - points]
        out.append(total / min(index + 1, points))
    return out


def plot_probe_comparison(runs: list[dict], path: Path, x_axis: str = "minutes") -> None:
    """Calibration perplexity and pass-key accuracy of several runs' probes against training
    minutes (or optimizer steps): quality against training time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from speedkv.train.compare import X_AXES, run_label

    key, x_label = X_AXES[x_axis]
    fig, (ppl_axis, acc_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for index, run in enumerate(runs):
        xs = [p[key] for p in run["probes"]]
        # Pass-key scores are quarters and often equal across runs: shrinking markers and
        # varied dashes keep every run visible where the lines coincide.
        style = {
            "marker": "os^Dv"[index % 5],
            "markersize": max(3.0, 9.0 - 1.5 * index),
            "linestyle": ("-", "--", "-.", ":")[index % 4],
            "color": f"C{index}",
            "label": run_label(run),
        }
        for axis, value in ((ppl_axis, "ppl"), (acc_axis, "passkey_acc")):
            axis.plot(xs, [p[value] for p in run["probes"]], **style)
    ppl_axis.set_ylabel("perplexity of calib passages (lower is better)")
    acc_axis.set_ylabel("pass keys found (calib prompts)")
    acc_axis.set_ylim(-0.05, 1.05)
    for axis in (ppl_axis, acc_axis):
        axis.set_xlabel(x_label)
        axis.grid(alpha=0.3)
    ppl_axis.legend(fontsize=8)
    fig.suptitle(
        "training probes: each method measured through its own inference path", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
