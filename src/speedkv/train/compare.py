"""Quality against training time across runs: the probe points of finished or running runs
(`speedkv train-compare`), read from what the trainer already wrote."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from .adapters import INFO_NAME


def run_probes(run: Path) -> dict:
    """The method and probe points of a run directory, a checkpoint or a shipped adapter.

    A finished run keeps its history in `training.json`; a run still going has it only in
    its latest checkpoint's `trainer_state.json`, so that is read instead.
    """
    info_path = run / INFO_NAME
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    history = (info or {}).get("log_history")
    state = _latest_trainer_state(run)
    if history is None and state is not None:
        history = json.loads(state.read_text())["log_history"]
        if info is None:
            info = json.loads((state.parent / INFO_NAME).read_text())
    if info is None or history is None:
        raise UserError(f"'{run}' holds no training run (no {INFO_NAME} and no checkpoints)")
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


def _latest_trainer_state(run: Path) -> Path | None:
    states = list(run.glob("checkpoints/checkpoint-*/trainer_state.json"))
    states += list(run.glob("trainer_state.json"))
    if not states:
        return None
    return max(states, key=lambda p: json.loads(p.read_text()).get("global_step", 0))


def run_label(run: dict) -> str:
    """Short legend text: the directory name and the method's cutoff."""
    method = run["method"].split(",")[0]  # 'speed:lcut=22' or 'full'
    state = "" if run["finished"] else ", unfinished"
    return f"{Path(run['run']).name} ({method}{state})"


def probe_table(runs: list[dict]) -> str:
    """A markdown table: one row per run and probe step."""
    lines = [
        "| run | method | step | wall min | passkeys | perplexity |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        name = Path(run["run"]).name
        method = run["method"].split(",")[0]
        for p in run["probes"]:
            lines.append(
                f"| {name} | {method} | {p['step']} | {p['wall_min']:.1f} | "
                f"{p['passkey_acc']:.2f} | {p['ppl']:.2f} |"
            )
    return "\n".join(lines)
