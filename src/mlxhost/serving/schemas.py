"""OpenAI request bodies, validated by pydantic (a violation becomes a 400 in the OpenAI error shape)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
# Efforts past "high" (OpenAI's xhigh, Anthropic's max) ask for the most a chat template knows.
EFFORTS = ("none", "minimal", "low", "medium", "high")
_EFFORT_ALIASES = {"xhigh": "high", "max": "high"}


class StrictModel(BaseModel):
    """No coercion: `[[false]]` is not a token list and `false` not a number (lax pydantic turned them into
    0 and served the request). JSON integers still fill float fields."""

    model_config = ConfigDict(strict=True)


def refusing(why: str, harmless: tuple = (None,)) -> AfterValidator:
    """A field whose value would change the output if ignored, and which this server cannot honour:
    `harmless` values (off, empty, the default) pass; any other is a 400 naming the field, together
    with every other bad field of the request."""

    def check(value):
        if any(value == h and type(value) is type(h) for h in harmless):
            return value
        raise ValueError(why)

    return AfterValidator(check)


def unused_fields(body: BaseModel, accepted: tuple[str, ...]) -> list[str]:
    """Fields the request set that change nothing here: `accepted` ones (bookkeeping, hints) and
    any the schema does not know (a client's newer protocol)."""
    return [n for n in accepted if getattr(body, n, None) is not None] + sorted(body.model_extra or ())


def log_unused(where: str, names: list[str]) -> None:
    if names:
        log.debug("%s: accepted, not used: %s", where, ", ".join(names))


def effort(value: Optional[str]) -> Optional[str]:
    """A reasoning effort as a chat template knows it; None for a value no template knows."""
    value = _EFFORT_ALIASES.get(value, value)
    return value if value in EFFORTS else None


def adjacent_systems_joined(messages: list[dict]) -> list[dict]:
    """System messages next to each other as one (Codex sends two developer messages in a row, Claude
    Code `system` plus a system message): the same text, and templates that take one system message
    at the start see it all."""
    out: list[dict] = []
    for m in messages:
        if (m.get("role") == "system" and out and out[-1].get("role") == "system"
                and isinstance(m["content"], str) and isinstance(out[-1]["content"], str)):
            out[-1] = {"role": "system", "content": f"{out[-1]['content']}\n\n{m['content']}"}
        else:
            out.append(m)
    return out


def system_merged(messages: list[dict]) -> list[dict]:
    """`messages` with every system message's text joined into the first message, for chat templates
    that accept a system message only there (Anthropic's and OpenAI's clients put some mid-conversation)."""
    system = [m.get("content") or "" for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if system else rest


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: Union[str, ImageURL]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class VideoURL(StrictModel):
    url: str
    # Sampling: frames per second of video time, and at most this many frames (server caps apply).
    fps: Optional[Annotated[float, Field(gt=0.0, le=60.0)]] = None
    max_frames: Optional[Annotated[int, Field(ge=1)]] = None


class VideoPart(StrictModel):
    """`{"type": "video_url", "video_url": {...}}` (vLLM's form) or `{"type": "video", "video": ...}`;
    fps / max_frames may sit in the part itself or next to the url."""

    type: Literal["video_url", "video"]
    video_url: Optional[Union[str, VideoURL]] = None
    video: Optional[Union[str, VideoURL]] = None
    fps: Optional[Annotated[float, Field(gt=0.0, le=60.0)]] = None
    max_frames: Optional[Annotated[int, Field(ge=1)]] = None

    @model_validator(mode="after")
    def _one_source(self):
        src = self.video_url if self.type == "video_url" else self.video
        if src is None:
            raise ValueError(f"a {self.type!r} part needs its {self.type!r} field")
        return self

    def source(self) -> tuple[str, Optional[float], Optional[int]]:
        src = self.video_url if self.type == "video_url" else self.video
        if isinstance(src, str):
            return src, self.fps, self.max_frames
        return src.url, src.fps or self.fps, src.max_frames or self.max_frames


ContentPart = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class FunctionCall(StrictModel):
    name: str
    arguments: Union[str, dict]  # OpenAI sends a JSON string; some clients send the object


class ToolCallMessage(StrictModel):
    model_config = ConfigDict(extra="allow")

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    # Clients echo back fields of earlier replies (refusal, annotations, audio): harmless, kept.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallMessage]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(p, TextPart) for p in self.content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class StreamOptions(StrictModel):
    include_usage: bool = False


class FunctionSpec(StrictModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(StrictModel):
    name: Optional[str] = None
    description: Optional[str] = None
    # `schema` shadows a BaseModel attribute: stored as schema_, spelled "schema" on the wire.
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


_OFF = (None, False)
_EMPTY = (None, [], {})


# How long a cache hint keeps a prompt's blocks when the client names no time: Anthropic's default (5 minutes,
# renewed by each hit); its `"ttl": "1h"` and OpenAI's `prompt_cache_retention: "24h"` ask for longer.
DEFAULT_CACHE_TTL_S = 300.0


class SamplingFields(StrictModel):
    """Fields shared by chat and completions requests. A field this server cannot honour and whose
    loss would change the output is a 400 naming it (see `refusing`); bookkeeping, hints and fields of
    newer protocol versions are accepted and logged at debug (docs/compat.md has the table)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    # int64 (OpenAI) or uint64: anything else cannot seed mx.random and would fail inside the engine step.
    seed: Optional[Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]] = None
    stop: Optional[Union[str, list[str]]] = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    response_format: Optional[ResponseFormat] = None
    # Speculative decoding for this request while the server speculates: false or "off" decodes it without
    # drafts (the output is the same; the speed is plain decoding's).
    speculative: Optional[Union[bool, Literal["on", "off", "auto"]]] = None
    # Bookkeeping that changes nothing about the output: accepted and not used.
    user: Optional[str] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    # A hint that this prompt's prefix recurs: its blocks stay ahead of LRU eviction (see cache_ttl_s).
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None  # "24h" keeps them a day; else DEFAULT_CACHE_TTL_S
    # The scheduling class (vLLM's): lower is admitted first and may preempt higher; an API key's class
    # (--api-keys) is the best its requests get.
    priority: Optional[Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]] = None
    # vLLM's and others' output-changing extensions this server does not implement.
    min_tokens: Annotated[Any, refusing("min_tokens is not supported", (None, 0))] = None
    best_of: Annotated[Any, refusing("best_of is not supported (use n)", (None, 1))] = None
    use_beam_search: Annotated[Any, refusing("beam search is not supported", _OFF)] = None
    stop_token_ids: Annotated[Any, refusing("stop_token_ids is not supported: use stop strings", _EMPTY)] = None
    bad_words: Annotated[Any, refusing("bad_words is not supported: use logit_bias", _EMPTY)] = None
    allowed_token_ids: Annotated[Any, refusing("allowed_token_ids is not supported: use logit_bias",
                                               _EMPTY)] = None
    include_stop_str_in_output: Annotated[Any, refusing("include_stop_str_in_output is not supported", _OFF)] = None
    skip_special_tokens: Annotated[Any, refusing("special tokens are always skipped", (None, True))] = None
    prompt_logprobs: Annotated[Any, refusing("prompt_logprobs is not supported")] = None
    truncate_prompt_tokens: Annotated[Any, refusing("prompts are never truncated: shorten the prompt")] = None
    guided_json: Annotated[Any, refusing("use response_format with a json_schema")] = None
    guided_regex: Annotated[Any, refusing("regular-expression grammars are not supported")] = None
    guided_choice: Annotated[Any, refusing("use response_format with an enum json_schema")] = None
    guided_grammar: Annotated[Any, refusing("grammars are not supported: use response_format")] = None
    structured_outputs: Annotated[Any, refusing("use response_format")] = None
    logits_processors: Annotated[Any, refusing("custom logits processors are not supported", _EMPTY)] = None

    ACCEPTED_UNUSED: ClassVar[tuple[str, ...]] = ("user", "metadata", "store", "service_tier", "safety_identifier",
                                                  "priority", "prompt_cache_retention")
    # Set by a dialect whose body asks for it (Anthropic's cache_control breakpoints): seconds the prompt's blocks
    # stay ahead of LRU eviction. 0: the prompt_cache_key's, if any.
    _cache_ttl_s: float = PrivateAttr(default=0.0)

    @property
    def cache_ttl_s(self) -> float:
        """Seconds the prompt's blocks are kept ahead of plain LRU eviction in the prefix cache (0: not)."""
        if self._cache_ttl_s or self.prompt_cache_key is None:
            return self._cache_ttl_s
        return 24 * 3600.0 if self.prompt_cache_retention == "24h" else DEFAULT_CACHE_TTL_S

    @model_validator(mode="after")
    def _log_unused(self):
        log_unused(type(self).__name__, unused_fields(self, self.ACCEPTED_UNUSED))
        return self

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    tools: Optional[list[ToolSpec]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    # Passed to the chat template (e.g. {"enable_thinking": false}); reasoning_effort too.
    chat_template_kwargs: Optional[dict] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    modalities: Optional[list[Literal["text"]]] = None
    # Accepted hints: a predicted output only speeds OpenAI's decoding up; verbosity has no knob here.
    prediction: Optional[dict] = None
    verbosity: Optional[str] = None
    # A hosted web search the client offers, not forces: skipped with a warning (docs/compat.md).
    web_search_options: Optional[dict] = None
    # Configured MCP servers (labels) whose tools this server runs for the request (docs/mcp.md).
    mcp_servers: Optional[list[Union[str, dict]]] = None
    functions: Annotated[Any, refusing("legacy function calling is not supported: send `tools`", _EMPTY)] = None
    function_call: Annotated[Any, refusing("legacy function calling is not supported: send `tool_choice`",
                                           (None, "none", "auto"))] = None
    audio: Annotated[Any, refusing("audio output is not supported")] = None
    echo: Annotated[Any, refusing("echo is not supported", _OFF)] = None
    continue_final_message: Annotated[Any, refusing("continue_final_message is not supported", _OFF)] = None
    add_generation_prompt: Annotated[Any, refusing("the generation prompt is always added", (None, True))] = None
    chat_template: Annotated[Any, refusing("a per-request chat template is not supported")] = None
    documents: Annotated[Any, refusing("documents are not supported: put them in the messages", _EMPTY)] = None

    ACCEPTED_UNUSED: ClassVar[tuple[str, ...]] = SamplingFields.ACCEPTED_UNUSED + ("prediction", "verbosity")

    # Set by a front door, never by a client: the names of the `tools` the chat template lists. The others are
    # callable all the same (the grammar and the parser know them) but shown elsewhere in the conversation:
    # Anthropic's deferred tools, loaded where a tool search returned them. None: every tool is listed.
    _listed_tools: Optional[frozenset[str]] = PrivateAttr(default=None)

    @property
    def listed_tools(self) -> list[ToolSpec]:
        tools = self.tools or []
        return tools if self._listed_tools is None else [t for t in tools if t.function.name in self._listed_tools]

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _known_effort(cls, v):
        return _EFFORT_ALIASES.get(v, v)

    @model_validator(mode="after")
    def _skip_web_search(self):
        if self.web_search_options is not None:
            log.warning("web_search_options: skipped, this server runs no hosted tools")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def has_media(self) -> bool:
        return any(m.has_media for m in self.messages)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    echo: bool = False
    suffix: Optional[str] = None  # fill-in-the-middle (fim.py): the text after the one to write

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0
