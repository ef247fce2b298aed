"""Fill-in-the-middle: code models trained to write what goes between a prefix and a suffix (an editor's
text before and after the cursor) take a prompt of three marker tokens around the two texts. A client asks
for it with `suffix` (OpenAI's /v1/completions, Ollama's /api/generate); both doors build the same prompt
here and send it down as a plain completion.

The markers are read off the vocabulary, as Ollama reads its "insert" capability off a model's template.
A model without them was not trained for this, and its request is refused: completing the prompt alone
would ignore the suffix. Imports no MLX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimFormat:
    prefix: str  # the markers, in the prefix-suffix-middle order these families were trained with
    suffix: str
    middle: str
    ends: tuple[str, ...]  # tokens after which a middle is over (where the vocabulary has them)


FORMATS = (
    FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",  # Qwen2.5-Coder, Qwen3-Coder, CodeGemma
              ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>")),
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>",  # StarCoder, StarCoder2, SantaCoder
              ("<|endoftext|>", "<fim_pad>", "<file_sep>")),
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",  # DeepSeek-Coder
              ("<|EOT|>",)),
)


@dataclass(frozen=True)
class Fim:
    """A model's fill-in-the-middle prompt and the token ids that end a middle: its ends, and any marker
    (an instruct model that starts another file or hole is done with this one)."""

    format: FimFormat
    stop_ids: frozenset[int]

    def prompt(self, prefix: str, suffix: str) -> str:
        f = self.format
        return f"{f.prefix}{prefix}{f.suffix}{suffix}{f.middle}"


def fim_for(tokenizer: Any) -> Fim | None:
    """The first format whose three markers are tokens of this vocabulary; None when none is."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return None
    vocab = get_vocab()
    for f in FORMATS:
        if all(marker in vocab for marker in (f.prefix, f.suffix, f.middle)):
            return Fim(f, frozenset(vocab[t] for t in (f.prefix, f.suffix, f.middle, *f.ends) if t in vocab))
    return None
