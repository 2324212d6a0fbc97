"""`speedkv serve`: the OpenAI-compatible server on one model."""

from __future__ import annotations

from pathlib import Path

import typer

from speedkv.cli.common import MODEL_HELP, THREADS_HELP, check_adapter, load, set_threads
from speedkv.errors import UserError
from speedkv.log import log as _log

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


commands = typer.Typer()


@commands.command()
def serve(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    method: str = typer.Option(
        "full",
        "--method",
        help="Method of requests that do not choose one, e.g. 'speed:lcut=22,anchors=bos'.",
    ),
    fixed_method: bool = typer.Option(
        False,
        "--fixed-method",
        help="Refuse per-request methods (the body field speedkv.method).",
    ),
    adapter: Path | None = typer.Option(
        None, "--adapter", help="LoRA adapter from `speedkv train`, merged into the model."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to bind; loopback only by default."
    ),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    max_batch: int = typer.Option(16, "--max-batch", help="Sequences decoding together."),
    max_queue: int = typer.Option(
        64, "--max-queue", help="Sequences waiting for a batch slot; more are answered 429."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, "--max-prompt-tokens", help="Longest prompt accepted (default: the context)."
    ),
    max_tokens_limit: int | None = typer.Option(
        None, "--max-tokens-limit", help="Largest max_tokens a request may ask for."
    ),
    max_body_bytes: int = typer.Option(
        4 * 2**20, "--max-body-bytes", help="Largest request body, in bytes."
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="SPEEDKV_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/ routes (or set SPEEDKV_API_KEY).",
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    log_level: str = typer.Option(
        "info", "--log-level", help="uvicorn log level: critical, error, warning, info."
    ),
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with
    continuous batching, plus /metrics (Prometheus) and /health."""
    import uvicorn

    from speedkv.core.engine import Engine
    from speedkv.server.app import create_app
    from speedkv.server.config import ServerConfig

    check_adapter(adapter)
    set_threads(threads)  # the scheduler thread inherits it
    if not 0 <= port <= 65535:
        raise UserError(f"port must be between 0 and 65535, got {port}")
    if log_level not in {"critical", "error", "warning", "info", "debug"}:
        raise UserError(
            f"log-level must be critical, error, warning, info or debug, got '{log_level}'"
        )
    config = ServerConfig(
        model_name=model,
        method=method,
        fixed_method=fixed_method,
        max_batch=max_batch,
        max_queue=max_queue,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
    ).check()  # mistakes fail before the model loads
    if host not in LOOPBACK and not api_key:
        _log(f"warning: binding {host} without --api-key; anyone who can reach it may use it")
    loaded = load(model, dtype, device, adapter, method)
    config.model_name = loaded.name
    app_ = create_app(Engine(loaded), config)
    _log(
        f"serving '{loaded.name}' ({loaded.dtype_name}) with "
        f"{config.method} on http://{host}:{port}/v1; max batch {max_batch}, "
        f"queue {max_queue}"
    )
    uvicorn.run(app_, host=host, port=port, log_level=log_level, access_log=False)
