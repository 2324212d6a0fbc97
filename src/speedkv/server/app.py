"""The HTTP routes. Handlers validate and queue; the scheduler thread does the model work."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from speedkv.core.engine import Engine
from speedkv.core.registry import method_names
from speedkv.server.config import ServerConfig
from speedkv.server.errors import APIError, install_error_handlers
from speedkv.server.guards import LimitBody, RequireAPIKey
from speedkv.server.metrics import ServerMetrics
from speedkv.server.prepare import Preparer
from speedkv.server.relay import respond
from speedkv.server.scheduler import Scheduler
from speedkv.server.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
)
from speedkv.version import __version__

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}


def _generation_responses(model: type) -> dict:
    ok = {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **_ERRORS}


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """An app serving `engine`; its scheduler thread runs between startup and shutdown.

    An engine without a prefix cache gets the one `config` asks for (none when its
    prefix_cache_bytes is 0); one given its own keeps it. Either way the scheduler thread
    alone uses it from now on."""
    config.validate(engine.shape, engine.model.trained_method)
    if engine.prefix_cache is None:
        engine.prefix_cache = config.prefix_cache()
    store = engine.prefix_cache
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, config.max_batch, config.max_queue, metrics)
    preparer = Preparer(engine, config)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(
        title="speedkv",
        version=__version__,
        summary="OpenAI-compatible server for SPEED and peer KV-cache methods",
        lifespan=lifespan,
        strict_content_type=False,  # a JSON body without Content-Type (curl -d ...) is fine
    )
    app.state.scheduler, app.state.metrics, app.state.config = scheduler, metrics, config
    install_error_handlers(app)
    app.add_middleware(LimitBody, limit=config.max_body_bytes)
    if config.api_key:  # added last, so it runs first
        app.add_middleware(RequireAPIKey, api_key=config.api_key)

    @app.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
    async def health():
        if not scheduler.alive:
            raise APIError(503, "the scheduler is not running", type="server_error")
        running, waiting = scheduler.counts()
        return {"status": "ok", "model": config.model_name, "running": running, "waiting": waiting}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {metrics.content_type: {"schema": {"type": "string"}}}}},
    )
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    def card() -> dict:
        return {
            "id": config.model_name,
            "object": "model",
            "created": started,
            "owned_by": "speedkv",
            "speedkv": {
                "method": config.method,
                "per_request_methods": not config.fixed_method,
                "methods": method_names(),
                "context": engine.shape.max_positions,
                "max_prompt_tokens": config.max_prompt_tokens,
                "max_tokens_limit": config.max_tokens_limit,
                # the store's bounds: set once, so safe to read outside the scheduler thread
                "prefix_cache_bytes": store.max_bytes if store is not None else 0,
                "prefix_min_tokens": store.min_tokens if store is not None else None,
            },
        }

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str):
        if model_id != config.model_name:
            raise APIError(
                404, f"The model '{model_id}' does not exist", "model", "model_not_found"
            )
        return card()

    @app.post("/v1/completions", response_model=None, responses=_generation_responses(Completion))
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        prepared = await run_in_threadpool(preparer.completion, body)
        return await respond(scheduler, request, prepared, arrival, False, config.model_name)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=_generation_responses(ChatCompletion),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        prepared = await run_in_threadpool(preparer.chat, body)
        return await respond(scheduler, request, prepared, arrival, True, config.model_name)

    _tune_openapi(app, config.model_name)
    return app


def _tune_openapi(app: FastAPI, model_name: str) -> None:
    """Validation errors are answered 400 (OpenAI's status), so the spec must not promise 422;
    and `model` can only be the served model, which the spec says (so clients and fuzzers
    generated from it send requests that reach the model)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                components[name]["properties"]["model"]["enum"] = [model_name]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
