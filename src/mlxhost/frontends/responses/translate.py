"""Responses input items (with a stored conversation before them, for `previous_response_id`) as the one
internal request: OpenAI chat messages, tools through `tools` (namespaces flattened, hosted tools skipped
unless forced); and the response object's fields that echo the request. Imports no MLX."""

from __future__ import annotations

import logging
import time
from typing import Optional, Union

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import chat_request
from mlxhost.frontends.responses.protocol import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    McpCallItem,
    McpOtherItem,
    MessageItem,
    ResponsesRequest,
)
from mlxhost.frontends.responses.render import new_id
from mlxhost.frontends.responses.tools import ServedTools, chat_tool_choice, served_tools
from mlxhost.serving.schemas import (
    ChatCompletionRequest,
    adjacent_systems_joined,
    effort,
    log_unused,
    unused_fields,
)

log = logging.getLogger(__name__)


def input_items(body: ResponsesRequest) -> list[dict]:
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(exclude_none=True) for item in body.input]


def _content(content: Union[str, list], where: str) -> Union[str, list[dict]]:
    """Text parts on separate lines as one string; with images, OpenAI chat parts."""
    if isinstance(content, str):
        return content
    if all(not isinstance(p, InputImage) for p in content):
        return "\n".join(p.text if isinstance(p, InputText) else p.refusal for p in content)
    parts = []
    for j, p in enumerate(content):
        if isinstance(p, InputImage):
            if p.image_url is None:
                raise APIError(400, "input_image needs image_url (a data: or https URL); file_id is not supported",
                               f"{where}.{j}")
            parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            parts.append({"type": "text", "text": p.text if isinstance(p, InputText) else p.refusal})
    return parts


def chat_messages(items: list[dict]) -> list[dict]:
    """Items as chat messages: an assistant message and the function calls after it are one turn, as
    the model wrote them; a reasoning item goes with the assistant turn that follows it."""
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant(message: dict) -> dict:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(message)
        return message

    for i, item in enumerate(INPUT_ITEMS.validate_python(items)):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            content = _content(item.content, f"{where}.content")
            if item.role == "assistant":
                assistant({"role": "assistant", "content": content})
            else:  # chat templates know system; developer is its newer name
                out.append({"role": "system" if item.role == "developer" else item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            prev = out[-1] if out and not reasoning else None
            if prev is not None and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, McpCallItem):  # a call this server ran: the model's call, then its result
            assistant({"role": "assistant", "content": "", "tool_calls": [
                {"id": item.id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]})
            out.append({"role": "tool", "tool_call_id": item.id, "content": item.output if item.error is None
                        else f"Error: {item.error}"})
        elif isinstance(item, McpOtherItem):
            continue  # listings and approvals: the loop's bookkeeping, resolved into mcp_call items
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(item.output, f"{where}.output")})
        else:
            texts = [c.get("text", "") for c in item.content or ()] or [s.get("text", "") for s in item.summary]
            if any(texts):  # an encrypted-only item (from another server) has nothing to show
                reasoning.append("".join(texts))
    return out


def _response_format(body: ResponsesRequest) -> Optional[dict]:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                   "schema": fmt.schema_, "strict": fmt.strict}}


def _reasoning(body: ResponsesRequest, fields: dict) -> None:
    wanted = body.reasoning.effort if body.reasoning else None
    if wanted is None:
        return
    fields["reasoning_effort"] = effort(wanted)
    if wanted == "none":  # no reasoning at all: hybrid templates have a switch for that
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    elif fields["reasoning_effort"] is None:
        log.debug("/v1/responses: reasoning.effort %r has no meaning here", wanted)


def to_chat_request(body: ResponsesRequest, items: list[dict], tools: ServedTools) -> ChatCompletionRequest:
    log_unused("/v1/responses", unused_fields(body, body.ACCEPTED_UNUSED))
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += chat_messages(items)
    if not messages:
        raise APIError(400, "input is empty", "input")
    fields: dict = {"model": body.model, "messages": adjacent_systems_joined(messages),
                    "max_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
                    "response_format": _response_format(body)}
    for name in ("temperature", "top_p", "prompt_cache_key"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    fields["tool_choice"], functions = chat_tool_choice(body.tool_choice, tools)
    if functions:
        fields["tools"] = functions
    _reasoning(body, fields)
    return chat_request(fields)


def prefill_request(fields: dict) -> ChatCompletionRequest:
    """A Responses body for POST /v1/cache/prefill: its own input only (no stored conversation is read)."""
    body = ResponsesRequest.model_validate(fields)
    if body.previous_response_id is not None:
        raise APIError(400, "a prefill takes the whole input, not previous_response_id", "previous_response_id")
    tools = served_tools(body.tools)
    return to_chat_request(body, input_items(body), tools)


def envelope(body: ResponsesRequest, tools: ServedTools) -> dict:
    """The response object's fields that echo its request; metadata also names the tools skipped."""
    metadata = dict(body.metadata or {})
    if tools.skipped:
        metadata["mlxhost_skipped_tools"] = ", ".join(tools.skipped)[:512]
    choice = body.tool_choice
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "model": body.model,
        "instructions": body.instructions, "metadata": metadata,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tool_choice": choice.model_dump(exclude_none=True) if choice and not isinstance(choice, str)
        else choice or "auto",
        # An MCP tool's credentials are the client's secret: never echoed or stored with the response.
        "tools": [t.model_dump(exclude_none=True, exclude={"authorization", "headers"} if t.type == "mcp" else None)
                  for t in body.tools or ()],
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "store": body.store, "truncation": body.truncation or "disabled", "user": body.user,
    }
