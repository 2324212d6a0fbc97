"""What every command shares: help texts, stderr messages, threads, loading a model with an
optional adapter. Faces import it; it imports the heavy modules only when called."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .errors import UserError

MODEL_HELP = "Embedded model name (smollm2-135m, qwen2.5-coder-0.5b), HF directory or .gguf file."
THREADS_HELP = (
    "CPU threads for torch (0 = torch's default). On a CPU shared with other jobs, 1 is often "
    "faster than oversubscribed cores."
)


def log(message: str, source: str = "speedkv") -> None:
    """A progress line on stderr, tagged with what speaks (stdout stays for results)."""
    print(f"[{source}] {message}", file=sys.stderr, flush=True)


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
        from .train.adapters import read_adapter_info

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
    from .models import load_model

    log(f"loading {model}")
    loaded = load_model(model, dtype=dtype, device=device)
    if adapter is not None:
        from .train.adapters import apply_adapter

        loaded = apply_adapter(loaded, adapter, method)
    return loaded


def command_line() -> str:
    """This invocation as a line a user can paste back into a shell (specs quoted)."""
    return shlex.join(["speedkv", *sys.argv[1:]])
