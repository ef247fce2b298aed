"""`GET /v1/mcp/servers`, `GET /v1/mcp/tools` and `POST /v1/mcp/call`: the configured MCP servers, their
tools (an OpenAI-style list) and one tool run directly, for UIs and tests. A tool that fails (its own
error, a timeout, a server that died) is a 200 whose `error` says so; only a bad request is a 4xx. Imports no MLX."""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.mcp_rounds import allowed_servers, check_key, manager
from mlxhost.mcp.client import McpCallError
from mlxhost.mcp.loop import ServerChoice
from mlxhost.serving.schemas import StrictModel


class McpCallRequest(StrictModel):
    server: str
    tool: str
    arguments: Optional[dict] = None


def add_mcp_routes(app: FastAPI, gateway: Gateway) -> None:
    # An API key limited to some servers sees and runs only those (its `mcp_servers`, common/keys.py).
    @app.get("/v1/mcp/servers")
    async def servers(raw: Request):
        mcp, allowed = gateway.mcp, allowed_servers(raw)
        return {"object": "list", "data": [s.status() for s in mcp.servers.values()
                                           if allowed is None or s.label in allowed] if mcp else []}

    @app.get("/v1/mcp/tools")
    async def tools(raw: Request):
        mcp, allowed = gateway.mcp, allowed_servers(raw)
        return {"object": "list", "data": [t.card() for t in mcp.tools(list(allowed) if allowed is not None else None)]
                if mcp else []}

    @app.post("/v1/mcp/call")
    async def call(body: McpCallRequest, raw: Request):
        mcp = manager(gateway, "server")
        check_key(raw, [ServerChoice(body.server)], "server")
        if mcp.server(body.server) is None:
            raise APIError(404, f"no MCP server {body.server!r} is configured", "server", "mcp_server_not_found")
        try:
            output = await mcp.call(body.server, body.tool, body.arguments or {})
        except McpCallError as exc:
            return {"server": body.server, "tool": body.tool, "output": None, "error": str(exc)}
        return {"server": body.server, "tool": body.tool, "output": None if output.is_error else output.text,
                "error": output.text if output.is_error else None}
