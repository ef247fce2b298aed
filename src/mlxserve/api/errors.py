"""The OpenAI error object for every failure, with the right status code."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


# Values a client sent are echoed at most this long: a 10 MB model name must not come back whole.
MAX_ECHO_CHARS = 200
# Backstop for a whole message (a few clipped values and the text around them).
_MAX_MESSAGE_CHARS = 2000


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text, cut to `limit` characters with a note saying how long it was."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # Any other 4xx (405, 413, 415, ...) is still the client's error, not the server's.
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    message = clip(message, _MAX_MESSAGE_CHARS)
    param = clip(param) if param is not None else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, headers=exc.headers)


def _describe(err: dict) -> tuple[str, str | None]:
    # Pydantic puts the union branch it tried into loc ("list[tagged-union[TextPart,...]]"): not a field.
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",) and "[" not in str(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 with one readable message.
        errors = exc.errors()
        # The deepest error is the specific one: for a bad content part pydantic first reports that the
        # content is not a plain string ("content.str"), which says nothing about what to fix.
        deepest = max(errors, key=lambda e: len(e.get("loc", ())), default=None)
        message, param = _describe(deepest) if deepest else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # Keeps the exception's headers: a 405 must say which methods the path takes (`Allow`).
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {exc}"))
