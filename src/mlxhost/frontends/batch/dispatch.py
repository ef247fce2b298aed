"""One batch line run in-process through the server's own route for its endpoint: the same schema, translation,
gateway and renderer as a live request, in the lowest scheduling class. The app's routes are called below its
middlewares (a line is no HTTP request of its own), with its exception handlers, so a refused line gets the status
and error body a live request would. With API keys, each line runs under its creator's key as the gate would run it
(security.py): admitted by the key's limits (a refusal is waited out, not the line's answer), its grant in
`current_grant` for the gateway (models, cache group, tokens counted), its slot released after."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from fastapi import FastAPI
from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.middleware.exceptions import ExceptionMiddleware

from mlxhost.frontends.common.errors import error_body
from mlxhost.frontends.common.gateway import priority_class
from mlxhost.frontends.common.keys import KeyGrant, KeyRing, current_grant

log = logging.getLogger(__name__)

# Below any class a live request or an API key names (lower runs first): batch lines wait for free capacity.
BATCH_PRIORITY = 1_000_000


class RouteDispatch:
    """`await dispatch(url, body, owner)` -> (status code, JSON body); `owner` is the batch creator's key name."""

    def __init__(self, app: FastAPI) -> None:
        self._app = app
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

    async def __call__(self, url: str, body: dict, owner: str | None) -> tuple[int, dict]:
        priority_class.set(BATCH_PRIORITY)  # this line's task only: a context variable is per task
        # Looked up per line, not at start-up: install_security adds the ring after the Batch API.
        ring: KeyRing | None = getattr(self._app.state, "key_ring", None)
        if ring is None:
            return await self._post(url, body)
        grant = await self._admit(ring, owner)
        if grant is None:
            return 401, error_body(401, "The API key that created this batch is no longer valid.",
                                   code="invalid_api_key")
        token = current_grant.set(grant)
        try:
            return await self._post(url, body)
        finally:
            current_grant.reset(token)
            grant.usage.release()

    @staticmethod
    async def _admit(ring: KeyRing, owner: str | None) -> KeyGrant | None:
        """The owner's grant once its limits admit one more request; None if no key has that name now, or the batch
        has no owner (created before keys were configured: no key vouches for it)."""
        while True:
            ring.reload_if_changed()  # the key file in force now, as the gate reads it per request
            policy = ring.named(owner) if owner is not None else None
            if policy is None:
                return None
            grant = ring.grant(policy)
            refusal = grant.usage.admit(policy)
            if refusal is None:
                return grant
            await asyncio.sleep(refusal.retry_after_s)

    async def _post(self, url: str, body: dict) -> tuple[int, dict]:
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
