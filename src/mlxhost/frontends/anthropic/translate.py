"""Anthropic Messages bodies as the one internal request (OpenAI chat fields, checked by their schema).

Every prompt's full blocks go through the prefix cache anyway; a `cache_control` breakpoint anywhere keeps the
prompt's blocks ahead of plain LRU eviction for its `ttl` (5 minutes, or "1h"), renewed by each hit (the whole
prompt's: the part after the last breakpoint is at most the newest turn, which the next turn extends). `thinking.budget_tokens` is accepted and not enforced (max_tokens is).
What each field does here (accepted, mapped or refused) is tabled in docs/compat.md: bookkeeping and
unknown fields are accepted and logged at debug, server tools skipped with a warning unless forced.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Union

from mlxhost.frontends.anthropic.protocol import (
    AnyChoice,
    ImageBlock,
    MessagesRequest,
    NoneChoice,
    RedactedThinkingBlock,
    ServerTool,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import chat_request
from mlxhost.serving.schemas import (
    DEFAULT_CACHE_TTL_S,
    ChatCompletionRequest,
    adjacent_systems_joined,
    effort,
    log_unused,
    unused_fields,
)

log = logging.getLogger(__name__)


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _parts(blocks: list, where: str) -> Union[str, list[dict]]:
    """User-visible content: one string when all text (blocks on separate lines), else OpenAI parts."""
    if all(isinstance(b, TextBlock) for b in blocks):
        return _joined(blocks)
    parts = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": b.url}})
        else:
            raise APIError(400, f"a {b.type} block cannot appear here", f"{where}.{j}")
    return parts


def _loaded(blocks: list, tools: dict[str, Tool], referenced: set[str]) -> list:
    """A tool result's `tool_reference` blocks as the definitions they load: one `<functions>` block per run
    of them, a `<function>{description, name, parameters}</function>` line each (the encoding Claude Code's
    ToolSearch tells the model to expect). Shown where the search returned them, the tool list at the top of
    the prompt stays as it was, and so does the conversation's prefix-cache entry."""
    out: list = []
    run: list[str] = []
    for b in [*blocks, None]:
        if isinstance(b, ToolReferenceBlock):
            referenced.add(b.tool_name)
            tool = tools.get(b.tool_name)
            if tool is None:
                log.debug("/v1/messages: a tool_reference names %r, which the request does not define", b.tool_name)
            definition = ({"description": tool.description or "", "name": tool.name, "parameters": tool.input_schema}
                          if tool is not None else {"name": b.tool_name, "description": "(not defined in this request)"})
            run.append(f"<function>{json.dumps(definition, ensure_ascii=False)}</function>")
            continue
        if run:
            out.append(TextBlock(type="text", text="<functions>\n" + "\n".join(run) + "\n</functions>"))
            run = []
        if b is not None:
            out.append(b)
    return out


def _user_messages(blocks: list, where: str, tools: dict[str, Tool], referenced: set[str]) -> list[dict]:
    """Tool results first (as OpenAI `tool` messages: they must follow the assistant's calls), then
    the rest of the turn as one user message."""
    out, rest = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolResultBlock):
            content = (b.content if isinstance(b.content, str)
                       else _parts(_loaded(b.content or [], tools, referenced), f"{where}.{j}.content"))
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, (TextBlock, ImageBlock)):
            rest.append(b)
        else:
            raise APIError(400, f"a {b.type} block can only appear in an assistant message", f"{where}.{j}")
    if rest:
        out.append({"role": "user", "content": _parts(rest, where)})
    return out


def _assistant_message(blocks: list, where: str) -> dict:
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):  # opaque: nothing to show the model
            raise APIError(400, f"a {b.type} block cannot appear in an assistant message", f"{where}.{j}")
    message: dict = {"role": "assistant", "content": _joined(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


_BILLING = "x-anthropic-billing-header:"
_TTL_S = {"5m": DEFAULT_CACHE_TTL_S, "1h": 3600.0}


def cache_ttl_s(body: MessagesRequest) -> float:
    """The longest `ttl` of the body's cache breakpoints (top level, system, tools, content blocks); 0: none."""
    marks = [body.cache_control, *(getattr(t, "cache_control", None) for t in body.tools or ())]
    if not isinstance(body.system, str):
        marks += [b.cache_control for b in body.system or ()]
    marks += [getattr(b, "cache_control", None) for m in body.messages if not isinstance(m.content, str)
              for b in m.content]
    return max((_TTL_S.get(m.get("ttl"), DEFAULT_CACHE_TTL_S) for m in marks if isinstance(m, dict)), default=0.0)


def _without_billing(blocks: list[TextBlock]) -> list[TextBlock]:
    """Claude Code opens `system` with a billing line for Anthropic (`x-anthropic-billing-header:
    cc_version=...`) whose hash differs between conversations: it is not for the model, and at the very
    start of the prompt it would keep conversations from sharing the cached system prompt and tools."""
    kept = [b for b in blocks if not b.text.startswith(_BILLING)]
    for b in blocks:
        if b not in kept:
            log.debug("/v1/messages: dropped the system block %r", b.text[:120])
    return kept


def _first_turn_context_first(messages: list[dict]) -> list[dict]:
    """System messages sent between the conversation's first user message and the first assistant one, moved
    ahead of that user message as messages of their own. Claude Code puts its per-project context there (working
    directory, date, agent types, skills: ~4k tokens): after the user's words it could never be cached for the
    next conversation, before them it joins the fixed prefix that `mlxhost launch` pre-warms. Kept apart from
    `system`, so templates that list the tools after the first system message still share system prompt and tools
    across projects; every turn of a conversation resends its first turn, so each renders it the same way."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return messages
    end = next((i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"), len(messages))
    turn = messages[first:end]
    moved = [m for m in turn if m["role"] == "system"]
    if not moved:
        return messages
    return [*messages[:first], *moved, *(m for m in turn if m["role"] != "system"), *messages[end:]]


def _system_message(blocks: list, where: str) -> dict:
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise APIError(400, f"a {b.type} block cannot appear in a system message", f"{where}.{j}")
    return {"role": "system", "content": _joined(blocks)}


def _client_tools(body: MessagesRequest) -> list[Tool]:
    """The tools the model is shown: server tools and MCP servers are skipped (with a warning), unless
    `tool_choice` forces one of them, which is a 400: the reply could not be what was asked for."""
    tools = [t for t in body.tools or () if isinstance(t, Tool)]
    skipped = [t for t in body.tools or () if isinstance(t, ServerTool)]
    if skipped or body.mcp_servers:
        labels = [f"{t.type} ({t.name})" if t.name else t.type for t in skipped]
        labels += [f"mcp_servers ({len(body.mcp_servers)})"] if body.mcp_servers else []
        log.warning("/v1/messages: skipped %s: this server runs only client tools", ", ".join(labels))
    choice = body.tool_choice
    names = {t.name for t in skipped if t.name}
    if isinstance(choice, ToolChoice) and choice.name in names:
        raise APIError(400, f"tool_choice forces the server tool {choice.name!r}, which this server does not "
                       "run: only client tools (name, description, input_schema) can be called", "tool_choice")
    if isinstance(choice, AnyChoice) and not tools and (skipped or body.mcp_servers):
        raise APIError(400, "tool_choice any needs a client tool: this server runs no server or MCP tools",
                       "tool_choice")
    return tools


def _output_format(body: MessagesRequest) -> Optional[dict]:
    fmt = body.output_config.format if body.output_config and body.output_config.format else body.output_format
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}


def _tool_choice(body: MessagesRequest) -> tuple[Any, Optional[bool]]:
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = None if isinstance(choice, NoneChoice) or not choice.disable_parallel_tool_use else False
    if isinstance(choice, AnyChoice):
        return "required", parallel
    if isinstance(choice, ToolChoice):
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return choice.type, parallel  # "auto" / "none": the same words in OpenAI's dialect


def _callable(tools: list[Tool], body: MessagesRequest, referenced: set[str]) -> tuple[list[Tool], set[str]]:
    """The tools the model may call, and the names of those listed at the top of the prompt. A deferred tool
    is callable once a tool search loaded it (its definition is in the conversation, `_loaded`) and is never
    listed, unless `tool_choice` forces it."""
    forced = body.tool_choice.name if isinstance(body.tool_choice, ToolChoice) else None
    listed = {t.name for t in tools if not t.defer_loading or t.name == forced}
    return [t for t in tools if t.name in listed or t.name in referenced], listed


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    log_unused("/v1/messages", unused_fields(body, body.ACCEPTED_UNUSED))
    tools = _client_tools(body)
    by_name = {t.name: t for t in tools}
    referenced: set[str] = set()  # deferred tools a tool search loaded
    messages: list[dict] = []
    system = body.system if isinstance(body.system, str) else _joined(_without_billing(body.system or []))
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            messages.append(_system_message(m.content, f"messages.{i}.content"))
        elif m.role == "user":
            messages.extend(_user_messages(m.content, f"messages.{i}.content", by_name, referenced))
        else:
            messages.append(_assistant_message(m.content, f"messages.{i}.content"))
    messages = _first_turn_context_first(adjacent_systems_joined(messages))  # joined first: `system` stays apart
    fields: dict = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                    "stop": body.stop_sequences or None, "response_format": _output_format(body)}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    callable_tools, listed = _callable(tools, body, referenced)
    if callable_tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}}
            for t in callable_tools]
    fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(body)
    if body.thinking is not None and body.thinking.type in ("enabled", "disabled"):
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    wanted = body.output_config.effort if body.output_config else None
    if wanted is not None:
        fields["reasoning_effort"] = effort(wanted)
        if fields["reasoning_effort"] is None:
            log.debug("/v1/messages: output_config.effort %r has no meaning here", wanted)
    request = chat_request(fields)
    if len(listed) < len(callable_tools):
        request._listed_tools = frozenset(listed)
    request._cache_ttl_s = cache_ttl_s(body)
    return request


def prefill_request(fields: dict) -> ChatCompletionRequest:
    """A Messages body for POST /v1/cache/prefill (max_tokens optional there: nothing is generated)."""
    return to_chat_request(MessagesRequest.model_validate({"max_tokens": 1, **fields}))
