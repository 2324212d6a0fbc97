"""The one exception type for user mistakes (bad spec, bad path, bad option value).

Faces catch it: the CLI prints its message as one sentence and exits with code 2, the server
answers HTTP 400. Anything else escaping is a bug and keeps its traceback.
"""


def last_said(stderr: str, returncode: int | None) -> str:
    """Why a process failed: the last line it wrote to stderr, or its exit code."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {returncode}"


class UserError(ValueError):
    """A mistake in what the user asked for; the message says what is wrong and what is allowed."""


class Unsupported(RuntimeError):
    """A configuration speedkv refuses because it cannot run it correctly (for example a vLLM
    feature the SPEED plugin does not support); the message names it in one sentence. Faces
    treat it like a UserError. A RuntimeError, not a ValueError: vLLM builds its configuration
    with pydantic, which folds a ValueError raised inside into a multi-line validation report."""
