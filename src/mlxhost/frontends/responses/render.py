"""An engine request's outputs as an OpenAI Responses object: output items (reasoning, message,
function_call) built as the text streams in, and the `response.*` SSE events that announce them.

A non-streamed response is the same machine fed the whole text at once, with its events dropped, so
both ways give the same items. Usage: `input_tokens` is the whole prompt, `cached_tokens` the part of it
the prefix cache served (OpenAI's split); reasoning tokens are not counted apart (0).
"""

from __future__ import annotations

import uuid
from typing import Callable

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import error_type
from mlxhost.frontends.common.sse import sse_event
from mlxhost.serving.chat_output import ChatOutput, OutputSpec, ReasoningDelta
from mlxhost.serving.errors import APIError
from mlxhost.structured.tool_parsers import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def _frame(event: dict) -> str:
    return sse_event(event["type"], event)


# An SSE comment: raw readers see bytes, but the SDKs' parsers drop it before any idle timer counts it (the
# renderer's `keep_alive` event is what streams send while prefilling).
KEEP_ALIVE = ": keep-alive\n\n"


def response_usage(num_prompt: int, num_output: int, num_cached: int) -> dict:
    """The Responses API's `usage`: the whole prompt as input, the cached part in its details."""
    return {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt + num_output}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseRenderer:
    def __init__(self, envelope: dict, spec: OutputSpec) -> None:
        """`envelope`: the response object's fields that echo the request (id, model, tools, ...)."""
        self.envelope = envelope
        self.items: list[dict] = []
        self._parser = ChatOutput(spec)
        self._open: dict | None = None  # the item being written
        self._text: list[str] = []  # its text (reasoning, output_text or arguments) so far
        self._seq = 0

    @property
    def id(self) -> str:
        return self.envelope["id"]

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self, status: str, last: RequestOutput | None = None, error: dict | None = None) -> dict:
        incomplete = status == "incomplete"
        return {**self.envelope, "status": status, "output": list(self.items), "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": response_usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) if last else None}

    # -- items ---------------------------------------------------------------------------------
    def _begin(self, item: dict, part: dict | None) -> list[dict]:
        events = self._end("completed")
        self._open, self._text = item, []
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        return events

    def _end(self, status: str) -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open = None
        text, index = "".join(self._text), len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = text
            return [self._event("response.function_call_arguments.done", **where, arguments=text, name=item["name"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
        item["content"] = [part]
        return [done, self._event("response.content_part.done", **where, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _delta(self, kind: str, text: str, content_index: bool = True, **extra) -> dict:
        self._text.append(text)
        where = {"item_id": self._open["id"], "output_index": len(self.items) - 1}
        if content_index:
            where["content_index"] = 0
        return self._event(kind, **where, delta=text, **extra)

    def feed(self, text: str, final: bool = False, incomplete: bool = False) -> list[dict]:
        """The events for more output text; `final`: the last of it (every item is closed)."""
        parsed = self._parser.feed(text) if text else []
        if final:
            parsed += self._parser.finish()
        events: list[dict] = []
        for e in parsed:
            kind = self._open["type"] if self._open else None
            if isinstance(e, ReasoningDelta):
                if kind != "reasoning":
                    events += self._begin({"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                           "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
                events.append(self._delta("response.reasoning_text.delta", e.text))
            elif isinstance(e, ContentDelta):
                if kind != "message":
                    events += self._begin({"id": new_id("msg"), "type": "message", "role": "assistant",
                                           "status": "in_progress", "content": []},
                                          {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                events.append(self._delta("response.output_text.delta", e.text, logprobs=[]))
            elif isinstance(e, ToolCallStart):
                events += self._begin({"id": "fc_" + e.id.removeprefix("call_"), "type": "function_call",
                                       "call_id": e.id, "name": e.name, "arguments": "", "status": "in_progress"},
                                      None)
            elif isinstance(e, ToolCallArgsDelta):
                events.append(self._delta("response.function_call_arguments.delta", e.fragment, content_index=False))
            elif isinstance(e, ToolCallEnd):
                events += self._end("completed")
        if final:
            events += self._end("incomplete" if incomplete else "completed")
        return events

    # -- the response's life -------------------------------------------------------------------
    def begin(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def keep_alive(self) -> dict:
        """While the prompt prefills: `response.in_progress` again (Responses has no ping event), which the
        SDKs and Codex take as a lifecycle event of the same response and their idle timers count."""
        return self._event("response.in_progress", response=self.response("in_progress"))

    def finish(self, last: RequestOutput) -> tuple[dict, dict]:
        """The final response object and the event that carries it."""
        status = "incomplete" if last.finish_reason == "length" else "completed"
        response = self.response(status, last)
        return response, self._event(f"response.{status}", response=response)

    def failed(self, error: APIError) -> dict:
        """`response.failed`, its error's code the one a whole reply's error carries (its type where it has none)."""
        code = error.code or error_type(error.status)
        failure = {"code": code, "message": error.message}
        return self._event("response.failed", response=self.response("failed", error=failure))



class ResponseFrames:
    """A response's stream frames (common/stream.py); `on_done` gets the final response object."""

    def __init__(self, renderer: ResponseRenderer, on_done: Callable[[dict], None]) -> None:
        self.renderer, self.on_done = renderer, on_done

    def start(self) -> str:
        return "".join(_frame(e) for e in self.renderer.begin())

    def waiting(self) -> str:
        return _frame(self.renderer.keep_alive())

    def output(self, out: RequestOutput) -> str:
        events = self.renderer.feed(out.text, final=out.finished, incomplete=out.finish_reason == "length")
        return "".join(_frame(e) for e in events)

    def error(self, error: APIError, out: RequestOutput | None) -> str:
        return _frame(self.renderer.failed(error))

    def end(self, last: RequestOutput | None) -> str:
        if last is None or not last.finished:
            return ""
        response, event = self.renderer.finish(last)
        self.on_done(response)
        return _frame(event)
