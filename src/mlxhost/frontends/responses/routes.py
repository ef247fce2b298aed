"""OpenAI Responses (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) as a front door: the body
is translated into the one internal request (`translate`), opened through the one `Gateway`, and rendered
by `render`; stored responses (`store`) answer `previous_response_id`, GET and DELETE. Imports no MLX.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.responses.mcp import respond_with_mcp, uses_mcp
from mlxhost.frontends.responses.protocol import ResponsesRequest
from mlxhost.frontends.responses.render import ResponseFrames
from mlxhost.frontends.responses.store import ResponseStore
from mlxhost.frontends.responses.tools import NamespacedRenderer, served_tools
from mlxhost.frontends.responses.translate import envelope, input_items, to_chat_request


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param, "response_not_found")


def add_responses_routes(app: FastAPI, gateway: Gateway, max_num_responses: int | None = None) -> None:
    # Owned by this app's routes: a second app (tests, several servers) has its own.
    store = ResponseStore(max_num_responses) if max_num_responses else ResponseStore()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, raw: Request):
        items = new_items = input_items(body)
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            items = previous.conversation + items
        if uses_mcp(gateway, body, new_items):  # this server runs the MCP calls (responses/mcp.py)
            return await respond_with_mcp(gateway, body, raw, items, new_items,
                                          lambda response: store.put(response, items) if body.store else None)
        tools = served_tools(body.tools)
        opened = await gateway.open(to_chat_request(body, items, tools))
        renderer = NamespacedRenderer(envelope(body, tools), opened.prepared.output, tools.namespaces)

        def keep(response: dict) -> None:
            if body.store:
                store.put(response, items)

        def render(whole) -> dict:
            renderer.feed(whole.text, final=True, incomplete=whole.last.finish_reason == "length")
            response, _ = renderer.finish(whole.last)
            keep(response)
            return response

        return await gateway.reply(opened.outputs, raw, body.stream, ResponseFrames(renderer, keep), render)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
