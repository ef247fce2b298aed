"""An engine request's outputs as Ollama replies: one JSON object, or newline-delimited JSON objects
(`done: false` per piece, then one `done: true` with `done_reason` and the counts and durations in
nanoseconds that Ollama reports).

Reasoning goes to `thinking`, tool calls to `message.tool_calls` (whole calls: Ollama sends a call
once its arguments are complete), the rest to `message.content` (chat) or `response` (generate).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Optional

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.gateway import Opened
from mlxhost.frontends.ollama.errors import ollama_error
from mlxhost.serving.chat_output import ChatOutput, ReasoningDelta
from mlxhost.serving.errors import APIError
from mlxhost.structured.tool_parsers import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

NDJSON = "application/x-ndjson"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


class Durations:
    """Wall-clock marks of one request, reported in nanoseconds as Ollama does."""

    def __init__(self) -> None:
        self.start = time.perf_counter_ns()
        self.loaded: Optional[int] = None  # the model was ready (lease taken, prompt prepared)
        self.first: Optional[int] = None  # the first output arrived

    def mark_loaded(self) -> None:
        self.loaded = time.perf_counter_ns()

    def mark_output(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def stats(self, last: Optional[RequestOutput]) -> dict:
        end = time.perf_counter_ns()
        loaded = self.loaded or self.start
        first = self.first or end
        out = {"total_duration": end - self.start, "load_duration": loaded - self.start,
               "prompt_eval_count": last.num_prompt_tokens if last else 0, "prompt_eval_duration": first - loaded,
               "eval_count": last.num_output_tokens if last else 0, "eval_duration": end - first}
        return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


class Reply:
    """One request's reply in Ollama's shape: `chat` puts text in `message`, otherwise in `response`."""

    def __init__(self, model: str, opened: Opened, chat: bool, durations: Durations,
                 want_logprobs: bool = False) -> None:
        self.model, self.chat, self.durations = model, chat, durations
        self._parser = ChatOutput(opened.prepared.output)
        self._tokenizer = opened.model.tokenizer
        self._prompt_ids = list(getattr(opened.prepared.request, "prompt_token_ids", ()))
        self._output_ids: list[int] = []
        self._want_logprobs = want_logprobs
        self._calls: dict[int, list] = {}  # index -> [name, argument fragments]

    # -- pieces -----------------------------------------------------------------------------------
    def _split(self, out: RequestOutput) -> tuple[str, str, list[dict]]:
        events = self._parser.feed(out.text) if out.text else []
        if out.finished:
            events += self._parser.finish()
        content, thinking, calls = [], [], []
        for e in events:
            if isinstance(e, ContentDelta):
                content.append(e.text)
            elif isinstance(e, ReasoningDelta):
                thinking.append(e.text)
            elif isinstance(e, ToolCallStart):
                self._calls[e.index] = [e.name, []]
            elif isinstance(e, ToolCallArgsDelta):
                self._calls[e.index][1].append(e.fragment)
            elif isinstance(e, ToolCallEnd):
                name, parts = self._calls.pop(e.index)
                calls.append({"function": {"name": name, "arguments": _arguments("".join(parts))}})
        return "".join(content), "".join(thinking), calls

    def _body(self, content: str, thinking: str, calls: list[dict]) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"message": message}
        body: dict = {"response": content}
        if thinking:
            body["thinking"] = thinking
        return body

    def _logprobs(self, out: RequestOutput) -> list[dict]:
        entries = []
        for lp in out.logprobs or ():
            entries.append({"token": self._tokenizer.decode([lp.token_id]), "logprob": lp.logprob,
                            "top_logprobs": [{"token": self._tokenizer.decode([t]), "logprob": v} for t, v in lp.top]})
        return entries

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        """The `done: false` object for one engine output; None when it shows nothing yet."""
        self._output_ids.extend(out.new_token_ids)
        content, thinking, calls = self._split(out)
        logprobs = self._logprobs(out) if self._want_logprobs else []
        if not (content or thinking or calls or logprobs):
            return None
        obj = {"model": self.model, "created_at": now_iso(), **self._body(content, thinking, calls), "done": False}
        if logprobs:
            obj["logprobs"] = logprobs
        return obj

    def keep_alive(self) -> dict:
        """A `done: false` object with empty content: sent at once and while the prompt prefills, so a client's
        read timeout sees a line (clients append the empty content as they do any chunk's)."""
        return {"model": self.model, "created_at": now_iso(), **self._body("", "", []), "done": False}

    def done(self, last: Optional[RequestOutput]) -> dict:
        """The closing object: why it ended, the counts and durations (and a generate's `context`)."""
        obj = {"model": self.model, "created_at": now_iso(), **self._body("", "", []), "done": True,
               "done_reason": _done_reason(last), **self.durations.stats(last)}
        if not self.chat:
            obj["context"] = self._prompt_ids + self._output_ids
        return obj

    # -- the stream's frames (common/stream.py): NDJSON lines ---------------------------------------
    def start(self) -> str:
        """An empty line at once and while the prompt prefills (Ollama itself sends nothing then, and a
        client's read timeout fires on a long prompt)."""
        return line(self.keep_alive())

    waiting = start

    def output(self, out: RequestOutput) -> str | None:
        self.durations.mark_output()
        obj = self.chunk(out)
        return line(obj) if obj is not None else None

    @staticmethod
    def error(error: APIError, out: Optional[RequestOutput]) -> str:
        """An `{"error": ...}` line, as Ollama's clients expect mid-stream."""
        return line(ollama_error(error.status, error.message, error.param, error.code))

    def end(self, last: Optional[RequestOutput]) -> str:
        return line(self.done(last))

    def whole(self, outputs: list[RequestOutput]) -> dict:
        """A non-streamed reply: every output's text joined into one object with the closing fields."""
        content, thinking, calls, logprobs = [], [], [], []
        for out in outputs:
            self._output_ids.extend(out.new_token_ids)
            c, t, k = self._split(out)
            content.append(c), thinking.append(t), calls.extend(k)
            if self._want_logprobs:
                logprobs.extend(self._logprobs(out))
        obj = self.done(outputs[-1] if outputs else None)
        obj.update(self._body("".join(content), "".join(thinking), calls))
        if self._want_logprobs:
            obj["logprobs"] = logprobs
        return obj


def _done_reason(last: Optional[RequestOutput]) -> str:
    if last is None or last.finish_reason is None:
        return "stop"
    return {"length": "length", "abort": "stop"}.get(last.finish_reason, "stop")
