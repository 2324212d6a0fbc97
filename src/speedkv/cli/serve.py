"""`speedkv serve`: the OpenAI-compatible server on one model."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from speedkv.cli.common import ModelArgs, bind, on_adapter, set_threads, vllm_model
from speedkv.cli.options import count_option, model_options, parsed_option
from speedkv.core.registry import MethodSpec, parse_spec
from speedkv.errors import UserError
from speedkv.log import log as _log

if TYPE_CHECKING:
    from speedkv.hf.build import ModelOptions

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DefaultMethod = Annotated[
    MethodSpec,
    parsed_option(
        "--method",
        parse=parse_spec,
        metavar="SPEC",
        help="Method of requests that do not choose one, e.g. 'speed:lcut=22,anchors=bos'.",
    ),
]
PrefixCacheBytes = Annotated[
    int,
    count_option(
        "--prefix-cache-bytes",
        least=0,
        rule="0 (no prefix caching) or more",
        help="Memory for cached prompts (automatic prefix caching), in bytes; the least "
        "recently used go past it. 0 turns caching off.",
    ),
]
PrefixMinTokens = Annotated[
    int,
    count_option(
        "--prefix-min-tokens",
        least=1,
        help="Shortest cached prefix a prompt reuses; shorter shared beginnings are prefilled.",
    ),
]


commands = typer.Typer()


@commands.command()
@model_options(
    "adapter", "dtype", "weights", "prepack", "device", "threads", "backend", "vllm_arg",
    before={"adapter": "host", "dtype": "log_level", "backend": None},
)  # fmt: skip
def serve(
    *,
    model: ModelArgs,
    method: DefaultMethod = "full",
    fixed_method: Annotated[
        bool,
        typer.Option(
            "--fixed-method", help="Refuse per-request methods (the body field speedkv.method)."
        ),
    ] = False,
    host: Annotated[
        str, typer.Option("--host", help="Address to bind; loopback only by default.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    max_batch: Annotated[
        int, typer.Option("--max-batch", help="Sequences decoding together.")
    ] = 16,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue", help="Sequences waiting for a batch slot; more are answered 429."
        ),
    ] = 64,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option("--max-prompt-tokens", help="Longest prompt accepted (default: the context)."),
    ] = None,
    max_tokens_limit: Annotated[
        int | None,
        typer.Option("--max-tokens-limit", help="Largest max_tokens a request may ask for."),
    ] = None,
    max_body_bytes: Annotated[
        int, typer.Option("--max-body-bytes", help="Largest request body, in bytes.")
    ] = 4 * 2**20,
    prefix_cache_bytes: PrefixCacheBytes = 2**30,
    prefix_min_tokens: PrefixMinTokens = 16,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="SPEEDKV_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1/ routes (or set SPEEDKV_API_KEY).",
        ),
    ] = None,
    log_level: Annotated[
        str,
        typer.Option("--log-level", help="uvicorn log level: critical, error, warning, info."),
    ] = "info",
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with
    continuous batching, plus /metrics (Prometheus) and /health. With --backend vllm, vLLM's
    own OpenAI server runs the method (full or speed) through speedkv's plugin."""
    import uvicorn

    from speedkv.core.engine import Engine
    from speedkv.server.app import create_app
    from speedkv.server.config import ServerConfig

    set_threads(model.threads)  # the scheduler thread inherits it
    if not 0 <= port <= 65535:
        raise UserError(f"port must be between 0 and 65535, got {port}")
    if log_level not in {"critical", "error", "warning", "info", "debug"}:
        raise UserError(
            f"log-level must be critical, error, warning, info or debug, got '{log_level}'"
        )
    config = ServerConfig(
        model_name=model.options.model,
        method=method.text,
        fixed_method=fixed_method,
        max_batch=max_batch,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        prefix_cache_bytes=prefix_cache_bytes,
        prefix_min_tokens=prefix_min_tokens,
    ).check()  # mistakes fail before the model loads
    if host not in LOOPBACK and not api_key:
        _log(f"warning: binding {host} without --api-key; anyone who can reach it may use it")
    if model.backend == "vllm":
        serve_on_vllm(model.options, method, host, port, api_key, model.vllm_args)
        return
    loaded = model.build()
    config.model_name = loaded.name
    # canonical, and checked on the model
    config.method = bind(method, loaded).spec()
    app_ = create_app(Engine(loaded), config)
    _log(
        f"serving '{loaded.name}' ({loaded.dtype_name}) with "
        f"{config.method} on http://{host}:{port}/v1; max batch {max_batch}, "
        f"queue {max_queue}; {config.prefix_caching()}"
    )
    uvicorn.run(app_, host=host, port=port, log_level=log_level, access_log=False)


def serve_on_vllm(
    options: ModelOptions,
    method: MethodSpec,
    host: str,
    port: int,
    api_key: str | None,
    extra: list[str],
) -> None:
    """Replace this process with vLLM's OpenAI server running the method."""
    import os

    from speedkv.vllm.offline import cpu_engine_defaults
    from speedkv.vllm.serve import check_serve_command, serve_command

    method = on_adapter(options, method)
    built = vllm_model(options, method.text)
    model = options.model
    argv = serve_command(built.directory, method.text, model, built.dtype, host, port, api_key,
                         extra)  # fmt: skip
    cpu_engine_defaults(4)  # GiB: room for many requests
    check_serve_command(argv)  # what SPEED cannot run is refused here, not in vLLM's server
    _log(f"serving '{model}' with {method.text} on vLLM: {' '.join(argv[1:])}")
    sys.stdout.flush()
    os.execv(argv[0], argv)
