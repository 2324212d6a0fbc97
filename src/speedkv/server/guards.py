"""Checks that run before a request body is parsed, as ASGI middleware: the API key (a client
without it learns nothing about what its request would have done) and the body size (a huge
body is refused before it is held in memory)."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speedkv.server.errors import APIError

PROTECTED_PREFIX = "/v1/"  # /health and /metrics stay open, as in vLLM


class RequireAPIKey:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            given = Headers(scope=scope).get("authorization")
            if given is None:
                error = APIError(
                    401,
                    "no API key given; send the header 'Authorization: Bearer YOUR_KEY'",
                    code="invalid_api_key",
                )
            # constant-time comparison: response timing must not reveal a key prefix
            elif not hmac.compare_digest(given.strip().encode(), self.expected):
                error = APIError(401, "incorrect API key provided", code="invalid_api_key")
            else:
                error = None
            if error is not None:
                error.headers = {"WWW-Authenticate": "Bearer"}
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """413 for a body over `limit` bytes: at once when Content-Length says so, else as soon as
    the streamed (chunked) body passes it."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await self.too_large().response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, self.too_large().message)
            return message

        await self.app(scope, counted, send)

    def too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than this server's limit of {self.limit} bytes"
        )
