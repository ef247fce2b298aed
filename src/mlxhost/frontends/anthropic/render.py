"""An engine request's outputs as an Anthropic message: whole, or as Messages' SSE event grammar
(message_start, ping, content_block_start / _delta / _stop per block, message_delta, message_stop).

Usage: `input_tokens` counts the prompt tokens that were computed, `cache_read_input_tokens` those
served from the prefix cache (their sum is the prompt, what count_tokens reports), as Anthropic splits
them. A request with a cache breakpoint writes its prompt's full blocks beyond the hit to the cache under it:
those are `cache_creation_input_tokens` (and not in `input_tokens`); without one it is 0.
"""

from __future__ import annotations

import json
import uuid

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.anthropic.errors import anthropic_error
from mlxhost.frontends.common.gateway import Opened, Whole
from mlxhost.frontends.common.sse import sse_event
from mlxhost.serving.chat_output import ChatOutput, ReasoningDelta, collect
from mlxhost.serving.errors import APIError
from mlxhost.structured.tool_parsers import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def message_usage(num_prompt: int, num_output: int, num_cached: int, num_created: int = 0) -> dict:
    """Anthropic's `usage`: the prompt split into computed, cache-written and cache-read tokens."""
    return {"input_tokens": num_prompt - num_cached - num_created, "output_tokens": num_output,
            "cache_read_input_tokens": num_cached, "cache_creation_input_tokens": num_created}


def tool_use_id(call_id: str) -> str:
    # The parsers name calls OpenAI's way (call_...); Anthropic clients expect toolu_...
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    # The tool parsers only emit calls whose arguments parsed as a JSON object.
    return json.loads(arguments) if arguments else {}


class MessageBuilder:
    def __init__(self, model: str, opened: Opened, stop_sequences: tuple[str, ...]) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self._spec = opened.prepared.output
        self._tokenizer = opened.model.tokenizer
        self._eos_ids = opened.model.eos_token_ids
        self._progress = opened.progress
        request = getattr(opened.prepared, "request", None)
        self._num_prompt = request.num_prompt_tokens if request is not None else 0
        self._stops = stop_sequences
        # Streaming state: the open block's kind ("text", "thinking", "tool_use") and index.
        self._parser = ChatOutput(self._spec)
        self._open: str | None = None
        self._index = -1
        self._num_calls = 0
        self._token_ids: list[int] = []  # kept only with stop sequences: to tell which one stopped it

    # -- stop reason ---------------------------------------------------------------------------
    def _stop(self, finish: str | None, token_ids: list[int], num_calls: int) -> tuple[str, str | None]:
        if finish == "length":
            return "max_tokens", None
        if num_calls:
            return "tool_use", None
        if finish == "stop" and self._stops and token_ids and token_ids[-1] not in self._eos_ids:
            return "stop_sequence", self._which_stop(token_ids)
        return "end_turn", None

    def _which_stop(self, token_ids: list[int]) -> str | None:
        """The engine cuts the text before the first stop string: the earliest one in the full decode."""
        text = self._tokenizer.decode(token_ids)
        found = [(text.find(s), s) for s in self._stops if s in text]
        if found:
            return min(found)[1]
        return self._stops[0] if len(self._stops) == 1 else None

    # -- whole message -------------------------------------------------------------------------
    def message(self, whole: Whole) -> dict:
        reply = collect(self._spec, whole.text)
        content: list[dict] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.content or not (content or reply.tool_calls):
            content.append({"type": "text", "text": reply.content})
        for call in reply.tool_calls:
            content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                            "input": _input(call.arguments)})
        last = whole.last
        reason, sequence = self._stop(last.finish_reason, whole.token_ids, len(reply.tool_calls))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": message_usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens,
                                       last.num_cache_creation_tokens)}

    # -- streaming -----------------------------------------------------------------------------
    def start(self) -> str:
        """Sent at once, before the prompt is prefilled: how much of it the prefix cache holds is not known
        yet, so the usage counts the whole prompt as input; `message_delta` at the end has the split."""
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": message_usage(self._num_prompt, 0, 0)}
        return sse_event("message_start", {"type": "message_start", "message": message}) + self.ping()

    @staticmethod
    def ping(progress: dict | None = None) -> str:
        """Anthropic's keep-alive event (the SDKs skip it; raw readers and logs see it). While the prompt
        prefills it carries the request's progress: tokens done of the total, the cached part, tokens per second."""
        event: dict = {"type": "ping"}
        if progress is not None and progress["state"] != "decoding":
            event["prefill"] = {key: progress[key] for key in
                                ("state", "prefilled_tokens", "prefill_tokens", "cached_tokens",
                                 "prefill_tokens_per_s")}
        return sse_event("ping", event)

    def progress_ping(self) -> str:
        return self.ping(self._progress())

    def _begin(self, kind: str, block: dict) -> str:
        text = self._end()
        self._index += 1
        self._open = kind
        return text + sse_event("content_block_start", {"type": "content_block_start", "index": self._index,
                                                        "content_block": block})

    def _end(self) -> str:
        if self._open is None:
            return ""
        self._open = None
        return sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def chunk(self, out: RequestOutput) -> str:
        """The events for one engine output; at the last one, every block is closed."""
        if self._stops:
            self._token_ids.extend(out.new_token_ids)
        events = self._parser.feed(out.text) if out.text else []
        if out.finished:
            events += self._parser.finish()
        parts = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                if self._open != "thinking":
                    parts.append(self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                parts.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, ContentDelta):
                if self._open != "text":
                    parts.append(self._begin("text", {"type": "text", "text": ""}))
                parts.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallStart):
                self._num_calls += 1
                parts.append(self._begin("tool_use", {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name,
                                                      "input": {}}))
            elif isinstance(e, ToolCallArgsDelta):
                parts.append(self._delta({"type": "input_json_delta", "partial_json": e.fragment}))
            elif isinstance(e, ToolCallEnd):
                parts.append(self._end())
        if out.finished:
            parts.append(self._end())
        return "".join(parts)

    # -- the stream's frames (common/stream.py) ------------------------------------------------
    def waiting(self) -> str:  # still prefilling (or queued): pings keep the client's idle timer from firing
        return self.progress_ping()

    def output(self, out: RequestOutput) -> str:
        return self.chunk(out)

    @staticmethod
    def error(error: APIError, out: RequestOutput | None) -> str:
        return sse_event("error", anthropic_error(error.status, error.message, error.param, error.code))

    def end(self, last: RequestOutput | None) -> str:
        return self.stop(last) if last is not None and last.finished else ""

    def stop(self, last: RequestOutput) -> str:
        token_ids = self._token_ids or list(last.new_token_ids)
        reason, sequence = self._stop(last.finish_reason, token_ids, self._num_calls)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": message_usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens,
                                        last.num_cache_creation_tokens)}
        return sse_event("message_delta", delta) + sse_event("message_stop", {"type": "message_stop"})

