"""What the request processing knows about a served model: its name, tokenizer, limits and how its replies
are read (no MLX objects besides the tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mlxhost.serving.errors import APIError, clip


@dataclass
class ServedModel:
    """What request processing and the HTTP layer know about the model it serves."""

    name: str
    aliases: frozenset[str]
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    default_max_tokens: int
    created: int
    # Vision-language models: builds prompts with images/videos (multimodal.prompt); None: text only.
    multimodal: Any = None
    # How replies carry tool calls (a `structured.tool_parsers` name; None: no tool calling) and
    # reasoning ((start, end) tags; None: no reasoning), from the chat template / --tool-call-parser.
    tool_parser: str | None = None
    reasoning_tags: tuple[str, str] | None = None
    thinks_by_default: bool = False  # think tokens in the vocabulary: the model may reason unasked
    max_tokens_cap: int | None = None  # --max-tokens-cap: most completion tokens one request may ask for
    max_token_chars: int = 0  # longest vocabulary string: the cheap length bound (prompt_bound.py); 0: none
    embedding_only: bool = False  # an encoder (BERT-style) model: /v1/embeddings only (engine/encoder.py)
    audio: Any = None  # an audio model (serving/audio.py AudioInfo): /v1/audio/* only
    fim: Any = None  # its fill-in-the-middle prompt (fim.Fim), when its vocabulary has the markers
    adapter: str = ""  # a LoRA adapter served on this model (lora/registry.py): the id its requests carry

    def check_name(self, requested: str) -> None:
        if requested != self.name and requested not in self.aliases:
            raise APIError(404, f"The model `{clip(requested)}` does not exist; this server serves `{self.name}`.",
                           "model", "model_not_found")


class UnknownModelError(LookupError):
    def __init__(self, requested: str, names: Sequence[str]) -> None:
        shown = requested if len(requested) <= 200 else f"{requested[:200]}... ({len(requested)} characters)"
        super().__init__(f"The model `{shown}` does not exist; this server serves "
                         + ", ".join(f"`{n}`" for n in names) + ".")
        self.requested, self.names = requested, list(names)


class ModelUnavailableError(RuntimeError):
    """A model that cannot be loaded now: no room (all others busy or pinned), or its load failed."""
