"""A board's Pareto plot: RULER average against KV and TTFT ratio, one row of panels per
setting, each with its untrained Pareto front."""

from __future__ import annotations

from pathlib import Path

from speedkv.leaderboard.rows import AGNOSTIC, AWARE, KVPRESS_NONE, SETTING_LABELS, Row


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: none has a lower (or equal) cost with a
    higher (or equal) score, one of the two strictly. Cost on x, score on y."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def untrained_front(rows: list[Row], cost: str) -> list[int]:
    """Indices of `rows` on the Pareto front of RULER average against `cost` (kv_ratio or
    ttft_ratio), over the untrained rows only: a trained row is another model. Costs count to
    three decimals, so rows set to one budget tie instead of ranking by their rounding."""
    untrained = [
        i
        for i, r in enumerate(rows)
        if not r.adapter and r.average is not None and getattr(r, cost) is not None
    ]
    points = [(round(getattr(rows[i], cost), 3), rows[i].average) for i in untrained]
    return [untrained[j] for j in pareto_front(points)]


def plot_pareto(rows: list[Row], length: int, path: Path, title: str = "") -> Path | None:
    """RULER average against KV ratio and against TTFT ratio (columns), one row of panels per
    setting; each panel joins its untrained Pareto front and names the points a reader looks
    for (the front, SPEED, full attention, the adapter rows); the others are left to the
    tables, so dozens of presses at one budget stay readable."""
    mine = [r for r in rows if r.length == length and r.average is not None]
    if not mine:
        return None
    from speedkv.evals.render import pyplot

    most = max(r.min_samples for r in mine)  # rows measured on fewer are marked provisional
    settings = [s for s in (AWARE, AGNOSTIC) if any(r.setting == s for r in mine)]
    plt = pyplot()
    fig, grid = plt.subplots(
        len(settings), 2, figsize=(12, 4.8 * len(settings)), sharey=True, squeeze=False
    )
    costs = (
        ("kv_ratio", "KV cache at the first token, x full"),
        ("ttft_ratio", "TTFT, x full (each engine against its own full attention)"),
    )
    for axes, setting in zip(grid, settings):
        for ax, (cost, xlabel) in zip(axes, costs):
            points = [r for r in mine if r.setting == setting and getattr(r, cost) is not None]
            _pareto_panel(ax, points, cost, most)
            ax.set_xlabel(xlabel)
            values = [getattr(r, cost) for r in points]
            if values and max(values) > 4 * min(values):  # one slow outlier squashes the rest
                ax.set_xscale("log")
            ax.set_title(SETTING_LABELS[setting], fontsize=9)
        axes[0].set_ylabel(f"RULER average at {length} tokens, %")
    grid[0][0].legend(fontsize=7, loc="best")  # where it covers the fewest points
    fig.suptitle(
        (title + "\n" if title else "")
        + "black edge: with a SPEED-aware adapter (off the front, which joins untrained rows); "
        "bars: 95 % margins; unnamed points are in the tables",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# marker, colour and legend entry of each kind of row
_KINDS = {
    "speed": ("*", "tab:red", "SPEED"),
    "speedkv": ("o", "tab:blue", "speedkv's other methods"),
    "kvpress": ("s", "tab:green", "kvpress presses"),
}


def _kind(row: Row) -> str:
    if row.engine == "kvpress":
        return "kvpress"
    return "speed" if row.method.startswith("speed") else "speedkv"


def _pareto_panel(ax, points: list[Row], cost: str, most: int) -> None:
    if not points:
        return
    xy = [(getattr(r, cost), 100 * r.average) for r in points]
    front = untrained_front(points, cost)
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], "-", color="grey",
            alpha=0.6, label="Pareto front (untrained rows)")  # fmt: skip
    seen: set[str] = set()
    labels: list[tuple[float, float, str]] = []
    for i, (r, (x, y)) in enumerate(zip(points, xy)):
        kind = _kind(r)
        marker, colour, legend = _KINDS[kind]
        ax.scatter(
            x, y, s=150 if kind == "speed" else 36, marker=marker, color=colour,
            edgecolors="black" if r.adapter else colour, linewidths=1.2 if r.adapter else 0.5,
            zorder=3, label=None if kind in seen else legend,
        )  # fmt: skip
        seen.add(kind)
        ax.errorbar(x, y, yerr=100 * r.margin, fmt="none", ecolor=colour, alpha=0.25, zorder=2)
        named = i in front or kind == "speed" or r.adapter or r.method in ("full", KVPRESS_NONE)
        if named:
            label = r.label if r.min_samples == most else f"{r.label} ({r.min_samples}/task)"
            labels.append((x, y, label))
    ax.grid(alpha=0.3)
    _place_labels(ax, labels)


def _place_labels(ax, labels: list[tuple[float, float, str]]) -> None:
    """Annotate each point, top to bottom, at the first of a few spots beside it (right, below
    right, left, below left, above) where its label covers no label placed before: points of
    one method in both settings, and rows at one budget, sit close together."""
    ax.figure.canvas.draw()  # fixes the limits and scales the transform below depends on
    scale = ax.figure.dpi / 72  # points to display pixels
    spots = [(4, 3, "left"), (4, -10, "left"), (-4, 3, "right"), (-4, -10, "right"),
             (4, 12, "left"), (-4, 12, "right")]  # fmt: skip
    placed: list[tuple[float, float, float, float]] = []  # label boxes, display pixels

    def box(px, py, dx, dy, align, width):
        left = px + dx * scale - (width if align == "right" else 0)
        return left, py + dy * scale, left + width, py + (dy + 7) * scale

    def free(b):
        return all(b[2] < q[0] or b[0] > q[2] or b[3] < q[1] or b[1] > q[3] for q in placed)

    for x, y, text in sorted(labels, key=lambda item: -item[1]):
        px, py = ax.transData.transform((x, y))
        width = len(text) * 6.5 * 0.55 * scale  # a label's width, near enough
        dx, dy, align = next((spot for spot in spots if free(box(px, py, *spot, width))), spots[0])
        placed.append(box(px, py, dx, dy, align, width))
        ax.annotate(
            text, (x, y), fontsize=6.5, xytext=(dx, dy), textcoords="offset points", ha=align
        )
