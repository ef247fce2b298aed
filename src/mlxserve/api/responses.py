"""OpenAI response objects and SSE chunks, built from engine outputs."""

from __future__ import annotations

import json
import time
from typing import Any

from mlxserve.engine.request import RequestOutput, TokenLogprob


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


class ResponseBuilder:
    """Shapes one request's outputs as a chat or text completion (whole or streamed chunk by chunk)."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        self._tok = tokenizer
        self._text_template: list[str] | None = None

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
            "top_logprobs": [{self._token_str(t): lp for t, lp in e.top} for e in entries],
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
             num_cached: int = 0) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        if lps is not None:
            choice["logprobs"] = self.logprobs(lps)
        return self._envelope(obj, [choice], usage=usage(num_prompt, num_completion, num_cached))

    # -- streaming -----------------------------------------------------------------------------
    def first_chunk(self) -> str | None:
        if not self.chat:
            return None
        return sse(self._chunk({"role": "assistant", "content": ""}, None))

    def _chunk(self, delta_or_text: Any, finish_reason: str | None, lps: list | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        if lps:
            choice["logprobs"] = self.logprobs(lps)
        return self._envelope(obj, [choice])

    def chunk(self, out: RequestOutput) -> str | None:
        if not out.text and not out.finish_reason and not out.logprobs:
            return None
        if not out.finish_reason and not out.logprobs:
            # The common chunk (text only) from a template: one small dumps instead of a whole object.
            if self._text_template is None:
                marker = "\x00"
                body = sse(self._chunk({"content": marker} if self.chat else marker, None))
                self._text_template = body.split(json.dumps(marker))
            head, tail = self._text_template
            return head + json.dumps(out.text, ensure_ascii=False) + tail
        body = ({"content": out.text} if out.text else {}) if self.chat else out.text
        return sse(self._chunk(body, out.finish_reason, out.logprobs))

    def usage_chunk(self, num_prompt: int, num_completion: int, num_cached: int = 0) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._envelope(obj, [], usage=usage(num_prompt, num_completion, num_cached)))
