"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) as a front door: the body is
translated into the one internal request (`translate`), opened through the one `Gateway`, and the reply
rendered by `render`. Errors on these paths come in Anthropic's shape (`errors`). Imports no MLX."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxhost.frontends.anthropic.errors import install_anthropic_errors
from mlxhost.frontends.anthropic.mcp import messages_with_mcp, runs_mcp
from mlxhost.frontends.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxhost.frontends.anthropic.render import MessageBuilder
from mlxhost.frontends.anthropic.translate import to_chat_request
from mlxhost.frontends.common.gateway import Gateway


def add_anthropic_routes(app: FastAPI, gateway: Gateway) -> None:
    install_anthropic_errors(app)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request):
        if runs_mcp(gateway, body):  # MCP tools run here, in the shared tool-call loop (anthropic/mcp.py)
            return await messages_with_mcp(gateway, body, raw)
        opened = await gateway.open(to_chat_request(body))
        builder = MessageBuilder(body.model, opened, tuple(body.stop_sequences or ()))
        return await gateway.reply(opened.outputs, raw, body.stream, builder, builder.message)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        # The prompt exactly as /v1/messages would build it (template, tools), never generated from. No
        # completion budget: a prompt too long for the max_tokens it would ask for still counts.
        body.max_tokens = None
        prepared = await gateway.count(to_chat_request(body))
        return {"input_tokens": prepared.request.num_prompt_tokens}
