"""Split a model's output into reasoning and content at its thinking tags (`<think>...</think>`).

Two ways in: Qwen3-style templates let the model open `<think>` itself at the very start of its reply
(`starts_in_reasoning=False`); DeepSeek-R1 / Qwen3-Thinking templates put `<think>\\n` into the prompt,
so the output starts inside reasoning (`starts_in_reasoning=True`, a repeated `<think>` is dropped).

Rules, the same for the streaming parser and for `split_reasoning`:
- a start tag counts only at the beginning of the output (after whitespace); later tags are content;
- tag text never reaches either output, and whitespace next to a tag is dropped, so
  `<think>\\nplan\\n</think>\\n\\nAnswer` gives ("plan", "Answer");
- everything after the first end tag is content; without an end tag everything is reasoning;
- a reply that does not open with the start tag (and did not start in reasoning) is content, untouched.
"""

from __future__ import annotations

# Single-token thinking pairs, in the order mlx-lm's `_infer_thinking` tries them.
_THINK_TAG_PAIRS = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
)

_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text that may still
    turn into the tag once the next delta arrives, so a streaming parser must hold it back."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamingReasoningParser:
    """Feed text deltas, get (reasoning_delta, content_delta) pairs; `finish()` flushes what was held."""

    def __init__(self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False):
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty strings")
        self.start = start
        self.end = end
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _OPENING
        self._buf = ""
        # Whitespace right after a tag is dropped; these stay set until the first other character.
        self._strip_reasoning_lead = True
        self._strip_content_lead = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state == _OPENING:
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf = head[len(self.start) :]
                self._state = _REASONING
            elif self.start.startswith(head) and not final:
                return "", ""  # still could be the start tag (or only whitespace so far)
            else:
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
        if self._state == _REASONING:
            reasoning = self._step_reasoning(final)
        if self._state == _CONTENT:
            content = self._step_content()
        return reasoning, content

    def _step_reasoning(self, final: bool) -> str:
        buf = self._buf
        if self._strip_reasoning_lead:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return ""
            self._strip_reasoning_lead = False
        i = buf.find(self.end)
        if i >= 0:
            self._buf = buf[i + len(self.end) :]
            self._state = _CONTENT
            self._strip_content_lead = True
            return buf[:i].rstrip()
        if final:
            self._buf = ""
            return buf
        # Hold a possible partial end tag and the whitespace before it (dropped if the tag completes).
        cut = len(buf[: len(buf) - partial_tag_len(buf, self.end)].rstrip())
        self._buf = buf[cut:]
        return buf[:cut]

    def _step_content(self) -> str:
        buf, self._buf = self._buf, ""
        if self._strip_content_lead:
            buf = buf.lstrip()
            if buf:
                self._strip_content_lead = False
        return buf


def split_reasoning(
    text: str, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False
) -> tuple[str, str]:
    """(reasoning, content) of a whole output; equal to the streaming parser's result for any split."""
    head = text.lstrip()
    if head.startswith(start):
        body = head[len(start) :]
    elif starts_in_reasoning:
        body = text
    else:
        return "", text
    reasoning, found, content = body.partition(end)
    if not found:
        return body.lstrip(), ""
    return reasoning.strip(), content.lstrip()


def reasoning_tags_for(tokenizer) -> tuple[str, str] | None:
    """(start, end) thinking tags of a tokenizer, or None when it has none.

    Reads mlx-lm's TokenizerWrapper (`has_thinking`, `think_start`, `think_end`) when present, which also
    covers its multi-token pairs; for a bare Hugging Face tokenizer, looks for the single-token pairs in the
    vocabulary the way mlx-lm's `_infer_thinking` does (that function is private, so not called).
    """
    has_thinking = getattr(tokenizer, "has_thinking", None)
    if has_thinking is not None:
        start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
        return (start, end) if has_thinking and start and end else None
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if callable(get_vocab):
        vocab = get_vocab()
        for start, end in _THINK_TAG_PAIRS:
            if start in vocab and end in vocab:
                return start, end
    return None
