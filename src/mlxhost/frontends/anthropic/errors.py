"""Errors in Anthropic's shape on /v1/messages paths: `{"type": "error", "error": {"type", "message"}}`,
for the handlers' errors and the gate's refusals alike (registered with common/errors.py)."""

from __future__ import annotations

from fastapi import FastAPI

from mlxhost.frontends.common.errors import ErrorShape, register_error_shape

PREFIX = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def anthropic_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    # Anthropic's shape has no param (nor code): a param the message does not name goes in front of it.
    if param and not any(p in message for p in param.split(", ")):
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ANTHROPIC_ERRORS = ErrorShape("anthropic", is_anthropic_path, anthropic_error)


def install_anthropic_errors(app: FastAPI) -> None:
    """Errors on /v1/messages paths in Anthropic's shape (same status and headers, e.g. Retry-After).
    Call it after the app's own handlers."""
    register_error_shape(app, ANTHROPIC_ERRORS)
