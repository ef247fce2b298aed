"""`POST /v1/cache/prefill`: a prompt computed into the prefix cache (and written behind to the SSD tier) without
generating, and `GET /v1/cache/prefixes`: the agents' fixed prompt prefixes the gateway noted (common/prefixes.py).

The body is any dialect's request, named by `api`: "chat" (OpenAI chat completions, the default with `messages`),
"completions" (a `prompt` as text or token ids, the default with `prompt`), "messages" (Anthropic) or "responses"
(the default with `input`). Each dialect's own translation (passed in by app.py: no dialect is imported here) makes
the one internal request, so the prompt is token for token what that dialect's route would run; the gateway
queues it with max_tokens 0, which the engine ends once the prompt is stored. Imports no MLX.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from pydantic import ValidationError

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.keys import current_grant
from mlxhost.frontends.common.sse import client_gone
from mlxhost.serving.schemas import SamplingFields

Translate = Callable[[dict], SamplingFields]
# Fields about the reply, which a prefill does not make: dropped, so their checks cannot refuse it.
_REPLY_FIELDS = ("stream", "stream_options", "max_tokens", "max_completion_tokens", "max_output_tokens", "n",
                 "store", "background")


def _api(fields: dict) -> str:
    api = fields.pop("api", None)
    if api is not None:
        return api
    return "completions" if "prompt" in fields else "responses" if "input" in fields else "chat"


def add_prefill_routes(app: FastAPI, gateway: Gateway, translators: dict[str, Translate]) -> None:
    @app.post("/v1/cache/prefill")
    async def prefill(raw: Request):
        try:
            fields = await raw.json()
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        if not isinstance(fields, dict):
            raise APIError(400, "the body must be a JSON object")
        api = _api(fields)
        translate = translators.get(api)
        if translate is None:
            raise APIError(400, f"api {api!r} is not one of {', '.join(sorted(translators))}", "api")
        for name in _REPLY_FIELDS:
            fields.pop(name, None)
        try:
            body = translate(fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err.get("loc", ())) or None
            raise APIError(400, f"{param}: {err.get('msg', 'invalid request')}", param) from None
        opened = await gateway.open(body, prefill_only=True)
        whole = await gateway.collect(opened.outputs, gateway.timer(), raw)
        if whole is None:
            return client_gone()  # the client left: the prompt's blocks computed so far stay cached all the same
        last = whole.last
        return {"object": "cache.prefill", "model": opened.model.name, "prompt_tokens": last.num_prompt_tokens,
                "cached_tokens": last.num_cached_tokens,
                "computed_tokens": last.num_prompt_tokens - last.num_cached_tokens}

    @app.get("/v1/cache/prefixes")
    async def prefixes():
        grant = current_grant.get()
        return {"object": "list", "data": gateway.prefixes.list(grant.cache_group if grant is not None else "")}
