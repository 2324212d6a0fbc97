"""Small helpers shared by tests: step the engine by hand and keep every logit row."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
import torch

from speedkv.core.engine import Engine
from speedkv.core.policy import Policy
from speedkv.core.registry import method_class


def greedy_with_logits(engine: Engine, ids: list[int], policy: Policy, steps: int):
    """Greedy decode of `steps` tokens by hand; returns (tokens, logits [steps, V], cache)."""
    done = engine.prefill_ids(ids, policy, spare=steps)
    cache, logits = done.cache, done.logits
    rows, tokens = [logits], [int(logits.argmax())]
    for i in range(steps - 1):
        row = engine.decode_step([cache], [policy], [tokens[-1]], [len(ids) + i])[0]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(rows), cache


def document_prompt_ids(tokenizer, tokens: int, question: str) -> list[int]:
    """A chat prompt: `tokens` tokens of essay text, then `question`."""
    from speedkv.hf.text import encode_prompt
    from speedkv.prompts.haystack import haystack_text

    return encode_prompt(tokenizer, haystack_text(tokenizer, tokens) + "\n\n" + question).ids


def check_equals_hf_generate(engine: Engine, ids: list[int], specs: list[str], steps: int):
    """Each spec's greedy tokens (EOS ignored) are transformers' own greedy tokens."""
    from speedkv.core.engine import Request
    from speedkv.core.registry import make_policy
    from speedkv.core.sampling import SamplingParams

    expected = hf_generate(engine.backbone.hf_model, ids, steps, min_new_tokens=steps)
    for spec in specs:
        policy = make_policy(spec, engine.shape)
        sampling = SamplingParams(max_new_tokens=steps, ignore_eos=True)
        assert engine.generate([Request(ids, policy, sampling)])[0].output_ids == expected, spec


def check_equals_dense(engine: Engine, ids: list[int], spec: str, steps: int, atol: float):
    """The engine's greedy tokens and logits under a SPEED spec equal the dense reference."""
    from speedkv.analysis.dense import speed_dense_forward
    from speedkv.core.registry import make_policy

    policy = make_policy(spec, engine.shape)
    tokens, logits, _ = greedy_with_logits(engine, ids, policy, steps)
    rule = policy.rule
    dense, positions = speed_dense_forward(
        engine.backbone, torch.tensor(ids + tokens[:-1]), len(ids), rule.lcut, rule.anchors
    )
    dense = dense[positions >= len(ids) - 1]
    assert dense.argmax(-1).tolist() == tokens
    assert (logits - dense).abs().max() < atol


def hf_generate(hf_model, ids: list[int], new: int, **options) -> list[int]:
    """transformers' own greedy `generate` on one prompt: the new token ids (`options` are
    further `generate` arguments, e.g. min_new_tokens=new to ignore EOS)."""
    device = next(hf_model.parameters()).device
    out = hf_model.generate(
        torch.tensor([ids], device=device),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **options,
    )
    return out[0, len(ids) :].tolist()


def run_cli(args, monkeypatch, capsys, model=None):
    """Run `speedkv ARGS` in this process (with `model` instead of loading one, if given);
    return (exit code, stdout, stderr)."""
    from speedkv.cli import app as cli

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


def declared_degenerate_specs(name: str) -> tuple[str, ...]:
    """The degenerate specs a registered method declares on its own class (one inherited from
    a base class does not count: it describes another method); () if it declares none."""
    return vars(method_class(name)).get("degenerate_specs", ())


def fill_spec(template: str, layers: int, tokens: int) -> str:
    """A declared spec for a model of `layers` layers and `tokens` prompt + new tokens."""
    return template.format(L=layers, T=tokens)


def compiler_targets(*macros: str) -> bool:
    """Whether the native kernels' compiler predefines every one of `macros` for its target
    here (`"__AMX_TILE__"`, ...); False where nothing can be compiled."""
    from speedkv.kernels import native

    try:
        defined = {line.split()[0] for line in native.compiler_target()[1]}
    except native.KernelUnavailable:
        return False
    return set(macros) <= defined


def load_benchmark(name: str) -> ModuleType:
    """A script under benchmarks/ (not a package) imported as a module, for its functions."""
    return load_script("benchmarks", name)


def load_script(folder: str, name: str) -> ModuleType:
    """The script `folder/name.py` of the repository imported as a module."""
    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


# the tests' shared RULER samples (conftest's `ruler_root`): per task, and the length every
# synthetic task generates at (QA needs 2048, ruler.MIN_LENGTH)
RULER_SAMPLES = 2
RULER_SHORT = 1024


def ruler_length(task: str) -> int:
    """The length the tests generate a RULER task at: RULER_SHORT, or the task's least."""
    from speedkv.evals import ruler

    return max(RULER_SHORT, ruler.min_length(task))


def header_only_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file that declares `architecture` and holds nothing else."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(process, url: str, log=None, timeout_s: float = 600.0) -> None:
    """Poll `url`/health until the server answers 200; fail with the end of its `log` (the
    file its stderr goes to) if it exits first or never answers.

    A vLLM server's start (model load, warm-up) takes minutes on a busy 2-core machine, so the
    wait is a deadline, not a count of tries. The log is a file, never a pipe: a server that
    logs more than a pipe holds would block on it and never come up."""

    def tail() -> str:
        if log is None:
            return ""
        log.seek(0)
        return log.read()[-3000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with code {process.returncode}:\n{tail()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(process)
    pytest.fail(f"the server did not come up within {timeout_s:.0f} s:\n{tail()}")


def stop_server(process, grace_s: float = 60.0) -> None:
    """Terminate, and kill what does not stop within `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
