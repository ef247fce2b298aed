"""MCP tools for any dialect: the toolset a request asked for and the model rounds of the one tool-call
loop (mlxhost.mcp.loop), each round opened through the Gateway like any other request. A dialect maps
its body onto chat fields and its servers onto `ServerChoice`s, runs `run_tool_loop` with `gateway_ask`,
and renders the answer and the calls in its own shape. Imports no MLX."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import Request

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway, chat_request
from mlxhost.frontends.common.keys import current_grant
from mlxhost.mcp.loop import (
    Ask,
    RoundReply,
    ServerChoice,
    ToolCall,
    Toolset,
    ToolsetError,
)
from mlxhost.serving.chat_output import collect


class ClientGone(Exception):
    """The client left during a round: the loop stops (its slot is already free)."""


def gateway_ask(gateway: Gateway, raw: Request, fields: dict, functions: list[dict]) -> Ask:
    """One round of the loop: `fields` (the chat request without messages and tool_choice) with the
    round's messages, the client's own `functions` and the MCP tools, collected whole."""

    async def ask(messages: list[dict], tool_choice: Any) -> RoundReply:
        round_fields = {**fields, "messages": messages, "tool_choice": tool_choice}
        if functions:
            round_fields["tools"] = functions
        opened = await gateway.open(chat_request(round_fields))
        whole = await gateway.collect(opened.outputs, gateway.timer(), raw)
        if whole is None:
            raise ClientGone()
        parsed = collect(opened.prepared.output, whole.text)
        last = whole.last
        return RoundReply(parsed.content, parsed.reasoning,
                          [ToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls], last.finish_reason,
                          last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens,
                          raw=(whole, opened))

    return ask


def manager(gateway: Gateway, param: str):
    """The MCP manager, or the 400 of a server started without MCP."""
    if gateway.mcp is None:
        raise APIError(400, "this server has no MCP servers: start it with --mcp-config FILE", param,
                       "mcp_not_configured")
    return gateway.mcp


def allowed_servers(raw: Request) -> tuple[str, ...] | None:
    """The labels the request's API key may use; None: any. A batch line has no gate of its own: its creator's
    grant (`current_grant`, set by the batch dispatcher) speaks for it."""
    grant = current_grant.get()
    policy = grant.policy if grant is not None else getattr(raw.state, "api_key", None)
    return policy.mcp_servers if policy is not None else None


def check_key(raw: Request, choices: list[ServerChoice], param: str) -> None:
    """An API key limited to some MCP servers (its `mcp_servers`, common/keys.py) uses only those."""
    allowed = allowed_servers(raw)
    refused = [c.label for c in choices if allowed is not None and (c.url is not None or c.label not in allowed)]
    if refused:
        raise APIError(403, f"this API key may not use the MCP server(s) {', '.join(map(repr, refused))}", param,
                       "mcp_server_not_allowed")


@contextlib.asynccontextmanager
async def opened_toolset(gateway: Gateway, raw: Request, choices: list[ServerChoice], param: str):
    """The request's toolset, its remote connections open while the block runs; a refusal is a 400 (403
    for a server the request's API key may not use)."""
    check_key(raw, choices, param)
    try:
        toolset = Toolset(manager(gateway, param), choices)
        await toolset.__aenter__()
    except ToolsetError as exc:
        raise APIError(400, str(exc), param, "mcp_server_refused") from None
    try:
        yield toolset
    finally:
        await toolset.__aexit__(None, None, None)


def labels_as_choices(labels: list, param: str) -> list[ServerChoice]:
    """`mcp_servers` of a chat or Messages body: configured labels (strings, or objects with a `name`),
    or Anthropic's `{"type": "url", "url", "name", "authorization_token"}` for a URL of the request's own."""
    choices = []
    for i, entry in enumerate(labels):
        if isinstance(entry, str):
            choices.append(ServerChoice(entry))
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
            token = entry.get("authorization_token")
            allowed = (entry.get("tool_configuration") or {}).get("allowed_tools")
            choices.append(ServerChoice(entry["name"], entry.get("url"),
                                        {"Authorization": f"Bearer {token}"} if token else None,
                                        tuple(allowed) if allowed is not None else None))
        else:
            raise APIError(400, "an MCP server is a configured label or an object with `name` (and `url`)",
                           f"{param}.{i}")
    return choices


def unapproved(result) -> list[dict]:
    """Calls the loop stopped at because their server wants each approved: only the Responses API asks
    the client; here they are reported as not run."""
    return [{"id": a.call.id, "server": a.server, "name": a.call.name, "arguments": a.call.arguments,
             "output": None, "error": "this tool needs approval for each call: use the Responses API's mcp tool"}
            for a in result.approvals]


def loop_fields(body, exclude: set[str]) -> dict:
    """A validated body's fields for the loop's rounds, without those each round sets itself."""
    return body.model_dump(exclude_none=True, exclude={"messages", "tools", "tool_choice", "stream", "n",
                                                       "mcp_servers", *exclude})
