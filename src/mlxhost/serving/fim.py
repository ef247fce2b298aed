"""Fill-in-the-middle: code models trained to write what goes between a prefix and a suffix (an editor's
text before and after the cursor) take a prompt of three marker tokens around the two texts. A client asks
for it with `suffix` (OpenAI's /v1/completions, Ollama's /api/generate); both doors build the same prompt
here and send it down as a plain completion.

The markers are read off the vocabulary, as Ollama reads its "insert" capability off a model's template.
A model without them was not trained for this, and its request is refused: completing the prompt alone
would ignore the suffix. Having them is not enough, though: every Qwen2.5/Qwen3 and Gemma tokenizer carries
the markers of its code siblings. So by default (`--fim auto`) a model must also be named as a code model
(its folder, hub id, served name or config: "coder", "code", "starcoder2", "codegemma", ...); `--fim on`
takes the markers alone. Imports no MLX."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Iterable

from mlxhost.serving.prompt_bound import read_vocab

log = logging.getLogger(__name__)


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


# Words of a model's names that make it a code model: Qwen2.5-Coder, deepseek-coder, granite-code, stable-code,
# WizardCoder, StarCoder2, CodeGemma, CodeLlama, Codestral, CodeQwen, gpt_bigcode ("encoder" is not one).
_CODE_PREFIXES = ("code", "starcoder", "santacoder", "bigcode")


def named_as_code_model(names: Iterable[str]) -> bool:
    for name in names:
        for word in re.split(r"[^a-z]+", str(name).lower()):
            coder = word.endswith("coder") and not word.endswith(("encoder", "decoder"))
            if coder or word.startswith(_CODE_PREFIXES):
                return True
    return False


def fim_for(tokenizer: Any, names: Iterable[str] = (), setting: str = "on", vocab: dict | None = None) -> Fim | None:
    """The first format whose three markers are tokens of this vocabulary, if `setting` lets this model use it
    ("auto": only a model `names` call a code model); None otherwise. `vocab`: the tokenizer's, when the
    caller read it already (prompt_bound.read_vocab)."""
    if setting == "off":
        return None
    vocab = vocab if vocab is not None else read_vocab(tokenizer)
    if not vocab:  # a tokenizer without a readable vocabulary: no markers to find
        return None
    for f in FORMATS:
        if all(marker in vocab for marker in (f.prefix, f.suffix, f.middle)):
            if setting == "auto" and not named_as_code_model(names):
                log.info("fill-in-the-middle: the vocabulary has its tokens, but the model is not named as a code "
                         "model; --fim on serves `suffix` with it")
                return None
            return Fim(f, frozenset(vocab[t] for t in (f.prefix, f.suffix, f.middle, *f.ends) if t in vocab))
    return None
