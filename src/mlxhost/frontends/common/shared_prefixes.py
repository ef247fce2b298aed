"""Shared system prompts under `--cache-isolation` (the key file's `shared_prefixes:`): how many leading
tokens of a prompt are a shared text's, so that their full blocks hash without the request's cache group
and every group hits them, while each block holding any other token keeps the group (kv/hashing.py).

A text is compared in tokens, as the server would render it: as a system message in the model's chat
template (followed by an empty user turn, so the template's own tokens after it count too), as a base
model's transcript line, and as a plain completion prompt. A prompt's shared part is its longest common
prefix with one of these token lists: every token in it is a shared text's or the template's, never the
client's own, so a hit across groups says only that someone sent the shared prompt.
"""

from __future__ import annotations

from typing import Any, Sequence


def _forms(tokenizer: Any, text: str) -> list[list[int]]:
    """The token lists `text` starts a prompt with: in the chat template, a transcript, a completion."""
    forms = []
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": text}, {"role": "user", "content": ""}]
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
            forms.append(list(tokenizer.encode(rendered, add_special_tokens=False)))
        except Exception:  # a template that takes no system role shares its completion form only
            pass
    else:
        forms.append(list(tokenizer.encode(f"system: {text}\n")))  # serving/prepare.py's transcript
    forms.append(list(tokenizer.encode(text)))
    return forms


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SharedPrefixes:
    """The shared texts of one key file and their token lists per model, made on first use (off the event
    loop: the gateway calls it in the prep pool). Replaced whole when the file is read again."""

    def __init__(self, texts: tuple[str, ...]) -> None:
        self.texts = texts
        self._forms: dict[str, list[list[int]]] = {}  # served model name -> every text's token lists

    def __bool__(self) -> bool:
        return bool(self.texts)

    def num_shared_tokens(self, model_name: str, tokenizer: Any, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of `prompt_ids` are a shared text's (0 if it starts with none)."""
        forms = self._forms.get(model_name)
        if forms is None:
            forms = self._forms[model_name] = [f for text in self.texts for f in _forms(tokenizer, text) if f]
        return max((_common_prefix(prompt_ids, f) for f in forms), default=0)
