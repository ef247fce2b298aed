"""One batch line run in-process through the server's own route for its endpoint: the same schema, translation,
gateway and renderer as a live request, in the lowest scheduling class. The app's routes are called below its
middlewares (the gate checked the batch's creator already; a line is no HTTP request of its own), with its
exception handlers, so a refused line gets the status and error body a live request would."""

from __future__ import annotations

import json
import logging

import httpx
from fastapi import FastAPI
from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware

from mlxhost.frontends.common.gateway import priority_class

log = logging.getLogger(__name__)

# Below any class a live request or an API key names (lower runs first): batch lines wait for free capacity.
BATCH_PRIORITY = 1_000_000


class RouteDispatch:
    """`await dispatch(url, body)` -> (status code, JSON body)."""

    def __init__(self, app: FastAPI) -> None:
        handlers = dict(app.exception_handlers)
        last_resort = handlers.pop(Exception, None) or handlers.pop(500, None)
        # The layers FastAPI builds around its router (errors, exception handlers, the request's exit stack),
        # without the app's own middlewares.
        routes = ServerErrorMiddleware(ExceptionMiddleware(AsyncExitStackMiddleware(app.router), handlers=handlers),
                                       handler=last_resort)

        async def asgi(scope, receive, send):
            scope["app"] = app  # what `request.app` reads, as Starlette's app sets it
            await routes(scope, receive, send)

        # The base URL is never resolved: the transport hands each request to `asgi` directly.
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi, raise_app_exceptions=False),
                                         base_url="http://batch.internal", timeout=None)

    async def __call__(self, url: str, body: dict) -> tuple[int, dict]:
        priority_class.set(BATCH_PRIORITY)  # this line's task only: a context variable is per task
        response = await self._client.post(url, content=json.dumps(body).encode(),
                                           headers={"content-type": "application/json"})
        try:
            return response.status_code, response.json()
        except ValueError:  # not JSON: an internal error page
            log.warning("batch line to %s answered %d without JSON", url, response.status_code)
            return 500, {"error": {"message": "internal error: the route answered without JSON", "type": "server_error",
                                   "param": None, "code": None}}

    async def close(self) -> None:
        await self._client.aclose()
