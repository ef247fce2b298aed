"""Tool calls out of a model's text output, streamed or whole (the formats: tool_formats.py).

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

import json
import secrets
import string
from dataclasses import dataclass
from typing import Union

from mlxhost.structured.reasoning import partial_tag_len
from mlxhost.structured.tool_formats import ToolParserSpec, get_tool_parser

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
