"""Start-up measurements the budget needs: weight bytes and activation headroom of a prefill chunk."""

from __future__ import annotations

import logging
from typing import Any

from mlxserve.memory.budget import BudgetConfig, MemoryBudget, MemoryBudgetError, compute_budget, format_budget
from mlxserve.memory.device import read_memory

log = logging.getLogger(__name__)


def weights_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def activation_bytes(model: Any, chunk_tokens: int) -> int:
    """Peak memory of one prefill forward at the largest chunk, above what was held before it:
    the transient a step needs on top of weights and KV."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    mx.eval(model.parameters())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    logits = model(mx.zeros((1, chunk_tokens), dtype=mx.int32), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    peak = mx.get_peak_memory()
    del logits, cache
    mx.clear_cache()
    return max(0, peak - before)


def budget_config(config: Any, prefix_cache: bool, vision_cache: bool = False) -> BudgetConfig:
    """The budget's rules from an `EngineConfig`: its mode and utilization, and the prefix cache's
    share fixed by `--cache-memory` (or 0 when there is no prefix cache, so KV gets it all); the
    vision cache's `--vision-cache-memory` counts only for vision-language models."""
    prefix_bytes = config.cache_memory_bytes if prefix_cache else 0
    return BudgetConfig(mode=config.memory_mode, memory_utilization=config.memory_utilization,
                        prefix_cache_bytes=prefix_bytes,
                        vision_cache_bytes=config.vision_cache_bytes if vision_cache else 0,
                        reserved_bytes=config.memory_reserved_bytes, share=config.memory_share)


def startup_budget(model: Any, chunk_tokens: int, cfg: BudgetConfig | None = None) -> MemoryBudget | None:
    """The budget from real readings, logged; None (and a warning) when the weights cannot fit, since
    nothing enforces the budget yet."""
    weights = weights_bytes(model)
    activations = activation_bytes(model, chunk_tokens)
    try:
        budget = compute_budget(read_memory(), weights, activations, cfg or BudgetConfig())
    except MemoryBudgetError as exc:
        log.warning("memory budget: %s", exc)
        return None
    log.info("%s", format_budget(budget))
    return budget
