"""Streaming text out of token ids: never a broken UTF-8 character, never a stop string.

We decode a short sliding window of ids with the tokenizer's own `decode` instead of mlx-lm's
streaming detokenizers: those drop the leading space of the first generated token, which is wrong
for `/v1/completions` ("Hello" + " world"). Seeding the window with the prompt's last tokens gives
SentencePiece-style tokenizers the context they need to render that space.
"""

from __future__ import annotations

from typing import Any, Sequence

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Text that token `token_id` completes; "" while a multi-byte character is still open."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held at the end of a generation (a truncated character shows as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


class StopStringMatcher:
    """Holds back text that could be the start of a stop string; finds a stop string across chunks."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = [s for s in stop if s]
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, text stops there."""
        if not self._stop:
            return delta, False
        text = self._held + delta
        hit = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if hit >= 0:
            self._held = ""
            return text[:hit], True
        keep = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
