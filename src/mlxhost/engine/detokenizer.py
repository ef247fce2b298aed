"""Streaming text out of token ids: never a broken UTF-8 character, never a stop string.

We decode a short sliding window of ids with the tokenizer's own `decode` instead of mlx-lm's
streaming detokenizers: those drop the leading space of the first generated token, which is wrong
for `/v1/completions` ("Hello" + " world"). Seeding the window with the prompt's last tokens gives
SentencePiece-style tokenizers the context they need to render that space.
"""

from __future__ import annotations

import codecs
from typing import Any, Callable, Sequence

from mlxhost.structured.tool_formats import TOOL_TAGS

_CONTEXT_TOKENS = 6


def _byte_alphabet_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others are
    shifted to code points from 256 up. Returns char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def make_detokenizer_factory(tokenizer: Any) -> Callable[[Sequence[int]], Any]:
    """Per-model setup, shared by all requests: a bytes table for byte-level BPE tokenizers (Qwen,
    Llama 3, GPT-2 style), where each token is a fixed byte string and an incremental UTF-8 decoder
    is exact; the windowed `decode` for everything else (SentencePiece and friends)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return lambda prompt_ids: IncrementalDetokenizer(tokenizer, prompt_ids)
    alphabet = _byte_alphabet_decoder()
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = [bytes(alphabet.get(ch, 0x3F) for ch in piece) if piece else b"" for piece in pieces]
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < len(table):
            # Added tokens are stored as plain text, not in the byte alphabet; special ones are skipped
            # like `decode(..., skip_special_tokens=True)` does, except tool-call tags (the parsers read them).
            hidden = added.special and added.content not in TOOL_TAGS
            table[token_id] = b"" if hidden else added.content.encode("utf-8")
    return lambda prompt_ids: ByteLevelDetokenizer(table)


class ByteLevelDetokenizer:
    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        piece = self._table[token_id] if token_id < len(self._table) else b""
        return self._utf8.decode(piece)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


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
