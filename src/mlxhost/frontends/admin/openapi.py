"""The OpenAPI document as the server really answers: FastAPI promises 422 for a bad body, this server
answers 400 in the OpenAI (or Anthropic) error shape; streams are `text/event-stream`; the gate in
common/security.py adds 401, 413, 415 and 421; the engine adds 429 and 503."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# Both dialects' error bodies have an `error` object with a `message` (Anthropic adds `type` outside).
_ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}},
}
_POST_ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model",
                "413": "request body too large", "415": "body not JSON", "421": "Host header not served",
                "429": "queue full or the request can never fit the KV budget", "503": "model cannot be loaded now"}
_OTHER_ERRORS = {"400": "invalid parameter", "401": "missing or wrong API key", "404": "unknown model or id",
                 "421": "Host header not served"}
_STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
_PLAIN_TEXT = {"/metrics": "text/plain"}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = fix_document(doc)
        return app.openapi_schema

    app.openapi = openapi


def fix_document(doc: dict[str, Any]) -> dict[str, Any]:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            errors = _POST_ERRORS if method == "post" else _OTHER_ERRORS
            for status, why in errors.items():
                responses.setdefault(status, {"description": why,
                                              "content": {"application/json": {"schema": _ERROR_REF}}})
            ok = responses.get("200")
            if ok is None:
                continue
            if path in _PLAIN_TEXT:
                ok["content"] = {_PLAIN_TEXT[path]: {"schema": {"type": "string"}}}
            elif path in _STREAMING and method == "post":
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {"type": "string"}}
    return doc
