"""Small helpers shared by tests: step the engine by hand and keep every logit row."""

from __future__ import annotations

import sys

import torch

from speedkv.cli import app as cli
from speedkv.core.engine import Engine
from speedkv.core.policy import Policy


def greedy_with_logits(engine: Engine, ids: list[int], policy: Policy, steps: int):
    """Greedy decode of `steps` tokens by hand; returns (tokens, logits [steps, V], cache)."""
    done = engine.prefill(ids, policy, spare=steps)
    cache, logits = done.cache, done.logits
    rows, tokens = [logits], [int(logits.argmax())]
    for i in range(steps - 1):
        row = engine.decode_step([cache], [policy], [tokens[-1]], [len(ids) + i])[0]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(rows), cache


def run_cli(args, monkeypatch, capsys, model=None):
    """Run `speedkv ARGS` in this process (with `model` instead of loading one, if given);
    return (exit code, stdout, stderr)."""
    if model is not None:
        monkeypatch.setattr("speedkv.hf.loading.load_model", lambda *a, **k: model)
    monkeypatch.setattr(sys, "argv", ["speedkv", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err
