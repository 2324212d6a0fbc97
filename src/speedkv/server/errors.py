"""Every error leaves the server in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`, 4xx for anything the client sent."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from speedkv.errors import UserError
from speedkv.server.schemas import UNSUPPORTED

log = logging.getLogger("speedkv.server")

INVALID = "invalid_request_error"


class APIError(Exception):
    """An error answered with `status` and the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        *,
        type: str = INVALID,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


def error_body(
    message: str, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One sentence for the problem pydantic found, and the parameter it concerns."""
    if not errors:
        return "the request body is not valid", None
    first = _most_telling(errors)
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({detail})".replace(" ()", ""), None
    if not loc:
        return (
            "the request body must be a JSON object, sent with Content-Type: application/json",
            None,
        )
    fields = _fields(first)
    param = fields[0] if fields else None
    where = ".".join(fields)
    if param in UNSUPPORTED and len(fields) == 1:
        return (
            f"{param} is not supported by this server; leave it out or set it to "
            f"{UNSUPPORTED[param]}",
            param,
        )
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}", param
    if kind == "missing":
        return f"'{where}' is a required property", param
    return f"{where}: {first.get('msg', 'invalid value')}", param


def _fields(error: dict) -> list[str]:
    """The error's location without 'body' and without the type tags pydantic inserts for
    union members ('str', 'list[int]', 'constrained-str')."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    return [part for part in loc if not _is_type_tag(part)]


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "dict", "list", "none"} or any(
        mark in part for mark in "[-"
    )


def _most_telling(errors: list[dict]) -> dict:
    """A union field reports one error per member; the member whose type matched (its error
    is about a value, not a type) says what is really wrong."""
    first = errors[0]
    same_field = [e for e in errors if _fields(e)[:1] == _fields(first)[:1]]
    for error in same_field:
        if not str(error.get("type", "")).endswith("_type"):
            return error
    return first


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(UserError)
    async def _user_error(_: Request, err: UserError) -> JSONResponse:
        return JSONResponse(error_body(str(err)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(err.errors()))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(err.detail)
        return JSONResponse(
            error_body(message), status_code=err.status_code, headers=getattr(err, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _bug(_: Request, err: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=err)
        return JSONResponse(
            error_body("the server hit an internal error; see its log", "server_error"),
            status_code=500,
        )
