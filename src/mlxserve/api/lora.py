"""LoRA adapters over HTTP: the load body and the adapters' errors in the OpenAI error shape. No MLX.

`POST /v1/models/NAME/load {"lora_path": "/adapters/sql", "base": "qwen"}` serves the adapter at that path as
model NAME (on `base`, default the first model); `.../unload` unloads it (a 409 while requests use it).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxserve.api.errors import APIError, error_response
from mlxserve.api.schemas import StrictModel
from mlxserve.lora.adapters import AdapterBusy, AdapterError, AdapterNoRoom
from mlxserve.api.door import RETRY_AFTER_S


class LoadModelBody(StrictModel):
    lora_path: str | None = None  # a LoRA adapter folder (mlx-lm's or PEFT's format) to serve as NAME
    base: str | None = None  # the model it runs on (default: the server's first model)


def add_lora_errors(app: FastAPI) -> None:
    @app.exception_handler(AdapterError)
    async def _bad_adapter(_: Request, exc: AdapterError):
        return error_response(APIError(400, str(exc), "model", "invalid_lora_adapter"))

    @app.exception_handler(AdapterBusy)
    async def _busy(_: Request, exc: AdapterBusy):
        return error_response(APIError(409, str(exc), "model", "model_busy"))

    @app.exception_handler(AdapterNoRoom)
    async def _no_room(_: Request, exc: AdapterNoRoom):
        return error_response(APIError(503, str(exc), "model", "model_unavailable",
                                       headers={"Retry-After": RETRY_AFTER_S}))
