"""Loading a served model through mlx-lm: a local folder (MLX or Hugging Face layout) or a hub id."""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_DEFAULT_MAX_MODEL_LEN = 4096


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message names the file and what is wrong."""


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

    if Path(source).is_dir():
        for path in sorted(Path(source).glob("*.safetensors")):
            check_safetensors(path)
    start = time.perf_counter()
    model, tokenizer, config = load(source, return_config=True)
    log.info("loaded %s in %.2f s", source, time.perf_counter() - start)
    return LoadedModel(model, tokenizer, config, source)


def check_safetensors(path: Path) -> None:
    """Raises ModelLoadError when a safetensors file is torn or truncated (mlx's own error names no file).
    Layout: an 8-byte little-endian header length, a JSON header, then the tensors' data."""
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, no 8-byte header length")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise ModelLoadError(f"{path}: truncated or not safetensors: {size} bytes, "
                                 f"header length says {header_len}")
        try:
            header = json.loads(f.read(header_len))
            ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ModelLoadError(f"{path}: bad safetensors header: {e}") from None
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, header says {needed}")
