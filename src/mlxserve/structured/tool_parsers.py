"""Tool calls out of a model's text output, streamed or whole.

Formats (registry name -> what the model writes):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated for parallel calls; or one bare
               `{"name": ..., "arguments": {...}}` as the whole reply (small Qwen2.5 models often drop the tags)
  qwen3_coder  `<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`
  llama3_json  optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`, several joined by `;`
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}`
  pythonic     `[get_weather(city="Paris"), other(x=1)]`, bare or inside `<|tool_call_start|>...<|tool_call_end|>`

The text between the tags is parsed by mlx-lm's own parsers (`mlx_lm.tool_parsers.<module>.parse_tool_call`)
where one exists; llama3_json is written here. They are imported on first use, because importing any
mlx_lm module runs its package `__init__`, which loads MLX, and this module must stay importable without it.

Choices:
- A call's events (start, arguments, end) are emitted together when the call closes: until then it may
  still turn out malformed or unterminated and must become content, and an event cannot be taken back.
  Its arguments come as one `ToolCallArgsDelta` holding the canonical compact JSON string.
- A malformed call is content: the raw text, tags included. Nothing here raises on model output.
- A call naming a function that is not in `tools` is still a call: OpenAI clients report unknown tools
  themselves, and dropping it would hide what the model did.
- Whitespace before a parsed call, and whitespace after the last one, are dropped (`Sure.\\n\\n<tool_call>`
  gives content `Sure.`), so a reply of calls alone has empty content; `a <call> b` gives `a b`.
- A call without an end tag (mistral, `<|python_tag|>`) runs to the next start tag or to the end of output.
- The call still open when the output ends (cut by max_tokens, or a model that never wrote the end tag) is
  a call if its text parses as one, as vLLM reads it; otherwise it is dropped: a half-written call is
  neither a call nor something to show the user as text.
  An implicit call (llama3_json's `{`, pythonic's `[` as the first non-space character of the output) runs
  to the end of output, its text held meanwhile; it is abandoned (re-read as content) as soon as its head
  cannot be a call (`[Docs](...)`, `{"answer": ...}`), so ordinary replies still stream.
- `parse_complete` is the streaming parser fed the whole text at once, so the two cannot disagree.
"""

from __future__ import annotations

import importlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Union

from mlxserve.structured.reasoning import partial_tag_len

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON object text


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = Union[ContentDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


@dataclass(frozen=True)
class ToolParserSpec:
    """One format. `end == ""`: a call runs to the next `start` or to the end of output.
    `implicit_start`: a character that opens a call when it begins the output (no tag), running to its end."""

    name: str
    start: str
    end: str
    parse: Callable[[str, list | None], list]  # text between the tags -> [{"name", "arguments"}]; raises if bad
    implicit_start: str = ""
    viable: Callable[[str], bool] | None = None  # can this implicit-call prefix still be a call?
    parse_implicit: Callable[[str, list | None], list] | None = None  # an implicit call's parser (else `parse`)
    mlx_lm_module: str | None = None  # the mlx_lm.tool_parsers module doing the parsing, if any


# ---------------------------------------------------------------------------------------------------
# Formats


def _mlx_lm(module: str):
    return importlib.import_module(f"mlx_lm.tool_parsers.{module}")


def _as_list(parsed) -> list:
    return parsed if isinstance(parsed, list) else [parsed]


def _parse_hermes(text: str, tools) -> list:
    return [_mlx_lm("json_tools").parse_tool_call(text, tools)]


def _parse_hermes_bare(text: str, tools) -> list:
    """A whole reply that is one call object without its tags: stricter than inside tags, since any JSON
    answer starts like this. Exactly the keys name and arguments, and (given tools) a known name."""
    obj = json.loads(text.strip())
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or not isinstance(obj["arguments"], dict):
        raise ValueError("not a bare tool call")
    names = {(t.get("function") or {}).get("name") for t in tools or () if isinstance(t, dict)}
    if tools and obj["name"] not in names:
        raise ValueError("a bare tool call must name one of the tools")
    return [obj]


def _parse_qwen3_coder(text: str, tools) -> list:
    # Its `</function>$` anchor wants the function block last; the newline before `</tool_call>` is ours to drop.
    return [_mlx_lm("qwen3_coder").parse_tool_call(text.strip(), tools)]


def _parse_mistral(text: str, tools) -> list:
    return _as_list(_mlx_lm("mistral").parse_tool_call(text.strip(), tools))


def _parse_pythonic(text: str, tools) -> list:
    text = text.strip()
    # mlx-lm's parser looks for the first `[` and last `]` anywhere; a call is the whole payload.
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError("pythonic tool calls are one [...] list")
    return _as_list(_mlx_lm("pythonic").parse_tool_call(text, tools))


def _parse_llama3_json(text: str, tools) -> list:
    """`{...}` objects separated by `;`. mlx-lm has no parser for it."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls, pos = [], 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        if not isinstance(obj, dict) or not ("parameters" in obj or "arguments" in obj):
            # A JSON answer with a "name" key is not a call: llama3 always writes the arguments key.
            raise ValueError("not a llama3 tool call")
        calls.append(obj)
        rest = text[pos:].lstrip()
        if rest and rest[0] != ";":
            raise ValueError("llama3 tool calls are separated by ';'")
        pos = len(text) - len(rest[1:].lstrip())
    if not calls:
        raise ValueError("no tool call")
    return calls


def _viable_by(head: str, prefix: str) -> Callable[[str], bool]:
    """True while the text matches `head` or is still a prefix of it (`prefix` fully matches the
    incomplete forms). Monotone: once false it stays false, whatever comes next."""
    head_re, prefix_re = re.compile(head), re.compile(prefix)
    return lambda text: bool(head_re.match(text) or prefix_re.fullmatch(text))


_SPECS = MappingProxyType(
    {
        "hermes": ToolParserSpec(
            "hermes",
            "<tool_call>",
            "</tool_call>",
            _parse_hermes,
            implicit_start="{",
            viable=_viable_by(r'\{\s*"name"\s*:', r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?'),
            parse_implicit=_parse_hermes_bare,
            mlx_lm_module="json_tools",
        ),
        "qwen3_coder": ToolParserSpec(
            "qwen3_coder", "<tool_call>", "</tool_call>", _parse_qwen3_coder, mlx_lm_module="qwen3_coder"
        ),
        "llama3_json": ToolParserSpec(
            "llama3_json",
            "<|python_tag|>",
            "",
            _parse_llama3_json,
            implicit_start="{",
            viable=_viable_by(r'\{\s*"(?:name|type|parameters|arguments)"', r'\{\s*(?:"[a-z]*)?'),
        ),
        "mistral": ToolParserSpec("mistral", "[TOOL_CALLS]", "", _parse_mistral, mlx_lm_module="mistral"),
        "pythonic": ToolParserSpec(
            "pythonic",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            _parse_pythonic,
            implicit_start="[",
            viable=_viable_by(r"\[\s*[A-Za-z_][\w.]*\s*\(", r"\[\s*(?:[A-Za-z_][\w.]*\s*)?"),
            mlx_lm_module="pythonic",
        ),
    }
)
TOOL_PARSER_NAMES: tuple[str, ...] = tuple(_SPECS)
# Tags the parsers read; where a tokenizer makes one a *special* token (Mistral's `[TOOL_CALLS]` and `[ARGS]`,
# Llama 3's `<|python_tag|>`) the detokenizer still writes it out, or no call could be found.
TOOL_TAGS = frozenset({t for spec in _SPECS.values() for t in (spec.start, spec.end) if t} | {"[ARGS]"})


def get_tool_parser(name: str) -> ToolParserSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {', '.join(TOOL_PARSER_NAMES)}") from None


# Template text -> format, most specific first (qwen3_coder's template also holds `<tool_call>`).
_TEMPLATE_MARKERS = (
    (("<tool_call>\\n<function=", "<tool_call>\n<function="), "qwen3_coder"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|tool_call_start|>", "<|tool_list_start|>", "[func_name1("), "pythonic"),
    (("<tool_call>",), "hermes"),
    (("<|python_tag|>", '"parameters": dictionary of argument name'), "llama3_json"),
)
_MODEL_TYPE_PARSERS = MappingProxyType(
    {
        "qwen2": "hermes",
        "qwen2_moe": "hermes",
        "qwen3": "hermes",
        "qwen3_moe": "hermes",
        "qwen3_next": "hermes",
        "llama": "llama3_json",
        "llama4": "pythonic",
        "lfm2": "pythonic",
        "mistral": "mistral",
        "mistral3": "mistral",
        "ministral": "mistral",
    }
)


def choose_tool_parser(chat_template: str | None, model_type: str | None, override: str | None) -> str | None:
    """The format name for a model: `override` if given (unknown -> ValueError), else what the chat
    template's text shows, else the model_type's usual format, else None (no tool-call parsing)."""
    if override is not None:
        return get_tool_parser(override).name
    if chat_template:
        for markers, name in _TEMPLATE_MARKERS:
            if any(m in chat_template for m in markers):
                return name
    return _MODEL_TYPE_PARSERS.get(model_type or "")


def _to_tool_call(obj) -> ToolCall:
    """One parsed call -> ToolCall with canonical arguments; ValueError/TypeError if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call needs a name")
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(arguments, str):  # some models (and templates) write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    # allow_nan=False: NaN/Infinity are not JSON, and the client must be able to parse the string.
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # A payload's own id is kept (Mistral writes one, and its template wants it back); else a fresh one.
    call_id = obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else make_tool_call_id()
    return ToolCall(call_id, obj["name"], text)


# ---------------------------------------------------------------------------------------------------
# Streaming


class StreamingToolParser:
    """Feed content deltas (reasoning already split off); get events. `finish()` flushes what was held."""

    def __init__(self, fmt: str | ToolParserSpec, tools: list | None = None):
        self.spec = fmt if isinstance(fmt, ToolParserSpec) else get_tool_parser(fmt)
        self.tools = tools
        self.num_calls = 0
        self._buf = ""  # content not yet emitted, or the body of the open call
        self._in_call = False
        self._implicit = False  # the open call began without a tag and runs to the end of output
        self._held_ws = ""  # whitespace before the open call: dropped if it parses, content if not
        self._at_start = True  # only whitespace so far: an implicit call may still open
        self._after_call = False  # a call closed and only whitespace followed: dropped at finish
        self._scan = 0  # how far the open call's body was searched for its closing tag

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._step_call(events, final) if self._in_call else self._step_content(events, final):
            pass
        return events

    def _step_content(self, events: list[Event], final: bool) -> bool:
        """Emit what is surely content; return True if a call opened (more to do)."""
        buf, spec = self._buf, self.spec
        if self._after_call and buf.strip():
            self._after_call = False
        if self._at_start and buf.strip():
            self._at_start = False
            body = buf.lstrip()
            if spec.implicit_start and body[0] == spec.implicit_start:
                self._open_call(buf[: len(buf) - len(body)], body, implicit=True)
                return True
        i = buf.find(spec.start)
        if i >= 0:
            head = buf[:i]
            self._emit(events, head.rstrip())
            self._open_call(head[len(head.rstrip()) :], buf[i + len(spec.start) :], implicit=False)
            return True
        if final:
            self._buf = ""
            self._emit(events, "" if self._after_call else buf)  # only whitespace after a last call
            return False
        # Hold a possible partial start tag, and the whitespace before it (dropped if a call follows).
        cut = len(buf[: len(buf) - partial_tag_len(buf, spec.start)].rstrip())
        self._buf = buf[cut:]
        self._emit(events, buf[:cut])
        return False

    def _step_call(self, events: list[Event], final: bool) -> bool:
        """Close the open call if its end is here; return True if it closed (more to do)."""
        buf, spec = self._buf, self.spec
        if self._implicit:
            if spec.viable is not None and not spec.viable(buf):
                self._reread_as_content()
                return True
            if not final:
                return False
            if not self._close_call(events, buf, raw=None, parse=spec.parse_implicit):
                self._buf = self._held_ws + buf
                self._held_ws = ""
                return True  # re-read as content: it may still hold tagged calls
            self._buf = ""
            return False
        closer = spec.end or spec.start  # without an end tag, the next start tag closes the call
        j = buf.find(closer, self._scan)
        if j < 0:
            if not final:
                self._scan = max(0, len(buf) - len(closer) + 1)
                return False
            # The output ended inside the call: a call if it parses, else dropped (no raw text).
            self._buf = ""
            self._close_call(events, buf, raw=None)
            self._held_ws = ""
            return False
        body = buf[:j]
        # With an end tag, it is consumed; without one, the next start tag stays to open the next call.
        self._buf = buf[j + len(spec.end) :]
        self._close_call(events, body, raw=spec.start + body + spec.end)
        return True

    def _open_call(self, held_ws: str, body: str, implicit: bool) -> None:
        self._in_call, self._implicit = True, implicit
        self._held_ws, self._buf, self._scan = held_ws, body, 0

    def _reread_as_content(self) -> None:
        self._in_call = self._implicit = False
        self._buf = self._held_ws + self._buf
        self._held_ws = ""

    def _close_call(self, events: list[Event], body: str, raw: str | None, parse=None) -> bool:
        """Parse a closed call into events; if it is malformed, emit `raw` as content (unless None).
        Returns whether it parsed."""
        self._in_call = self._implicit = False
        try:
            calls = [_to_tool_call(obj) for obj in (parse or self.spec.parse)(body, self.tools)]
        except Exception:  # whatever a parser raises on model output means "not a call", never a 500
            calls = []
        if not calls:
            if raw is not None:
                self._emit(events, self._held_ws + raw)
                self._held_ws = ""
            return False
        for call in calls:
            index = self.num_calls
            self.num_calls += 1
            events += [ToolCallStart(index, call.id, call.name), ToolCallArgsDelta(index, call.arguments)]
            events.append(ToolCallEnd(index))
        self._held_ws = ""
        self._after_call = True
        return True

    @staticmethod
    def _emit(events: list[Event], text: str) -> None:
        if text:
            events.append(ContentDelta(text))


def collect_tool_events(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """(content, calls) from a whole event stream."""
    content: list[str] = []
    heads: dict[int, ToolCallStart] = {}
    args: dict[int, list[str]] = {}
    calls: list[ToolCall] = []
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            heads[event.index], args[event.index] = event, []
        elif isinstance(event, ToolCallArgsDelta):
            args[event.index].append(event.fragment)
        else:
            head = heads[event.index]
            calls.append(ToolCall(head.id, head.name, "".join(args[event.index])))
    return "".join(content), calls


def parse_complete(fmt: str | ToolParserSpec, text: str, tools: list | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the streaming parser fed everything at once."""
    parser = StreamingToolParser(fmt, tools)
    return collect_tool_events(parser.feed(text) + parser.finish())
