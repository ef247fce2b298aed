"""Errors in Ollama's shape on /api/ paths: `{"error": "message"}`, with the status and headers of the
OpenAI-shaped error it replaces (registered with common/errors.py)."""

from __future__ import annotations

from fastapi import FastAPI

from mlxhost.frontends.common.errors import ErrorShape, register_error_shape

PREFIX = "/api/"


def is_ollama_path(path: str) -> bool:
    return path.startswith(PREFIX)


def ollama_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": message}


# The gate's refusals (401, 413, 415, 421) on /api/ paths stay in OpenAI's shape, as they always were.
OLLAMA_ERRORS = ErrorShape("ollama", is_ollama_path, ollama_error, at_gate=False)


def install_ollama_errors(app: FastAPI) -> None:
    """Errors on /api/ paths as `{"error": message}` (same status and headers), as before elsewhere. Call it
    after the app's own handlers."""
    register_error_shape(app, OLLAMA_ERRORS)
