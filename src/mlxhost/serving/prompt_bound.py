"""A prompt's length checked before it is tokenized, and the worker pool that prepares requests.

The rule: no token of the vocabulary spells more than `max_chars` characters, so a text of C characters
needs at least ceil(C / max_chars) tokens however the tokenizer splits it. A prompt is refused without
tokenizing only when even that most optimistic count, plus the completion tokens asked for (at least
one), exceeds the context: a prompt this check lets through may still be refused by the exact check
after tokenizing, never the other way round. `max_chars` is measured on the vocabulary's own strings
(byte-level BPE writes one character per byte, SentencePiece's byte-fallback tokens `<0x41>` are longer
than the one byte they stand for): both overstate what a token covers, which only weakens the bound.
The rule assumes the tokenizer does not delete input characters (true of byte-level BPE and
SentencePiece, what mlx-lm's models use); a tokenizer whose normalizer drops characters gets no bound
(`max_token_chars` returns 0 for one with a normalizer that is not known to be safe).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any, Callable, TypeVar

from mlxhost.serving.errors import APIError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Few workers: tokenizing and templating hold the GIL most of the time, so more threads add no speed;
# they only keep the event loop (and with it /health and the running streams) free.
DEFAULT_PREP_WORKERS = 4
# Normalizers that never remove characters (they keep or expand the text), so the bound stays safe.
_SAFE_NORMALIZERS = frozenset({"NFC", "NFKC", "NFD", "NFKD", "Prepend", "Replace", "Lowercase"})


def read_vocab(tokenizer: Any) -> dict | None:
    """The tokenizer's vocabulary (token -> id), None when it has no listing. A copy of a 150k-260k entry
    dict (~0.1 s on a CPU): a model's load reads it once for everything that looks at it."""
    try:
        return tokenizer.get_vocab()
    except Exception:
        return None


def max_token_chars(tokenizer: Any, vocab: dict | None = None) -> int:
    """The longest vocabulary string, in characters; 0 when the bound cannot be trusted (no vocabulary,
    or a normalizer that may delete characters, e.g. BERT's control-character stripping). `vocab`: the
    tokenizer's, when the caller read it already (read_vocab)."""
    vocab = vocab if vocab is not None else read_vocab(tokenizer)
    if not vocab or not _normalizer_is_safe(tokenizer):
        return 0
    return max(len(token) for token in vocab)


def _normalizer_is_safe(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return True  # a slow (Python) tokenizer: SentencePiece, which keeps every character
    try:
        # The normalizer's own JSON (its pickled state): serializing the whole tokenizer to read one key
        # took ~0.3 s of every start with a 150k vocabulary.
        normalizer = backend.normalizer
        normalizer = None if normalizer is None else json.loads(normalizer.__getstate__())
    except Exception:
        return False
    return _safe(normalizer)


def _safe(node: Any) -> bool:
    if node is None:
        return True
    if node.get("type") == "Sequence":
        return all(_safe(n) for n in node.get("normalizers", ()))
    if node.get("type") == "Replace":  # a replacement by nothing deletes characters
        return bool((node.get("content") or ""))
    return node.get("type") in _SAFE_NORMALIZERS


def check_text_fits(text: str, max_chars: int, max_model_len: int, requested: int | None, param: str) -> None:
    """400 `context_length_exceeded` when `text` cannot fit even at `max_chars` characters per token."""
    if max_chars <= 0:
        return
    at_least = -(-len(text) // max_chars)
    if at_least + max(requested or 1, 1) > max_model_len:
        raise APIError(400, f"the prompt has {len(text)} characters, at least {at_least} tokens; this model's "
                       f"context length is {max_model_len} tokens", param, "context_length_exceeded")


class PrepPool:
    """The app's workers for request preparation: tokenizing, chat templates, media fetching and
    decoding. Bounded, so a burst of huge bodies queues here instead of starving the event loop."""

    def __init__(self, num_workers: int = DEFAULT_PREP_WORKERS) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="mlxhost-prep")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
