"""Between a queued job and its HTTP response: wait for tokens, notice a client that went
away (its sequences are cancelled and their KV freed), and shape the answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from speedkv.core.engine import Generation, TokenEvent
from speedkv.server.errors import APIError, error_body
from speedkv.server.prepare import Prepared
from speedkv.server.scheduler import Failure, Job, QueueFull, Scheduler, ShuttingDown
from speedkv.server.streaming import Formatter, sse

_GONE = (-1, None)  # queued by the watcher when the client disconnects


class Session:
    """One job from submission to its last token; `close()` is safe to call twice."""

    def __init__(self, scheduler: Scheduler, request: Request, prepared: Prepared, arrival: float):
        self.scheduler = scheduler
        self.prepared = prepared
        self.job = Job(prepared.requests, asyncio.get_running_loop(), arrival)
        self.finished = False
        try:
            scheduler.submit(self.job)
        except QueueFull as err:
            raise APIError(
                429,
                f"the server is busy: its queue of {scheduler.max_queue} waiting sequences "
                "is full; retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from err
        except ShuttingDown as err:
            raise APIError(503, "the server is shutting down", type="server_error") from err
        self.watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        """The body is already read, so the next ASGI message is the disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.scheduler.cancel(self.job)
        self.job.events.put_nowait(_GONE)

    async def next(self) -> tuple[int, TokenEvent | Failure | None]:
        return await self.job.events.get()

    def close(self) -> None:
        self.watcher.cancel()
        if not self.finished:
            self.finished = True
            self.scheduler.cancel(self.job)


def failure_error(failure: Failure) -> APIError:
    kind = "invalid_request_error" if failure.status < 500 else "server_error"
    return APIError(failure.status, failure.message, type=kind)


async def respond(
    scheduler: Scheduler,
    request: Request,
    prepared: Prepared,
    arrival: float,
    chat: bool,
    model: str,
) -> Response:
    """Queue the request and answer it: one JSON body, or an SSE stream of chunks."""
    session = Session(scheduler, request, prepared, arrival)
    formatter = Formatter(chat, model, prepared.choices)
    try:
        first = await session.next()
        if isinstance(first[1], Failure):  # fails before any token: still a plain HTTP error
            raise failure_error(first[1])
        if prepared.stream:
            stream = _stream(session, formatter, first)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return await _collect(session, formatter, first)
    except BaseException:
        session.close()
        raise


async def _collect(session: Session, formatter: Formatter, item) -> JSONResponse:
    count = len(session.job.requests)
    texts = [""] * count
    results: list[Generation | None] = [None] * count
    try:
        while True:
            index, event = item
            if event is None:  # the client left; nobody will read the answer
                return JSONResponse(error_body("client disconnected"), status_code=499)
            if isinstance(event, Failure):
                raise failure_error(event)
            texts[index] += event.text
            if event.finished is not None:
                results[index] = event.finished
                if all(r is not None for r in results):
                    session.finished = True
                    break
            item = await session.next()
    finally:
        session.close()
    body = formatter.complete(texts, results, session.prepared.prompt_tokens)  # type: ignore[arg-type]
    return JSONResponse(body)


async def _stream(session: Session, formatter: Formatter, item) -> AsyncIterator[str]:
    count = len(session.job.requests)
    results: list[Generation | None] = [None] * count
    try:
        for index in range(count):
            opening = formatter.opening(index)
            if opening is not None:
                yield sse(opening)
        while True:
            index, event = item
            if event is None:
                return
            if isinstance(event, Failure):  # headers are sent: report it in the stream
                error = failure_error(event)
                yield sse(error_body(error.message, error.type))
                return
            if event.text:
                yield sse(formatter.delta(index, event.text))
            if event.finished is not None:
                results[index] = event.finished
                yield sse(formatter.finish(index, event.finished))
                if all(r is not None for r in results):
                    session.finished = True
                    break
            item = await session.next()
        if session.prepared.include_usage:
            yield sse(formatter.usage_chunk(session.prepared.prompt_tokens, results))
        yield sse("[DONE]")
    finally:
        session.close()
