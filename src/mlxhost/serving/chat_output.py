"""A chat reply's text split into what the client sees: reasoning, content and tool calls.

Every API dialect (OpenAI chat, Anthropic Messages, Responses) reads a request's output through one
`ChatOutput`: text deltas in, dialect-neutral events out (`structured.tool_parsers`' events plus
`ReasoningDelta`), so the parsing rules are the same whichever door a request came through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxhost.structured.reasoning import StreamingReasoningParser
from mlxhost.structured.tool_parsers import (
    ContentDelta,
    Event,
    StreamingToolParser,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class OutputSpec:
    """How to read one request's output, decided when its prompt was rendered."""

    reasoning_tags: tuple[str, str] | None = None  # (start, end) when the reply may hold reasoning
    starts_in_reasoning: bool = False  # the prompt opened the reasoning block already
    tool_format: str | None = None  # a `structured.tool_parsers` name when tool calls are parsed
    tools: list | None = None

    @property
    def is_plain(self) -> bool:
        return self.reasoning_tags is None and self.tool_format is None


class ChatOutput:
    def __init__(self, spec: OutputSpec) -> None:
        self._reasoning = (StreamingReasoningParser(*spec.reasoning_tags, starts_in_reasoning=spec.starts_in_reasoning)
                           if spec.reasoning_tags else None)
        self._tools = StreamingToolParser(spec.tool_format, spec.tools) if spec.tool_format else None

    def feed(self, text: str) -> list:
        return self._split(*self._reasoning.feed(text)) if self._reasoning else self._content(text, final=False)

    def finish(self) -> list:
        if self._reasoning is None:
            return self._content("", final=True)
        return self._split(*self._reasoning.finish(), final=True)

    def _split(self, reasoning: str, content: str, final: bool = False) -> list:
        events: list = [ReasoningDelta(reasoning)] if reasoning else []
        return events + self._content(content, final)

    def _content(self, text: str, final: bool) -> list[Event]:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        events = self._tools.feed(text) if text else []
        return events + self._tools.finish() if final else events


@dataclass
class Collected:
    """A whole reply, for the non-streaming answers."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list) -> None:
        for e in events:
            if isinstance(e, ContentDelta):
                self.content += e.text
            elif isinstance(e, ReasoningDelta):
                self.reasoning += e.text
            elif isinstance(e, ToolCallStart):
                self.tool_calls.append(ToolCall(e.id, e.name, ""))
            elif isinstance(e, ToolCallArgsDelta):
                call = self.tool_calls[e.index]
                self.tool_calls[e.index] = ToolCall(call.id, call.name, call.arguments + e.fragment)
            elif isinstance(e, ToolCallEnd):
                pass


def collect(spec: OutputSpec, text: str) -> Collected:
    out = ChatOutput(spec)
    whole = Collected()
    whole.add(out.feed(text))
    whole.add(out.finish())
    return whole
