"""Anthropic Messages request bodies (`/v1/messages`, `/v1/messages/count_tokens`), validated by
pydantic: a value we cannot honour is a 400 naming every such field, in Anthropic's error shape. Fields
we do not know are accepted (Anthropic adds them often) and logged at debug by the translation.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from mlxhost.serving.schemas import MAX_STOP_STRINGS, StrictModel


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


class ToolReferenceBlock(_Block):
    """A tool a client-side tool search found (Claude Code's ToolSearch, Anthropic's advanced tool use): the
    definition of that tool, deferred until now (`Tool.defer_loading`), is shown to the model in its place."""

    type: Literal["tool_reference"]
    tool_name: str


ResultPart = Annotated[Union[TextBlock, ImageBlock, ToolReferenceBlock], Field(discriminator="type")]


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
    # A system message mid-conversation (Claude Code's "mid-conversation-system" beta) stays in place.
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]


class Tool(StrictModel):
    """A client tool. Hints Anthropic added for its own serving (input_examples, eager_input_streaming,
    allowed_callers, ...) are accepted: the model sees name, description, schema. A tool with
    `defer_loading` is not shown until a tool search names it (a `tool_reference` in a tool result)."""

    model_config = ConfigDict(extra="allow")

    type: Optional[Literal["custom"]] = None
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    input_schema: dict
    strict: Optional[bool] = None
    cache_control: Optional[dict] = None
    defer_loading: Optional[bool] = None


class ServerTool(StrictModel):
    """A tool Anthropic defines by its versioned type (web_search_..., code_execution_..., bash_...,
    text_editor_..., computer_..., memory_...): this server runs none of them, so it is skipped."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: Optional[str] = None


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "client" if kind in (None, "custom") else "server"


AnyTool = Annotated[Union[Annotated[Tool, Tag("client")], Annotated[ServerTool, Tag("server")]],
                    Discriminator(_tool_kind)]


class _Choice(StrictModel):
    disable_parallel_tool_use: Optional[bool] = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoneChoice(StrictModel):
    type: Literal["none"]


class ThinkingEnabled(StrictModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1)]
    display: Optional[str] = None


class ThinkingDisabled(StrictModel):
    type: Literal["disabled"]


class ThinkingAdaptive(StrictModel):
    """adaptive, between_tools, and kinds Anthropic adds later: the model's own default (the chat
    template decides whether it thinks)."""

    type: str
    display: Optional[str] = None


def _thinking_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("enabled", "disabled") else "other"


AnyThinking = Annotated[Union[Annotated[ThinkingEnabled, Tag("enabled")], Annotated[ThinkingDisabled, Tag("disabled")],
                              Annotated[ThinkingAdaptive, Tag("other")]], Discriminator(_thinking_kind)]


class OutputFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Optional[str] = None  # low / medium / high / max: the reasoning effort
    format: Optional[OutputFormat] = None  # structured output: the reply is JSON under the schema


class MessagesRequest(StrictModel):
    """Fields we do not know are accepted and logged at debug (Anthropic adds them often); a value we
    cannot honour (a sampling range, a forced server tool) is a 400 naming every such field."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Optional[Union[str, list[TextBlock]]] = None
    stop_sequences: Optional[Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    tools: Optional[list[AnyTool]] = None
    tool_choice: Optional[Annotated[Union[AutoChoice, AnyChoice, ToolChoice, NoneChoice],
                                    Field(discriminator="type")]] = None
    thinking: Optional[AnyThinking] = None
    stream: bool = False
    output_config: Optional[OutputConfig] = None
    output_format: Optional[OutputFormat] = None  # the structured-outputs beta's first spelling
    # MCP servers: labels of this server's --mcp-config (strings, or objects whose `name` is one) run here
    # (anthropic/mcp.py); Anthropic's remote URL servers too with --mcp-allow-remote, else they are skipped.
    mcp_servers: Optional[list[Union[str, dict]]] = None
    # Bookkeeping that changes nothing about the output: accepted and not used. Context editing only
    # trims what Anthropic keeps of long histories; here the whole history is the prompt.
    metadata: Optional[dict] = None
    cache_control: Optional[dict] = None
    service_tier: Optional[str] = None
    context_management: Optional[dict] = None
    container: Optional[Union[str, dict]] = None
    diagnostics: Optional[dict] = None  # asks Anthropic why its prompt cache missed
    speed: Optional[str] = None  # "fast": a faster (pricier) Anthropic mode; one speed here
    inference_geo: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None

    ACCEPTED_UNUSED: ClassVar[tuple[str, ...]] = ("metadata", "cache_control", "service_tier", "context_management",
                                                  "container", "diagnostics", "speed", "inference_geo",
                                                  "user_profile_id", "workspace_id")


class CountTokensRequest(MessagesRequest):
    # The same body as a message, without the need for a completion budget.
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
