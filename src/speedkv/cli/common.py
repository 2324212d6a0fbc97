"""What every command shares: help texts, stderr messages, threads, loading a model with an
optional adapter. Faces import it; it imports the heavy modules only when called."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from speedkv.errors import UserError
from speedkv.log import log

MODEL_HELP = "Embedded model name (smollm2-135m, qwen2.5-coder-0.5b), HF directory or .gguf file."
THREADS_HELP = (
    "CPU threads for torch (0 = torch's default). On a CPU shared with other jobs, 1 is often "
    "faster than oversubscribed cores."
)


def set_threads(threads: int | None) -> None:
    """0 or None keeps torch's default; a positive count sets it (worker threads inherit it)."""
    if threads is None or threads == 0:
        return
    if threads < 0:
        raise UserError(f"threads must be 0 (torch's default) or a positive count, got {threads}")
    import torch

    torch.set_num_threads(threads)


def check_adapter(adapter: Path | None) -> None:
    """Fail on a directory that holds no adapter before any model is loaded."""
    if adapter is not None:
        from speedkv.hf.adapters import read_adapter_info

        read_adapter_info(adapter)


def load(
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    adapter: Path | None = None,
    method: str | None = None,
):
    """The model, with a LoRA adapter merged into it when one is given (warning when the
    adapter was trained for another method than `method`)."""
    from speedkv.hf.loading import load_model

    log(f"loading {model}")
    loaded = load_model(model, dtype=dtype, device=device)
    if adapter is not None:
        from speedkv.hf.adapters import apply_adapter, read_adapter_info

        loaded = apply_adapter(loaded, adapter)
        info = read_adapter_info(adapter)
        warning = method_mismatch(info, method, loaded.shape) if method else None
        if warning:
            log(f"warning: {warning}")
    return loaded


def command_line() -> str:
    """This invocation as a line a user can paste back into a shell (specs quoted)."""
    return shlex.join(["speedkv", *sys.argv[1:]])


def method_mismatch(info: dict, method_spec: str, shape) -> str | None:
    """A warning when `method_spec` is not the method the adapter was trained for."""
    from speedkv.core.registry import make_policy

    trained = info.get("method")
    if not trained:
        return None
    wanted = make_policy(method_spec, shape).spec()
    if wanted == trained:
        return None
    return (
        f"the adapter was trained for '{trained}' but runs with '{wanted}'; "
        "its quality was measured only for the method it was trained for"
    )


METHOD_HELP = (
    "Method spec, e.g. 'full', 'speed:lcut=22,anchors=bos', "
    "'speed:lcut=22,anchors=sink:4,deep=header,selfonly=true'."
)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise UserError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise UserError(f"prompt file '{prompt_file}' does not exist")
        prompt = prompt_file.read_text(encoding="utf-8")
    elif prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is None or not prompt.strip():
        raise UserError("the prompt is empty; give some text or a --prompt-file")
    return prompt
