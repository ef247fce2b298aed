"""OpenAI Responses (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) as a front door: the
input items (with a stored conversation before them, for `previous_response_id`) are translated into an
OpenAI `ChatCompletionRequest`, opened through the one `EngineDoor`, and rendered by `responses_events`.
Tools go through `responses_tools` (namespaces flattened, hosted tools skipped unless forced). Fields we
do not know are accepted and logged at debug; docs/compat.md tables what each field does. Imports no MLX.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from mlxserve.api.door import EngineDoor, chat_request
from mlxserve.api.errors import APIError
from mlxserve.api.responses_events import new_id, stream_response
from mlxserve.api.responses_store import ResponseStore
from mlxserve.api.responses_tools import (
    AnyChoice,
    AnyTool,
    NamespacedRenderer,
    ServedTools,
    chat_tool_choice,
    served_tools,
)
from mlxserve.api.schemas import (
    ChatCompletionRequest,
    StrictModel,
    adjacent_systems_joined,
    effort,
    log_unused,
    refusing,
    unused_fields,
)

log = logging.getLogger(__name__)


class _Echoed(StrictModel):
    # Items of earlier responses come back as input with their ids, statuses and annotations: kept, unused.
    model_config = ConfigDict(extra="allow")


class InputText(_Echoed):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(_Echoed):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Echoed):
    type: Literal["input_image"]
    image_url: Optional[str] = None
    file_id: Optional[str] = None
    detail: Optional[str] = None


Part = Annotated[Union[InputText, Refusal, InputImage], Field(discriminator="type")]


class MessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]]


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[Part]]


class ReasoningItem(_Echoed):
    type: Literal["reasoning"]
    summary: list[dict] = []
    content: Optional[list[dict]] = None


def _item_type(value: Any) -> str:
    # A message may leave out its type ({"role": "user", "content": "hi"}).
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]
_ITEMS = TypeAdapter(list[InputItem])


class TextFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(StrictModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # accepted: nothing to tune it with


class ReasoningConfig(StrictModel):
    effort: Optional[str] = None
    summary: Optional[str] = None  # accepted: reasoning comes whole, never summarized
    generate_summary: Optional[str] = None


def _no_logprobs(include: Optional[list[str]]) -> Optional[list[str]]:
    if include and "message.output_text.logprobs" in include:
        raise ValueError("message.output_text.logprobs is not supported: no logprobs on this route")
    return include


class ResponsesRequest(StrictModel):
    """Fields we do not know are accepted and logged at debug (clients send the protocol's newest); a
    value we cannot honour is a 400 naming every such field at once."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    tools: Optional[list[AnyTool]] = None
    tool_choice: Optional[AnyChoice] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    # Bookkeeping that changes nothing about the output: accepted and not used.
    metadata: Optional[dict] = None
    user: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    truncation: Optional[Literal["auto", "disabled"]] = None  # never needed: a prompt too long is a 400
    include: Annotated[Optional[list[str]], AfterValidator(_no_logprobs)] = None
    client_metadata: Optional[dict] = None
    max_tool_calls: Optional[int] = None  # counts hosted tool calls, and none run here
    stream_options: Optional[dict] = None
    context_management: Optional[Union[list, dict]] = None
    # Would change what comes back if ignored, and are not implemented.
    background: Annotated[Any, refusing("background responses are not supported: send the request and read it",
                                        (None, False))] = None
    conversation: Annotated[Any, refusing("conversations are not stored here: use previous_response_id or send "
                                          "the input")] = None
    prompt: Annotated[Any, refusing("stored prompt templates are not supported: send instructions and input")] = None
    top_logprobs: Annotated[Any, refusing("top_logprobs is not supported on this route", (None, 0))] = None

    ACCEPTED_UNUSED: ClassVar[tuple[str, ...]] = (
        "metadata", "user", "include", "prompt_cache_key", "safety_identifier", "service_tier", "truncation",
        "client_metadata", "max_tool_calls", "stream_options", "context_management")


# -- translation -----------------------------------------------------------------------------------


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

    for i, item in enumerate(_ITEMS.validate_python(items)):
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
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    fields["tool_choice"], functions = chat_tool_choice(body.tool_choice, tools)
    if functions:
        fields["tools"] = functions
    _reasoning(body, fields)
    return chat_request(fields)


def envelope(body: ResponsesRequest, tools: ServedTools) -> dict:
    """The response object's fields that echo its request; metadata also names the tools skipped."""
    metadata = dict(body.metadata or {})
    if tools.skipped:
        metadata["mlxserve_skipped_tools"] = ", ".join(tools.skipped)[:512]
    choice = body.tool_choice
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "model": body.model,
        "instructions": body.instructions, "metadata": metadata,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "tool_choice": choice.model_dump(exclude_none=True) if choice and not isinstance(choice, str)
        else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None},
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                 if body.text and body.text.format else {"type": "text"}},
        "store": body.store, "truncation": body.truncation or "disabled", "user": body.user,
    }


# -- routes ----------------------------------------------------------------------------------------


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param, "response_not_found")


def add_responses_routes(app: FastAPI, door: EngineDoor, max_num_responses: int | None = None) -> None:
    # Owned by this app's routes: a second app (tests, several servers) has its own.
    store = ResponseStore(max_num_responses) if max_num_responses else ResponseStore()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, raw: Request):
        items = input_items(body)
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            items = previous.conversation + items
        tools = served_tools(body.tools)
        opened = await door.open(to_chat_request(body, items, tools))
        renderer = NamespacedRenderer(envelope(body, tools), opened.prepared.output, tools.namespaces)
        timer = door.timer()

        def keep(response: dict) -> None:
            if body.store:
                store.put(response, items)

        if body.stream:
            return StreamingResponse(stream_response(renderer, opened.outputs, timer, keep),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        whole = await door.collect(opened.outputs, timer, raw)
        if whole is None:
            return Response(status_code=499)
        renderer.feed(whole.text, final=True, incomplete=whole.last.finish_reason == "length")
        response, _ = renderer.finish(whole.last)
        keep(response)
        return JSONResponse(response)

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
