"""Loading and unloading models over HTTP, and the model manager's errors in the OpenAI error shape. No MLX.

`POST /v1/models/NAME/load` loads a configured model; with `{"lora_path": "/adapters/sql", "base": "qwen"}` it
serves the LoRA adapter at that path as model NAME (on `base`, default the first model). `.../unload` unloads
it (a 409 while requests use it).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxhost.frontends.common.errors import APIError, error_response
from mlxhost.frontends.common.gateway import RETRY_AFTER_S
from mlxhost.lora.adapters import AdapterBusy, AdapterError, AdapterNoRoom
from mlxhost.models.extras import MissingExtraError
from mlxhost.serving.model import ModelUnavailableError, UnknownModelError
from mlxhost.serving.schemas import StrictModel


class LoadModelBody(StrictModel):
    lora_path: str | None = None  # a LoRA adapter folder (mlx-lm's or PEFT's format) to serve as NAME
    base: str | None = None  # the model it runs on (default: the server's first model)


def add_model_errors(app: FastAPI) -> None:
    @app.exception_handler(UnknownModelError)
    async def _unknown_model(request: Request, exc: UnknownModelError):
        return error_response(request, APIError(404, str(exc), "model", "model_not_found"))

    @app.exception_handler(AdapterError)
    async def _bad_adapter(request: Request, exc: AdapterError):
        return error_response(request, APIError(400, str(exc), "model", "invalid_lora_adapter"))

    @app.exception_handler(AdapterBusy)
    async def _busy(request: Request, exc: AdapterBusy):
        return error_response(request, APIError(409, str(exc), "model", "model_busy"))

    @app.exception_handler(AdapterNoRoom)
    async def _no_room(request: Request, exc: AdapterNoRoom):
        return error_response(request, APIError(503, str(exc), "model", "model_unavailable",
                                       headers={"Retry-After": RETRY_AFTER_S}))

    @app.exception_handler(ModelUnavailableError)
    async def _unavailable(request: Request, exc: ModelUnavailableError):
        if isinstance(exc.__cause__, MissingExtraError):  # not a passing state: retrying will not help
            return error_response(request, APIError(400, str(exc.__cause__), "model", "model_not_supported"))
        return error_response(request, APIError(503, str(exc), "model", "model_unavailable",
                                       headers={"Retry-After": RETRY_AFTER_S}))


def add_load_routes(app: FastAPI, models) -> None:
    @app.post("/v1/models/{name:path}/load")
    async def load_model(name: str, body: LoadModelBody | None = None):
        # With lora_path: NAME is a LoRA adapter at that path, served on `base` (lora/registry.py).
        await models.load(name, *((body.lora_path, body.base) if body is not None else ()))
        return models.card(name)

    @app.post("/v1/models/{name:path}/unload")
    async def unload_model(name: str):
        if not await models.unload(name):
            raise APIError(409, f"model `{name}` is serving requests; unload it when they end", "model", "model_busy")
        return models.card(name)
