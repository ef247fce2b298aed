"""Builds a text model's engine core with everything it serves with: decode buckets, the runner's phase sync, the
configured LoRA adapters and the warm-up. Nothing attaches a collaborator to a core after this."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.loop import STEP_SYNC_ENV, Assembled
from mlxhost.engine.runner.batch import make_buckets
from mlxhost.lora.manager import load_configured
from mlxhost.platform.backend import is_cuda


def decode_buckets(config: EngineConfig, per_shape: bool) -> list[int] | None:
    """The decode batch sizes to pad to: on by default only where MLX compiles per shape (MLX-CUDA)."""
    use = per_shape if config.decode_buckets == "auto" else config.decode_buckets == "on"
    return make_buckets(config.max_num_seqs) if use else None


def warmup_mode(config: EngineConfig, per_shape: bool) -> str:
    """"off", "on" (all before serving) or "background" (between requests); auto: background on MLX-CUDA only."""
    if config.warmup != "auto":
        return config.warmup
    return "background" if per_shape else "off"


def assemble_core(model: Any, tokenizer: Any, config: EngineConfig, max_model_len: int, *, model_key: str = "",
                  source: str | None = None, loras: Sequence[Any] = (),
                  make_core: Callable[..., EngineCore] | None = None) -> Assembled:
    """On the engine thread: the core (`make_core`, e.g. a distributed server's rank-0 core; EngineCore by default),
    its `loras` (LoraSpec) loaded, and the warm-up run now or handed to the loop. `source`: the model's folder,
    which a warm-up helper process loads again on MLX-CUDA."""
    per_shape = is_cuda()  # only MLX's CUDA backend compiles per shape at first use
    make = make_core or EngineCore
    core = make(model, tokenizer, config, max_model_len, decode_buckets(config, per_shape), model_key)
    if os.environ.get(STEP_SYNC_ENV) == "1":
        core.runner.sync_phases = True  # diagnosis only (loop.py's step trace)
    if loras:
        load_configured(core, loras)  # one that does not fit the model fails the model's load with the reason
    mode = warmup_mode(config, per_shape)
    warm = None
    if mode != "off":
        warm = core.warmup(config.max_num_seqs, background=mode == "background", source=source,
                           compile_tiles=per_shape)
    return Assembled(core, warm, config.memory_refresh_s)
