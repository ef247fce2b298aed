"""Loading a served model through mlx-lm: a local folder (MLX or Hugging Face layout) or a hub id."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict
    source: str  # what the user named: a folder or a hub id

    @property
    def max_position_embeddings(self) -> int:
        cfg = self.config.get("text_config", self.config)
        return int(cfg.get("max_position_embeddings") or _DEFAULT_MAX_MODEL_LEN)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = set(getattr(self.tokenizer, "eos_token_ids", None) or ())
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @property
    def default_name(self) -> str:
        path = Path(self.source)
        return path.name if path.exists() else self.source


def load_model(source: str) -> LoadedModel:
    """Loads weights and tokenizer; a hub id is fetched by mlx-lm's loader (snapshot_download)."""
    from mlx_lm import load

    start = time.perf_counter()
    model, tokenizer, config = load(source, return_config=True)
    log.info("loaded %s in %.2f s", source, time.perf_counter() - start)
    return LoadedModel(model, tokenizer, config, source)
