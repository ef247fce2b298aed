"""Chat and text completions as OpenAI renders them: whole objects and SSE chunks, built from engine outputs."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from mlxhost.engine.request import RequestOutput, TokenLogprob
from mlxhost.frontends.common.errors import error_body
from mlxhost.frontends.common.sse import SSE_DONE, sse
from mlxhost.serving.chat_output import ChatOutput, OutputSpec, ReasoningDelta, collect
from mlxhost.serving.errors import APIError
from mlxhost.serving.prepare import choice_request_id
from mlxhost.serving.schemas import CompletionRequest, SamplingFields
from mlxhost.structured.tool_parsers import ContentDelta, ToolCallArgsDelta, ToolCallStart


def completion_usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    """OpenAI's `usage` of a chat or text completion."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def echo_text(body: SamplingFields, tokenizer) -> str | None:
    """What a text completion's `echo` puts before the reply: the prompt as sent (token ids decoded)."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return None
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(
        body.prompt[0], (str, list)) else body.prompt
    return prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt))


class CompletionBuilder:
    """Shapes one request's outputs as a chat or text completion (whole or streamed chunk by chunk)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any, output: OutputSpec | None = None,
                 index: int = 0, echo: str | None = None, echo_logprobs: list | None = None) -> None:
        self.id = request_id
        self.index = index  # the choice this builder shapes (n > 1: one builder per choice, one id)
        # Replies that may hold reasoning or tool calls are read through a parser; plain ones stream as is.
        self.output = output if chat and output is not None and not output.is_plain else None
        self._parser = ChatOutput(self.output) if self.output is not None else None
        self._num_calls = 0
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._tok = tokenizer
        self._text_templates: dict[str | None, list[str]] = {}  # delta key -> text chunk around the text
        # A text completion's `echo`: the prompt, put before the reply's text (and its logprobs, when the
        # engine scored it, before the reply's); streamed, in the first chunk. `echo_logprobs`: the prompt's
        # entries when another choice's request carried them (n > 1 scores the prompt once).
        self.echo = echo
        self.echo_logprobs = echo_logprobs
        self._echo_pending = echo is not None

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    # -- logprobs ------------------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        return {
            "tokens": [self._token_str(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # An echoed prompt's first token has nothing before it: null, as OpenAI gives it.
            "top_logprobs": [{self._token_str(t): lp for t, lp in e.top} if e.logprob is not None else None
                             for e in entries],
            "text_offset": [],
        }

    def _chat_logprob(self, e: TokenLogprob) -> dict:
        def one(token_id: int, lp: float) -> dict:
            s = self._token_str(token_id)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        entry = one(e.token_id, e.logprob)
        entry["top_logprobs"] = [one(t, lp) for t, lp in e.top]
        return entry

    # -- whole response ------------------------------------------------------------------------
    def full(self, text: str, finish_reason: str, num_prompt: int, num_completion: int, lps: list | None,
             num_cached: int = 0, prompt_lps: list | None = None) -> dict:
        if self.echo is not None:
            text = self.echo + text
            prompt_lps = prompt_lps or self.echo_logprobs
            lps = [*(prompt_lps or ()), *(lps or ())] if lps is not None or prompt_lps else None
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if self.output is not None:
                whole = collect(self.output, text)
                message["content"] = whole.content if whole.content or not whole.tool_calls else None
                if whole.reasoning:
                    message["reasoning_content"] = whole.reasoning
                if whole.tool_calls:
                    message["tool_calls"] = [_tool_call(c.id, c.name, c.arguments) for c in whole.tool_calls]
                    finish_reason = _with_calls(finish_reason)
            choice = {"index": self.index, "message": message, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": self.index, "text": text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        if lps is not None:
            choice["logprobs"] = self.logprobs(lps)
        return self._envelope(obj, [choice], usage=completion_usage(num_prompt, num_completion, num_cached))

    # -- streaming -----------------------------------------------------------------------------
    def first_chunk(self) -> str:
        """Sent at once, before the prompt prefills: the first bytes a client's timers count. A data chunk, not
        an SSE comment, which the SDKs' parsers drop before any idle timer sees it (Qwen Code's)."""
        return sse(self._chunk({"role": "assistant", "content": ""} if self.chat else "", None))

    def keep_alive(self) -> str:
        """A chunk that adds nothing (an empty delta, or empty text), sent while the prompt prefills: every
        client parses it as a chunk and resets its stream idle timer."""
        return sse(self._chunk({} if self.chat else "", None))

    def _chunk(self, delta_or_text: Any, finish_reason: str | None, lps: list | None = None) -> dict:
        if self.chat:
            choice = {"index": self.index, "delta": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": self.index, "text": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        if lps:
            choice["logprobs"] = self.logprobs(lps)
        return self._envelope(obj, [choice])

    def chunk(self, out: RequestOutput) -> str | None:
        if self._echo_pending:
            self._echo_pending = False
            prompt_lps = out.prompt_logprobs or self.echo_logprobs
            lps = [*prompt_lps, *(out.logprobs or ())] if prompt_lps else out.logprobs
            out = replace(out, text=self.echo + out.text, logprobs=lps)
        if self._parser is not None:
            return self._parsed_chunks(out)
        if not out.text and not out.finish_reason and not out.logprobs:
            return None
        if not out.finish_reason and not out.logprobs:
            return self._text_sse("content" if self.chat else None, out.text)
        body = ({"content": out.text} if out.text else {}) if self.chat else out.text
        return sse(self._chunk(body, out.finish_reason, out.logprobs))

    def _text_sse(self, key: str | None, text: str) -> str:
        """The common chunk, text only (`key`: the chat delta's field; None: a completion's text), from a
        template: one small dumps instead of a whole object. Under load the HTTP thread spends its GIL
        time on these chunks, time the engine thread then waits for."""
        template = self._text_templates.get(key)
        if template is None:
            marker = "\x00"
            body = sse(self._chunk({key: marker} if self.chat else marker, None))
            template = self._text_templates[key] = body.split(json.dumps(marker))
        head, tail = template
        return head + json.dumps(text, ensure_ascii=False) + tail

    def _parsed_chunks(self, out: RequestOutput) -> str | None:
        """One SSE chunk per reasoning / content / tool-call event (OpenAI's delta shapes), the finish
        reason on the last; tag text never reaches a delta."""
        events = self._parser.feed(out.text) if out.text else []
        if out.finished:
            events += self._parser.finish()
        deltas = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                deltas.append({"reasoning_content": e.text})
            elif isinstance(e, ContentDelta):
                deltas.append({"content": e.text})
            elif isinstance(e, ToolCallStart):
                self._num_calls += 1
                deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                               "function": {"name": e.name, "arguments": ""}}]})
            elif isinstance(e, ToolCallArgsDelta):
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]})
        finish = out.finish_reason
        if finish and self._num_calls:
            finish = _with_calls(finish)
        if finish or (out.logprobs and not deltas):
            deltas.append({})
        if not deltas:
            return None
        if len(deltas) == 1 and not finish and not out.logprobs and len(deltas[0]) == 1:
            (key, text), = deltas[0].items()
            if isinstance(text, str):  # reasoning or content; a tool call's delta is a list
                return self._text_sse(key, text)
        return "".join(sse(self._chunk(d, finish if i == len(deltas) - 1 else None, out.logprobs if i == 0 else None))
                       for i, d in enumerate(deltas))

    def usage_chunk(self, num_prompt: int, num_completion: int, num_cached: int = 0) -> str:
        return self.usage_chunk_of(completion_usage(num_prompt, num_completion, num_cached))

    def usage_chunk_of(self, counts: dict) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, [], usage=counts))


def choices_usage(lasts: list[RequestOutput]) -> dict:
    """The usage of n choices: the prompt counts once (it was prefilled once); cached_tokens the most any choice
    got for free."""
    return completion_usage(lasts[0].num_prompt_tokens, sum(o.num_output_tokens for o in lasts),
                            max(o.num_cached_tokens for o in lasts))


class CompletionFrames:
    """A chat or text completion's stream frames (common/stream.py) for its n choices, one builder each; the
    outputs of choice i carry its engine request id (serving/prepare.py `choice_request_id`)."""

    def __init__(self, builders: list[CompletionBuilder], include_usage: bool) -> None:
        self.builders = builders
        self.include_usage = include_usage
        self._index = {choice_request_id(builders[0].id, i): i for i in range(len(builders))}
        self._lasts: dict[int, RequestOutput] = {}

    def _choice(self, out: RequestOutput) -> int:
        return self._index.get(out.request_id, 0) if len(self.builders) > 1 else 0

    def start(self) -> str:
        return "".join(b.first_chunk() for b in self.builders)

    def waiting(self) -> str:  # an empty chunk keeps clients' idle timers from firing
        return self.builders[0].keep_alive()

    def output(self, out: RequestOutput) -> str | None:
        i = self._choice(out)
        if i == 0 and out.prompt_logprobs and i not in self._lasts:  # the other choices echo choice 0's
            for b in self.builders[1:]:
                b.echo_logprobs = out.prompt_logprobs
        self._lasts[i] = out
        return self.builders[i].chunk(out)

    def error(self, error: APIError, out: RequestOutput | None) -> str:
        # Ended by the server (shutdown): the choice's end, then why.
        end = self.builders[self._choice(out)].chunk(out) if out is not None and out.finish_reason else None
        return (end or "") + sse(error_body(error.status, error.message, error.param, error.code)) + self._tail()

    def end(self, last: RequestOutput | None) -> str:
        return self._tail()

    def _tail(self) -> str:
        if self.include_usage and len(self._lasts) == len(self.builders):
            usage = choices_usage([self._lasts[i] for i in range(len(self.builders))])
            return self.builders[0].usage_chunk_of(usage) + SSE_DONE
        return SSE_DONE


def _tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _with_calls(finish_reason: str) -> str:
    # A reply that ended on its own after calling tools: "tool_calls"; cut by max_tokens stays "length".
    return "tool_calls" if finish_reason == "stop" else finish_reason
