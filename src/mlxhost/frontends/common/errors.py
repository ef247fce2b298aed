"""Every failure as an error object with the right status code: OpenAI's shape by default, and the shape a
dialect registers (`register_error_shape`) on the paths it serves, for the handlers' errors and the gate's.
Each is rendered once, from the typed `APIError` (serving/errors.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxhost.engine.loop import EngineClosedError
from mlxhost.engine.request import RequestOutput
from mlxhost.serving.errors import APIError, clip
from mlxhost.structured.grammar import GrammarFailure

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}
# Backstop for a whole message (a few clipped values and the text around them).
_MAX_MESSAGE_CHARS = 2000


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    # Any other 4xx (405, 413, 415, ...) is still the client's error, not the server's.
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = error_type(status)
    message = clip(message, _MAX_MESSAGE_CHARS)
    param = clip(param) if param is not None else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def output_error(out: RequestOutput) -> APIError:
    """The typed error of an engine output that ended its request with an error, whichever dialect answers it:
    ended by the server (shutdown, a lost rank) a 503; its own grammar's dead end a 400 no retry helps; else a 500."""
    if out.finish_reason:
        return APIError(503, out.error, code="server_shutting_down")
    if isinstance(out.error, GrammarFailure):
        return APIError(400, out.error, code="grammar_failed")
    log.error("request %s failed: %s", out.request_id, out.error)
    return APIError(500, out.error)


def error_response(request: Request, exc: APIError) -> JSONResponse:
    """`exc` in the shape registered for the request's path (OpenAI's elsewhere): its one rendering."""
    body = error_shapes(request.app).body(request.url.path, exc.status, exc.message, exc.param, exc.code)
    return JSONResponse(body, exc.status, headers=exc.headers)


def _location(err: dict) -> list[str]:
    # Pydantic puts the union branch it tried into loc ("list[tagged-union[TextPart,...]]"): not a field.
    return [str(p) for p in err.get("loc", ()) if p not in ("body",) and "[" not in str(p)]


def _describe(err: dict) -> tuple[str, str | None]:
    param = ".".join(_location(err)) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    return (f"{param}: {msg}" if param else msg), param


def describe_errors(errors: list[dict]) -> tuple[str, str | None]:
    """Every offending field in one message, and the fields as `param` (comma-separated when several).

    A field's problems are grouped (a top-level field, or one item of a list field: `messages.3`) and
    the deepest one is told: for a bad content part pydantic also reports that the content is not a
    plain string ("content.str"), which says nothing about what to fix."""
    groups: dict[tuple, dict] = {}
    for err in errors:
        loc = _location(err)
        key = tuple(loc[:2]) if len(loc) > 1 and loc[1].isdigit() else tuple(loc[:1])
        best = groups.get(key)
        if best is None or len(err.get("loc", ())) > len(best.get("loc", ())):
            groups[key] = err
    described = [_describe(e) for e in groups.values()] or [("invalid request", None)]
    if len(described) == 1:
        return described[0]
    params = [p for _, p in described if p]
    return (f"{len(described)} problems: " + "; ".join(m for m, _ in described)), ", ".join(params) or None


def _log_refusal(request: Request, status: int, message: str) -> None:
    # Info, not warning: the client's mistake, but the one place an operator sees why an agent stalls.
    log.info("%s %s -> %d: %s", request.method, request.url.path, status, clip(message, _MAX_MESSAGE_CHARS))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if 400 <= exc.status < 500:
            _log_refusal(request, exc.status, exc.message)
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # FastAPI answers 422; OpenAI clients expect 400 with one readable message naming every field.
        message, param = describe_errors(list(exc.errors()))
        _log_refusal(request, 400, message)
        return error_response(request, APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # Keeps the exception's headers: a 405 must say which methods the path takes (`Allow`).
        return error_response(request, APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(EngineClosedError)
    async def _engine_closed(request: Request, exc: EngineClosedError):
        # A call on the engine thread cut off by the shutdown deadline (a step may never end): the client
        # learns why, as a stream ended then does.
        return error_response(request, APIError(503, str(exc), code="server_shutting_down"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(request, APIError(500, f"internal error: {exc}"))


@dataclass(frozen=True)
class ErrorShape:
    """How one dialect writes an error body, on the paths it serves."""

    name: str
    matches: Callable[[str], bool]  # the request path is this dialect's
    body: Callable[[int, str, "str | None", "str | None"], dict]  # (status, message, param, code) -> body
    at_gate: bool = True  # also for the gate's refusals (security.py: 401, 413, 415, 421)


class ErrorShapes:
    """The shapes the app's dialects registered; OpenAI's (`error_body`) on every other path."""

    def __init__(self) -> None:
        self._shapes: list[ErrorShape] = []

    def register(self, shape: ErrorShape) -> None:
        self._shapes.append(shape)

    def find(self, path: str, gate: bool = False) -> ErrorShape | None:
        return next((s for s in self._shapes if (s.at_gate or not gate) and s.matches(path)), None)

    def body(self, path: str, status: int, message: str, param: str | None = None, code: str | None = None,
             gate: bool = False) -> dict:
        shape = self.find(path, gate)
        if shape is None:
            return error_body(status, message, param, code)
        return shape.body(status, clip(message, _MAX_MESSAGE_CHARS), clip(param) if param is not None else None, code)


def error_shapes(app: FastAPI) -> ErrorShapes:
    """The app's registry (one per app: a second app, in tests, has its own)."""
    shapes = getattr(app.state, "error_shapes", None)
    if shapes is None:
        shapes = app.state.error_shapes = ErrorShapes()
    return shapes


def register_error_shape(app: FastAPI, shape: ErrorShape) -> None:
    """Errors on `shape`'s paths come in its shape: every exception handler's and the gate's (same status and
    headers, e.g. Retry-After), rendered once from the typed error (`error_response`)."""
    error_shapes(app).register(shape)
