"""OpenAI Responses request bodies (`POST /v1/responses`), validated by pydantic. Fields we do not know
are accepted and logged at debug by the translation; docs/compat.md tables what each field does."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from mlxhost.frontends.responses.tools import AnyChoice, AnyTool
from mlxhost.serving.schemas import StrictModel, refusing


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


class McpCallItem(_Echoed):
    """A call this server ran for an earlier response (Responses `mcp` tools): the model sees it as its
    own call and the tool's result."""

    type: Literal["mcp_call"]
    id: str
    server_label: str
    name: str
    arguments: str
    output: Optional[str] = None
    error: Optional[Any] = None


class McpOtherItem(_Echoed):
    """mcp_list_tools, mcp_approval_request and mcp_approval_response: what the loop reads, not the model."""

    type: Literal["mcp_list_tools", "mcp_approval_request", "mcp_approval_response"]


def _item_type(value: Any) -> str:
    # A message may leave out its type ({"role": "user", "content": "hi"}).
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")], Annotated[McpCallItem, Tag("mcp_call")],
                            Annotated[McpOtherItem, Tag("mcp_list_tools")],
                            Annotated[McpOtherItem, Tag("mcp_approval_request")],
                            Annotated[McpOtherItem, Tag("mcp_approval_response")]], Discriminator(_item_type)]
INPUT_ITEMS = TypeAdapter(list[InputItem])


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
        "metadata", "user", "include", "safety_identifier", "service_tier", "truncation",
        "client_metadata", "max_tool_calls", "stream_options", "context_management")
