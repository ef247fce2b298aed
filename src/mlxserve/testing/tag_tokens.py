"""Fixture tokenizers whose tool and reasoning tags are single added tokens, as in real ones: Qwen2.5/Qwen3
(`<tool_call>`, `<think>`: added, not special), Mistral (`[TOOL_CALLS]`: special), Llama 3
(`<|python_tag|>`: special). Tests of tag handling use them without downloading a real tokenizer."""

from __future__ import annotations

from pathlib import Path

TEXT_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
SPECIAL_TAGS = ("[TOOL_CALLS]", "<|python_tag|>")


def add_tag_tokens(folder: str | Path) -> dict[str, int]:
    """Adds the tags to the `tokenizer.json` in `folder` (ids after its vocabulary); returns tag -> id.
    A model folder needs a `vocab_size` that covers them (DemoModelConfig(vocab_size=...))."""
    from tokenizers import AddedToken, Tokenizer

    path = Path(folder) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TAGS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TAGS])
    tokenizer.save(str(path))
    return {t: tokenizer.token_to_id(t) for t in TEXT_TAGS + SPECIAL_TAGS}
