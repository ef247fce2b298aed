"""Start-up measurements the budget needs: weight bytes and activation headroom of a prefill chunk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mlxhost.memory.budget import BudgetConfig, MemoryBudget, MemoryBudgetError, compute_budget, format_budget
from mlxhost.memory.device import read_memory

log = logging.getLogger(__name__)

# The memory profile's time allowance: beyond it the full-chunk forward is extrapolated, not run.
_PROFILE_BUDGET_S = 5.0
_MARGIN = 2
# Part of a remembered measurement's key: changed where the way forwards run changes what they hold.
_MEASURED_AS = "dequant-bounded"


def weights_bytes(model: Any) -> int:
    from mlx.utils import tree_flatten  # lazy: mlx only when used

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
    import mlx.core as mx  # lazy: mlx only when used

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
    import mlx.core as mx  # lazy: mlx only when used
    from mlx_lm.models.cache import make_prompt_cache  # lazy: mlx_lm only when used

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = (make_cache or make_prompt_cache)(model)
    logits = model(mx.zeros((1, num_tokens), dtype=mx.int32), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    peak = mx.get_peak_memory()
    del logits, cache
    mx.clear_cache()
    return max(0, peak - before)


def dequantized_in_flight(model: Any) -> int:
    """On MLX-CUDA, the weights that forwards launched ahead hold dequantized (platform/quantized_rows.py): one
    forward's profile does not see them, so the budget's activations add them (logged where they count)."""
    from mlxhost.platform.quantized_rows import dequant_in_flight_bytes  # lazy: pulls in mlx

    extra = dequant_in_flight_bytes(model) if hasattr(model, "leaf_modules") else 0
    if extra:
        log.info("memory profile: activations count %.2f GiB of weights dequantized by forwards in flight",
                 extra / 2**30)
    return extra


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
                   agree: Callable[[bool], bool] | None = None,
                   remember: str | None = None) -> MemoryBudget | None:
    """The budget from real readings, logged; None (and a warning) when the weights cannot fit, since
    nothing enforces the budget yet. `remember`: a folder where the activation measurement is kept per
    model shape, backend and MLX version, so a later start of the same model skips its forwards."""
    weights = weights_bytes(model)
    if remember and agree is None:  # ranks must all run the same forwards: a distributed core measures
        activations = remembered_activation_bytes(model, chunk_tokens, make_cache, Path(remember))
    else:
        activations = activation_bytes(model, chunk_tokens, make_cache, agree)
    activations += dequantized_in_flight(model)
    try:
        budget = compute_budget(read_memory(), weights, activations, cfg or BudgetConfig())
    except MemoryBudgetError as exc:
        log.warning("memory budget: %s", exc)
        return None
    log.info("%s", format_budget(budget))
    return budget


def measurement_key(model: Any, chunk_tokens: int, make_cache: Callable[[Any], list] | None = None) -> str | None:
    """What decides a prefill chunk's activation peak: every parameter's name, shape and dtype (not its
    values), the layer classes, the chunk, the cache layout, MLX's version and the device. None where the
    cache layout has no stable description (then nothing is remembered)."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used
    from mlx_lm.models.cache import make_prompt_cache  # lazy: mlx_lm only when used

    if make_cache is None or make_cache is make_prompt_cache:
        layout = "plain"
    else:
        plan = getattr(make_cache, "__self__", None)  # the --kv-bits plan: a frozen dataclass, its repr its fields
        params = getattr(plan, "__dataclass_params__", None)
        if params is None or not params.frozen or " at 0x" in repr(plan):
            return None
        layout = f"{make_cache.__name__}:{plan!r}"
    # The prefix names how forwards were run when measured: a forward that held every dequantized copy at once
    # measured far more than one that frees them as it goes (platform/quantized_rows.py).
    digest = hashlib.sha256(f"{_MEASURED_AS}|{mx.__version__}|{mx.default_device()}|{_device_name()}|{chunk_tokens}|"
                            f"{layout}".encode())
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
    if hasattr(model, "named_modules"):
        digest.update(",".join(type(m).__name__ for _, m in model.named_modules()).encode())
    return digest.hexdigest()[:24]


def remembered_activation_bytes(model: Any, chunk_tokens: int, make_cache: Callable[[Any], list] | None,
                                folder: Path) -> int:
    """`activation_bytes`, read from `folder` when this model shape was measured on this device and MLX
    before (a start-up forward of a whole chunk: seconds on a cold GPU), else measured and written there.
    A missing, unreadable or foreign file is a fresh measurement, never an error."""
    key = measurement_key(model, chunk_tokens, make_cache)
    path = folder / f"activations-{key}.json" if key is not None else None
    if path is not None:
        try:
            known = json.loads(path.read_text())
            if known.get("key") == key and isinstance(known.get("activation_bytes"), int):
                log.info("memory profile: the %d-token chunk's activations as measured at an earlier start "
                         "(%.1f MiB, %s)", chunk_tokens, known["activation_bytes"] / (1 << 20), path)
                return known["activation_bytes"]
        except (OSError, ValueError):
            pass
    measured = activation_bytes(model, chunk_tokens, make_cache)
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".activations-")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "activation_bytes": int(measured), "chunk_tokens": chunk_tokens}, f)
            os.replace(tmp, path)  # whole or absent: a start that dies mid-write leaves no half file
        except OSError as exc:
            log.debug("memory profile: could not remember the measurement in %s: %s", folder, exc)
    return measured


def _device_name() -> str:
    import mlx.core as mx  # lazy: mlx only when used

    try:
        info = mx.device_info()
    except Exception:  # older MLX, or a backend without the call: the device kind alone
        return ""
    return str(info.get("device_name") or info.get("architecture") or "")
