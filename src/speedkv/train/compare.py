"""Quality against training time across runs: the probe points of finished or running runs
(`speedkv train-compare`), read from what the trainer already wrote."""

from __future__ import annotations

import json
from pathlib import Path

from speedkv.core.spec import split_spec
from speedkv.errors import UserError
from speedkv.hf.adapters import INFO_NAME

X_AXES = {"minutes": ("wall_min", "training wall minutes"), "step": ("step", "optimizer step")}


def run_probes(run: Path) -> dict:
    """The method and probe points of a run directory, a checkpoint or a shipped adapter.

    A finished run keeps its history in `training.json`; a run still going has it only in
    its latest checkpoint's `trainer_state.json`, so that is read instead.
    """
    info_path = run / INFO_NAME
    info = _read_json(info_path) if info_path.is_file() else None
    history = (info or {}).get("log_history")
    if history is None:
        checkpoint = _latest_checkpoint(run)
        if checkpoint is None:
            raise UserError(f"'{run}' holds no training run (no {INFO_NAME} and no checkpoints)")
        history = _read_json(checkpoint / "trainer_state.json")["log_history"]
        info = info or _read_json(checkpoint / INFO_NAME)
    points = [
        {
            "step": int(h["step"]),
            "wall_min": round(h["wall_s"] / 60, 1),
            "passkey_acc": h["probe_passkey_acc"],
            "ppl": h["probe_ppl"],
        }
        for h in history
        if "probe_ppl" in h
    ]
    if not points:
        raise UserError(f"'{run}' has no probe points; it was trained without --probe-every")
    finished = info.get("status") == "done"
    return {"run": str(run), "method": info["method"], "finished": finished, "probes": points}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):  # a binary file fails to decode
        raise UserError(
            f"'{path}' is not valid JSON; it is not what a training run wrote"
        ) from None


def _latest_checkpoint(run: Path) -> Path | None:
    """The checkpoint itself, or a run's highest-numbered one (the trainer's own naming)."""
    if (run / "trainer_state.json").is_file():
        return run
    checkpoints = [p for p in run.glob("checkpoints/checkpoint-*") if p.name[11:].isdigit()]
    return max(checkpoints, key=lambda p: int(p.name[11:]), default=None)


def _short_method(run: dict) -> str:
    """'full', or the cutoff and anchor that tell runs apart: 'speed:lcut=22,anchors=bos'."""
    name, options = split_spec(run["method"])
    shown = [f"{key}={options[key]}" for key in ("lcut", "anchors") if key in options]
    return f"{name}:{','.join(shown)}" if shown else name


def run_label(run: dict) -> str:
    """Short legend text: the directory name, the method's cutoff and its anchor."""
    state = "" if run["finished"] else ", unfinished"
    return f"{Path(run['run']).name} ({_short_method(run)}{state})"


def probe_table(runs: list[dict]) -> str:
    """A markdown table: one row per run and probe step."""
    lines = [
        "| run | method | step | wall min | passkeys | perplexity |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        name, method = Path(run["run"]).name, _short_method(run)
        for p in run["probes"]:
            lines.append(
                f"| {name} | {method} | {p['step']} | {p['wall_min']:.1f} | "
                f"{p['passkey_acc']:.2f} | {p['ppl']:.2f} |"
            )
    return "\n".join(lines)
