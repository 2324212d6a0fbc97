"""What commands do alike once their options are parsed: threads, the model their options ask
for (built by hf/build.py), binding a method to it, reading the user's files. Heavy modules
are imported only when called."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class ModelArgs:
    """The model options a command was given (cli/options.py's `model_options` declares them
    once): `options` for hf/build.py, and what the command does around the build."""

    options: ModelOptions  # an option the command does not take keeps ModelOptions' default
    threads: int = 0
    backend: str = "speedkv"
    vllm_args: list[str] = field(default_factory=list)

    def build(self, **changes: Any) -> LoadedModel:
        """The model speedkv's engine runs, torch's threads set first (so worker threads
        inherit them); `changes` replace options the command fixes itself."""
        from speedkv.hf.build import build_model

        set_threads(self.threads)
        return build_model(dataclasses.replace(self.options, **changes))


def bind(method: MethodSpec, loaded: LoadedModel) -> Policy:
    """`method` bound to the loaded model. On adapted weights a SPEED spec takes what it leaves
    unset from the adapter's training (`fit_to_adapter`, which also warns about an option set
    otherwise), and another method than the one trained for gets a warning."""
    from speedkv.core.registry import make_policy
    from speedkv.core.spec import split_spec

    policy = make_policy(method, loaded.shape, loaded.trained_method)
    trained = loaded.trained_method
    if trained and split_spec(trained)[0] != policy.name:
        log(
            f"warning: the adapter was trained for '{trained}' but runs with '{policy.spec()}'; "
            "its quality was measured only for the method it was trained for"
        )
    return policy


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


def on_adapter(options: ModelOptions, method: MethodSpec) -> MethodSpec:
    """`method` as it runs on the options' adapter, for vLLM's backend, whose merged model
    keeps no record of its training: a SPEED spec takes what it leaves unset from the method
    the adapter was trained for (speedkv's engine does the same from the adapted model)."""
    if options.adapter is None:
        return method
    from speedkv.core.registry import fit_to_adapter
    from speedkv.hf.adapters import read_adapter_info

    return fit_to_adapter(method, read_adapter_info(options.adapter).get("method"))


def vllm_model(options: ModelOptions, method: str) -> VllmModel:
    """What vLLM loads for `--backend vllm`, once the method is known to run there: the
    model's own HF directory, or a copy with the adapter merged into its weights."""
    from speedkv.hf.build import build_vllm_model
    from speedkv.vllm.args import engine_args, require_vllm

    require_vllm()
    # refuses what vLLM cannot run before anything starts
    return build_vllm_model(options, check=lambda directory: engine_args(method, directory))
