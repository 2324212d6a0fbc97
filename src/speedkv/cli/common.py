"""What commands do alike once their options are parsed: threads, the model their options ask
for (built by hf/build.py), binding a method to it, reading the user's files. Heavy modules
are imported only when called."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.core.policy import Policy
    from speedkv.core.registry import MethodSpec
    from speedkv.hf.build import ModelOptions, VllmModel
    from speedkv.hf.loading import LoadedModel


def set_threads(threads: int | None) -> None:
    """0 or None keeps torch's default; a positive count sets it (worker threads inherit it).
    The --threads option has checked the count."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def bind(method: MethodSpec, loaded: LoadedModel, adapter: Path | None = None) -> Policy:
    """`method` bound to the loaded model, with a warning when `adapter` was trained for
    another method."""
    policy = method.bind(loaded.shape)
    if adapter is not None:
        from speedkv.hf.adapters import read_adapter_info

        warning = method_mismatch(read_adapter_info(adapter), policy)
        if warning:
            log(f"warning: {warning}")
    return policy


def method_mismatch(info: dict, policy: Policy) -> str | None:
    """A warning when `policy` does not run the method the adapter was trained for."""
    trained = info.get("method")
    if not trained or policy.spec() == trained:
        return None
    return (
        f"the adapter was trained for '{trained}' but runs with '{policy.spec()}'; "
        "its quality was measured only for the method it was trained for"
    )


def command_line() -> str:
    """This invocation as a line a user can paste back into a shell (specs quoted)."""
    return shlex.join(["speedkv", *sys.argv[1:]])


# -- the user's files --------------------------------------------------------------------------
def read_text_file(path: Path, what: str, empty: str = "is empty") -> str:
    """The text of a UTF-8 file the user named. Each way it can fail is one sentence naming
    `what` it is: missing, a directory, unreadable, not UTF-8 (binary), or blank (`empty`)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # a dangling link too
        raise UserError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{what} '{path}' is a directory; give a file") from None
    except OSError as err:
        raise UserError(f"{what} '{path}' cannot be read ({err.strerror or err})") from None
    try:
        text: str | None = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:  # NUL is valid UTF-8, but only binary files hold it
        raise UserError(f"{what} '{path}' is not UTF-8 text")
    if not text.strip():
        raise UserError(f"{what} '{path}' {empty}")
    return text


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt: the argument, the --prompt-file, or standard input when piped."""
    if prompt is not None and prompt_file is not None:
        raise UserError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        return read_text_file(prompt_file, "prompt file")
    if prompt is None and not sys.stdin.isatty():
        try:
            prompt = sys.stdin.read()
        except UnicodeDecodeError:
            raise UserError("the prompt on standard input is not UTF-8 text") from None
    if prompt is None or not prompt.strip():
        raise UserError("the prompt is empty; give some text or a --prompt-file")
    return prompt


def read_prompt_lines(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one prompt each."""
    text = read_text_file(path, "prompt file", empty="has no prompts (one per line)")
    return [line.strip() for line in text.splitlines() if line.strip()]


def vllm_model(options: ModelOptions, method: str) -> VllmModel:
    """What vLLM loads for `--backend vllm`, once the method is known to run there: the
    model's own HF directory, or a copy with the adapter merged into its weights."""
    from speedkv.hf.build import build_vllm_model
    from speedkv.vllm.args import engine_args, require_vllm

    require_vllm()
    # refuses what vLLM cannot run before anything starts
    return build_vllm_model(options, check=lambda directory: engine_args(method, directory))
