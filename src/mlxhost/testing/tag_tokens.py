"""Fixture tokenizers whose tool and reasoning tags are single added tokens, as in real ones: Qwen2.5/Qwen3
(`<tool_call>`, `<think>`: added, not special), Mistral (`[TOOL_CALLS]`: special), Llama 3
(`<|python_tag|>`: special). Tests of tag handling use them without downloading a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

TEXT_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
SPECIAL_TAGS = ("[TOOL_CALLS]", "<|python_tag|>")


def add_tag_tokens(folder: str | Path) -> dict[str, int]:
    """Adds the tags to the `tokenizer.json` in `folder`; returns tag -> id.

    A demo model built with a `vocab_size` past its tokenizer has placeholder tokens (" v2048", ...) for the
    extra ids: the tags take the first of those ids, so they stay inside the model's logits. Without
    placeholders they go after the vocabulary. Each tag is also in the model's vocabulary at its id, which
    keeps the id when the file is read back."""
    path = Path(folder) / "tokenizer.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    vocab, added = doc["model"]["vocab"], doc.setdefault("added_tokens", [])
    placeholders = sorted(i for token, i in vocab.items() if token == f"\u0120v{i}")
    next_id = max(list(vocab.values()) + [t["id"] for t in added]) + 1
    ids = {}
    for tag in TEXT_TAGS + SPECIAL_TAGS:
        if placeholders:
            ids[tag] = placeholders.pop(0)
            del vocab[f"\u0120v{ids[tag]}"]
        else:
            ids[tag], next_id = next_id, next_id + 1
        vocab[tag] = ids[tag]
        added.append({"id": ids[tag], "content": tag, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": tag in SPECIAL_TAGS})
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return ids
