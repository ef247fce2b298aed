"""Responses with `mcp` tools, as OpenAI defines them: the tools of each server are listed (an
`mcp_list_tools` item), the model runs in the shared tool-call loop (mlxhost.mcp.loop) with this server
making each call (an `mcp_call` item with its output or error) until it answers; a call that needs approval
ends the response with an `mcp_approval_request` item, and a later request that answers it
(`mcp_approval_response` with `previous_response_id`) runs or declines the call and goes on.

Streamed, the items come with OpenAI's events as each step ends (a round's text once the round is
known to be the answer). Imports no MLX.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.mcp_rounds import (
    ClientGone,
    gateway_ask,
    loop_fields,
    opened_toolset,
)
from mlxhost.frontends.common.sse import (
    client_gone,
    event_stream,
    heartbeats,
    sse_event,
)
from mlxhost.frontends.responses.protocol import ResponsesRequest
from mlxhost.frontends.responses.render import KEEP_ALIVE, new_id
from mlxhost.frontends.responses.tools import (
    FunctionChoice,
    McpTool,
    NamespacedRenderer,
    OtherChoice,
    served_tools,
)
from mlxhost.frontends.responses.translate import envelope, to_chat_request
from mlxhost.mcp.loop import (
    DECLINED,
    LoopResult,
    McpCallRecord,
    ServerChoice,
    ToolCall,
    execute,
    run_tool_loop,
)
from mlxhost.serving.chat_output import ChatOutput, OutputSpec


def uses_mcp(gateway: Gateway, body: ResponsesRequest, items: list[dict]) -> bool:
    """On a server with MCP (--mcp-config or --mcp-allow-remote); without it `mcp` tools are skipped as
    other hosted tools are."""
    return gateway.mcp is not None and any(isinstance(t, McpTool) for t in body.tools or ()) or any(
        i.get("type") == "mcp_approval_response" for i in items)


def _choices(body: ResponsesRequest) -> list[ServerChoice]:
    choices = []
    for t in body.tools or ():
        if isinstance(t, McpTool):
            headers = dict(t.headers or {})
            if t.authorization:
                headers.setdefault("Authorization", f"Bearer {t.authorization}")
            # OpenAI's default: every call is approved by the client first.
            choices.append(ServerChoice(t.server_label, t.server_url, headers or None, t.allowed,
                                        t.require_approval if t.require_approval is not None else "always"))
    return choices


def _chat_choice(choice: Any) -> Any:
    """The chat tool_choice for the loop's first round; an `mcp` choice forces its tool (or any tool)."""
    if isinstance(choice, OtherChoice) and choice.type == "mcp":
        return {"type": "function", "function": {"name": choice.name}} if choice.name else "required"
    if isinstance(choice, OtherChoice):
        raise APIError(400, f"tool_choice forces the {choice.type} tool, which this server does not run",
                       "tool_choice")
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if choice is not None and not isinstance(choice, str):  # allowed_tools: its mode, over every tool
        return choice.mode
    return choice or "auto"


@dataclass
class _Totals:
    """What the renderer reads off a request's last output, summed over the loop's rounds."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str | None


class McpRenderer(NamespacedRenderer):
    """The response's items and events, MCP items included."""

    def _whole_item(self, item: dict, middle: Callable[[dict], list[dict]]) -> list[dict]:
        self.items.append(item)
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_item.added", output_index=index, item=dict(item)),
                *middle(where), self._event("response.output_item.done", output_index=index, item=item)]

    def list_tools(self, label: str, tools: list) -> list[dict]:
        item = {"id": new_id("mcpl"), "type": "mcp_list_tools", "server_label": label, "error": None,
                "tools": [{"name": t.name, "description": t.description, "input_schema": t.input_schema,
                           "annotations": None} for t in tools]}
        return self._whole_item(item, lambda where: [self._event("response.mcp_list_tools.in_progress", **where),
                                                     self._event("response.mcp_list_tools.completed", **where)])

    def call(self, record: McpCallRecord) -> list[dict]:
        item = {"id": record.id, "type": "mcp_call", "server_label": record.server, "name": record.name,
                "arguments": record.arguments, "output": record.output, "error": record.error,
                "status": "failed" if record.error is not None else "completed",
                "approval_request_id": record.approval_request_id}
        end = "response.mcp_call.failed" if record.error is not None else "response.mcp_call.completed"
        return self._whole_item(item, lambda where: [
            self._event("response.mcp_call.in_progress", **where),
            self._event("response.mcp_call_arguments.delta", **where, delta=record.arguments),
            self._event("response.mcp_call_arguments.done", **where, arguments=record.arguments),
            self._event(end, **where)])

    def approval_request(self, approval_id: str, server: str, call: ToolCall) -> list[dict]:
        item = {"id": approval_id, "type": "mcp_approval_request", "server_label": server, "name": call.name,
                "arguments": call.arguments or "{}"}
        return self._whole_item(item, lambda where: [])

    def answer(self, text: str, spec: OutputSpec, incomplete: bool, skip: set[str]) -> list[dict]:
        """The last round's text as message / function_call items; calls to MCP tools (`skip`) are not
        the client's to run (the loop ran them, or ended at its limit)."""
        self._parser = ChatOutput(spec)  # the round's own spec: which tools it was given
        events = self.feed(text, final=True, incomplete=incomplete)
        dropped = {item["id"] for item in self.items if item.get("type") == "function_call" and item["name"] in skip}
        if dropped:
            self.items = [i for i in self.items if i["id"] not in dropped]
            events = [e for e in events if e.get("item_id", (e.get("item") or {}).get("id")) not in dropped]
        return events


def _frame(event: dict) -> str:
    return sse_event(event["type"], event)


def _approvals(items: list[dict], new_items: list[dict]) -> list[tuple[dict, dict]]:
    """(request, response) pairs: each mcp_approval_response of this request's input with the request
    (in `items`, the whole conversation) it answers."""
    requests = {i.get("id"): i for i in items if i.get("type") == "mcp_approval_request"}
    pairs = []
    for item in new_items:
        if item.get("type") == "mcp_approval_response":
            request = requests.get(item.get("approval_request_id"))
            if request is None:
                raise APIError(400, f"mcp_approval_response answers {item.get('approval_request_id')!r}, which no "
                               "earlier response asked for (send previous_response_id)", "input")
            pairs.append((request, item))
    return pairs


async def respond_with_mcp(gateway: Gateway, body: ResponsesRequest, raw: Request, items: list[dict],
                           new_items: list[dict], keep: Callable[[dict], None]):
    """`items`: the conversation (a previous response's included), `new_items`: this request's input."""
    served = served_tools(body.tools, run_mcp=True)
    plain = body.model_copy(update={"tool_choice": None})
    chat = to_chat_request(plain, items, served)  # 400s for the input come here, before anything runs
    stack = contextlib.AsyncExitStack()
    toolset = await stack.enter_async_context(opened_toolset(gateway, raw, _choices(body), "tools"))
    renderer = McpRenderer(envelope(body, served), OutputSpec(), served.namespaces)
    pending = _approvals(items, new_items)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    functions = [t.model_dump(exclude_none=True) for t in chat.tools or ()] + toolset.functions()
    ask = gateway_ask(gateway, raw, loop_fields(chat, set()), functions)

    async def events() -> AsyncIterator[list[dict] | dict]:
        """Lists of events as the steps end, then the final response."""
        try:
            yield renderer.begin()
            for server in toolset.servers:
                yield renderer.list_tools(server.label, toolset.listed(server))
            for request, response in pending:  # the calls approved (or not) since the last response
                call = ToolCall(new_id("mcp"), request.get("name", ""), request.get("arguments") or "{}")
                if response.get("approve"):
                    record = await execute(toolset, call, request.get("id"))
                else:
                    record = McpCallRecord(call.id, request.get("server_label", ""), call.name, call.arguments,
                                           error=DECLINED, approval_request_id=request.get("id"))
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]})
                messages.append(record.tool_message())
                yield renderer.call(record)
            result: LoopResult | None = None
            async for step in run_tool_loop(messages, toolset, ask, gateway.mcp.config, _chat_choice(body.tool_choice)):
                if isinstance(step, McpCallRecord):
                    step.id = new_id("mcp")  # the item's id; the model's own call id stays in the conversation
                    yield renderer.call(step)
                else:
                    result = step
            if result.approvals:
                out = []
                for a in result.approvals:
                    out += renderer.approval_request(a.id, a.server, a.call)
                yield out
            else:
                answer = result.reply.raw
                yield renderer.answer(answer.whole.text, answer.opened.prepared.output,
                                      result.finish_reason == "length", set(toolset.tools))
            totals = _Totals(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens,
                             "stop" if result.approvals else result.finish_reason)
            response, event = renderer.finish(totals)
            keep(response)
            yield [event]
            yield response
        finally:
            await stack.aclose()

    if body.stream:
        return event_stream(_frames(events(), gateway.timer().heartbeat_s, renderer))
    response = None
    try:
        async for step in events():
            response = step
    except ClientGone:
        return client_gone()
    return JSONResponse(response)


async def _frames(steps: AsyncIterator, heartbeat_s: float, renderer: McpRenderer):
    try:
        async for step in heartbeats(steps, heartbeat_s):
            if step is None:
                yield KEEP_ALIVE
            elif isinstance(step, list):
                yield "".join(_frame(e) for e in step)
    except ClientGone:
        return
    except APIError as exc:  # a later round refused (a prompt grown past the context): the response fails
        yield _frame(renderer.failed(exc))
