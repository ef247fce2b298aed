"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) as a front door: the body is
translated into an OpenAI `ChatCompletionRequest`, opened through the one `EngineDoor`, and the reply
rendered by `anthropic_events`. Errors on these paths come in Anthropic's shape. Imports no MLX.

`cache_control` is accepted wherever Anthropic allows it and ignored: every prompt's full blocks go
through the prefix cache anyway. `thinking.budget_tokens` is accepted and not enforced (max_tokens is).
"""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field, model_validator

from mlxserve.api.anthropic_events import MessageBuilder, stream_message
from mlxserve.api.door import EngineDoor, chat_request
from mlxserve.api.errors import APIError
from mlxserve.api.schemas import MAX_STOP_STRINGS, ChatCompletionRequest, StrictModel
from mlxserve.api.security import is_anthropic_path


class _Block(StrictModel):
    # Clients send back the blocks of earlier replies with fields we have no use for (citations,
    # caller, ...): accepted and unused, as OpenAI messages' echoed fields are.
    model_config = ConfigDict(extra="allow")

    cache_control: Optional[dict] = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(StrictModel):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]

    @property
    def url(self) -> str:
        src = self.source
        return src.url if isinstance(src, URLSource) else f"data:{src.media_type};base64,{src.data}"


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


ResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Optional[Union[str, list[ResultPart]]] = None
    is_error: bool = False  # accepted; the result's text says what went wrong


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class InputMessage(StrictModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(StrictModel):
    model_config = ConfigDict(extra="forbid")

    type: Optional[Literal["custom"]] = None
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    input_schema: dict
    strict: Optional[bool] = None
    cache_control: Optional[dict] = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value):
        # Server tools (web_search_..., bash_..., text_editor_...) run at Anthropic: say so, rather
        # than complain about their fields.
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is not supported: only client tools (name, description, "
                             "input_schema) can be served")
        return value


class _Choice(StrictModel):
    model_config = ConfigDict(extra="forbid")

    disable_parallel_tool_use: Optional[bool] = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoneChoice(StrictModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["none"]


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1)]
    display: Optional[str] = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


class ThinkingAdaptive(StrictModel):
    type: Literal["adaptive"]  # the model's own default: the chat template decides
    display: Optional[str] = None


class MessagesRequest(StrictModel):
    """A field we do not know is a 400 naming it, as on the OpenAI routes."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Optional[Union[str, list[TextBlock]]] = None
    stop_sequences: Optional[Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Annotated[Union[AutoChoice, AnyChoice, ToolChoice, NoneChoice],
                                    Field(discriminator="type")]] = None
    thinking: Optional[Annotated[Union[ThinkingEnabled, ThinkingDisabled, ThinkingAdaptive],
                                 Field(discriminator="type")]] = None
    stream: bool = False
    # Bookkeeping that changes nothing about the output: accepted and not used.
    metadata: Optional[dict] = None
    cache_control: Optional[dict] = None
    service_tier: Optional[str] = None


class CountTokensRequest(MessagesRequest):
    # The same body as a message, without the need for a completion budget.
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None


# -- translation -----------------------------------------------------------------------------------


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


def _user_messages(blocks: list, where: str) -> list[dict]:
    """Tool results first (as OpenAI `tool` messages: they must follow the assistant's calls), then
    the rest of the turn as one user message."""
    out, rest = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolResultBlock):
            content = b.content if isinstance(b.content, str) else _parts(b.content or [], f"{where}.{j}.content")
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


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": body.system if isinstance(body.system, str)
                         else _joined(body.system)})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages.extend(_user_messages(m.content, f"messages.{i}.content"))
        else:
            messages.append(_assistant_message(m.content, f"messages.{i}.content"))
    fields: dict = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                    "stop": body.stop_sequences or None}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}}
            for t in body.tools]
    fields["tool_choice"], fields["parallel_tool_calls"] = _tool_choice(body)
    if body.thinking is not None and body.thinking.type != "adaptive":
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    return chat_request(fields)


# -- errors ----------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _reshaping(handler):
    async def handle(request, exc):
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        if response is None or not is_anthropic_path(request.url.path) or not isinstance(response, JSONResponse):
            return response
        message = (json.loads(response.body).get("error") or {}).get("message") or str(exc)
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(anthropic_error(response.status_code, message), response.status_code, headers=headers)

    return handle


def install_anthropic_errors(app: FastAPI) -> None:
    """Every exception handler installed so far answers in Anthropic's shape on /v1/messages paths
    (same status and headers, e.g. Retry-After), OpenAI's elsewhere. Call it after the app's handlers."""
    for exc_class, handler in list(app.exception_handlers.items()):
        app.exception_handlers[exc_class] = _reshaping(handler)


# -- routes ----------------------------------------------------------------------------------------


def add_anthropic_routes(app: FastAPI, door: EngineDoor) -> None:
    install_anthropic_errors(app)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request):
        opened = await door.open(to_chat_request(body))
        builder = MessageBuilder(body.model, opened, tuple(body.stop_sequences or ()))
        timer = door.timer()
        if body.stream:
            return StreamingResponse(stream_message(builder, opened.outputs, timer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        whole = await door.collect(opened.outputs, timer, raw)
        if whole is None:
            return Response(status_code=499)
        return JSONResponse(builder.message(whole))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        # The prompt exactly as /v1/messages would build it (template, tools), never generated from. No
        # completion budget: a prompt too long for the max_tokens it would ask for still counts.
        body.max_tokens = None
        opened = await door.open(to_chat_request(body), generate=False)
        return {"input_tokens": opened.prepared.request.num_prompt_tokens}
