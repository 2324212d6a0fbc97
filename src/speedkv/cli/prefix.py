"""`speedkv prefill`: prefill a document once and save its cache, which `speedkv generate
--load` continues with any number of questions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from speedkv.cli.common import ModelArgs, bind, read_prompt
from speedkv.cli.options import AsJson, Method, PromptFile, Raw, SaveFile, model_options
from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.core.engine import Engine, Request
    from speedkv.core.registry import MethodSpec
    from speedkv.core.sampling import SamplingParams

commands = typer.Typer()


@commands.command()
@model_options("adapter", "dtype", "weights", "device", "threads")
def prefill(
    *,
    save: SaveFile,
    prompt: Annotated[
        str | None, typer.Argument(help="The document (or use --prompt-file, or pipe it in).")
    ] = None,
    prompt_file: PromptFile = None,
    model: ModelArgs,
    method: Method = "full",
    raw: Raw = False,
    as_json: AsJson = False,
) -> None:
    """Prefill a document once and save its cache to a file; `speedkv generate --load FILE
    "question"` then asks it questions without prefilling it again. Through the chat template
    the document is a user message of its own, and each question the next one.

    Only methods whose cache does not depend on the question can be saved (full, speed). The
    file works only with the model, adapter and dtype that made it."""
    from speedkv.core.engine import Engine, check_reusable
    from speedkv.core.prefix_file import save_prefix

    check_reusable(method.cls)
    text = read_prompt(prompt, prompt_file)
    loaded = model.build()
    policy = bind(method, loaded)
    engine = Engine(loaded)
    cached = engine.prefill(text, policy, chat=not raw)
    file_bytes = save_prefix(cached, save, engine)
    if as_json:
        record = {
            "model": loaded.name,
            "method": cached.method,
            "dtype": loaded.dtype_name,
            "path": str(save),
            "file_bytes": file_bytes,
            "chat": cached.messages is not None,
            "prompt_ids": cached.ids,
            "ttft_s": cached.ttft_s,
            "kv_bytes": cached.nbytes(),
            "layer_lengths": cached.cache.lengths(),
        }
        print(json.dumps(record))
        return
    kind = "chat" if cached.messages is not None else "raw text"
    log(
        f"{len(cached.ids)} tokens ({kind}) prefilled in {cached.ttft_s:.3f} s with "
        f"{cached.method}: KV {cached.nbytes() / 2**20:.2f} MiB, "
        f"file {file_bytes / 2**20:.2f} MiB"
    )
    print(save)


def continue_saved(
    engine: Engine,
    path: Path,
    question: str,
    sampling: SamplingParams,
    method: MethodSpec | None,
    raw: bool,
) -> Request:
    """The request continuing the cache saved at `path` with `question`. A --method given
    must be the one the cache was made with, and --raw must say what the file holds."""
    from speedkv.core.prefix_file import load_prefix
    from speedkv.core.registry import parse_spec

    cached = load_prefix(path, engine)
    policy = bind(method or parse_spec(cached.method), engine.model)
    if policy.spec() != cached.method:
        raise UserError(
            f"'{path}' was prefilled with '{cached.method}'; leave out --method or give that "
            f"one, not '{policy.spec()}'"
        )
    if cached.messages is not None and raw:
        raise UserError(
            f"'{path}' holds a chat conversation, so the question is its next user message; "
            "leave out --raw"
        )
    if cached.messages is None and not raw and getattr(engine.tokenizer, "chat_template", None):
        raise UserError(f"'{path}' holds raw text (prefilled with --raw); continue it with --raw")
    return engine.continuation(cached, question, sampling)
