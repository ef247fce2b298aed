"""Start-up measurements the budget needs: weight bytes and activation headroom of a prefill chunk."""

from __future__ import annotations

import logging
from typing import Any, Callable

from mlxhost.memory.budget import BudgetConfig, MemoryBudget, MemoryBudgetError, compute_budget, format_budget
from mlxhost.memory.device import read_memory

log = logging.getLogger(__name__)

# The memory profile's time allowance: beyond it the full-chunk forward is extrapolated, not run.
_PROFILE_BUDGET_S = 5.0
_MARGIN = 2


def weights_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def activation_bytes(model: Any, chunk_tokens: int, make_cache: Callable[[Any], list] | None = None,
                     agree: Callable[[bool], bool] | None = None) -> int:
    """Peak memory of one prefill forward at the largest chunk, above what was held before it: the
    transient a step needs on top of weights and KV. A slow backend (4-bit matmul on a Linux CPU ran a
    16-token forward of a 0.6B model in ~80 s) would spend minutes on the full chunk, so a 1-token
    forward is timed first; when the full chunk would take longer than `_PROFILE_BUDGET_S`, the peak is
    extrapolated from 1- and 2-token forwards (a log line says so). `make_cache`: the caches requests
    get (under --kv-bits the prefill's attention goes through quantized matmuls, which materialise the
    scores a fused float kernel does not). `agree`: the ranks of a distributed model must run the same
    forwards, so it turns this rank's timing verdict into rank 0's."""
    import time

    import mlx.core as mx

    mx.eval(model.parameters())
    started = time.perf_counter()
    one = _forward_peak(model, 1, make_cache)
    per_token_s = time.perf_counter() - started
    if chunk_tokens <= 2:
        return max(one, _forward_peak(model, chunk_tokens, make_cache))
    slow = per_token_s * chunk_tokens > _PROFILE_BUDGET_S
    if agree is not None:
        slow = agree(slow)
    if slow:
        # Linear in the chunk: p(1) + (p(2) - p(1)) * (T - 1). Both probes hold the cache's first KV
        # step, so that fixed part cancels out of the slope instead of being multiplied by T.
        # Doubled: attention scores grow with T squared and the cache's later KV steps are not in the
        # probes (tiny Qwen3, 512 tokens: measured 12.5 MiB, linear 7.3 MiB, doubled 14.7 MiB).
        slope = max(0, _forward_peak(model, 2, make_cache) - one)
        scaled = _MARGIN * (one + slope * (chunk_tokens - 1))
        log.info("memory profile: a 1-token forward took %.1f s, so the %d-token chunk's activations are "
                 "extrapolated linearly from 1- and 2-token forwards (%.1f MiB) instead of measured",
                 per_token_s, chunk_tokens, scaled / (1 << 20))
        return scaled
    log.debug("memory profile: measured a %d-token forward", chunk_tokens)
    return _forward_peak(model, chunk_tokens, make_cache)


def _forward_peak(model: Any, num_tokens: int, make_cache: Callable[[Any], list] | None = None) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = (make_cache or make_prompt_cache)(model)
    logits = model(mx.zeros((1, num_tokens), dtype=mx.int32), cache=cache)
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


def startup_budget(model: Any, chunk_tokens: int, cfg: BudgetConfig | None = None,
                   make_cache: Callable[[Any], list] | None = None,
                   agree: Callable[[bool], bool] | None = None) -> MemoryBudget | None:
    """The budget from real readings, logged; None (and a warning) when the weights cannot fit, since
    nothing enforces the budget yet."""
    weights = weights_bytes(model)
    activations = activation_bytes(model, chunk_tokens, make_cache, agree)
    try:
        budget = compute_budget(read_memory(), weights, activations, cfg or BudgetConfig())
    except MemoryBudgetError as exc:
        log.warning("memory budget: %s", exc)
        return None
    log.info("%s", format_budget(budget))
    return budget
