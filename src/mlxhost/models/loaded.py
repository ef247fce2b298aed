"""A loaded model and the error a load fails with: what every loader (mlx-lm, mlx-vlm, encoders, GGUF, audio)
returns or raises, kept apart from loader.py's dispatch so those loaders need not import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_DEFAULT_MAX_MODEL_LEN = 4096


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message names the file and what is wrong."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any  # mlx-lm's TokenizerWrapper
    config: dict
    source: str  # what the user named: a folder or a hub id
    strategy: str = "mlx-lm"  # how the weights were read (LOAD_STRATEGIES)
    # Seconds per stage ("weights": files to evaluated parameters, "tokenizer"), for logs and benchmarks.
    timings: dict = field(default_factory=dict)
    # What builds this model's engine core (EngineCore's signature); None: EngineCore. A distributed
    # server's rank 0 puts its own (distributed/engine.py).
    make_engine_core: Any = None

    @property
    def is_vlm(self) -> bool:
        return getattr(self.model, "is_vlm", False)

    @property
    def is_encoder(self) -> bool:
        """An encoder embedding model (models/encoder.py): served for /v1/embeddings only."""
        return getattr(self.model, "is_encoder", False)

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


def materialize(model: Any) -> None:
    """Evaluates every array the model holds, private ones too (`parameters()` skips names that start
    with `_`, such as the rope frequency tables mlx-lm builds lazily for llama3 / yarn / longrope
    scaling). A lazy array belongs to the stream of the thread that made it: left lazy, the engine
    thread cannot evaluate it ("There is no Stream(cpu, 0) in current thread")."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used

    # A module is a dict of everything it holds, so this walks private entries too.
    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])
