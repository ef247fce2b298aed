"""The memory budget: one formula that splits what this process may hold into its parts.

Every limit applies to the same quantity, the bytes this process may hold in total (the ceiling):

    capacity  = working_set_hint or pool_total       (Metal working set / CUDA device memory / RAM)
    desktop:    ceiling = min(capacity, obtainable - reserve)
                obtainable = available now + held by this process already
                reserve    = max(desktop_reserve_min_bytes, desktop_reserve_fraction * pool_total)
    dedicated:  ceiling = memory_utilization * capacity   (available memory is ignored)
    rest        = ceiling - weights - activations        (MemoryBudgetError if negative)
    vision      = min(vision_cache_bytes, vision_cache_max_fraction * rest)
    prefix      = prefix_cache_fraction * rest, or min(prefix_cache_bytes, rest - vision) when given
    kv          = rest - prefix - vision
so weights + activations + kv + prefix + vision == ceiling exactly: nothing is counted twice.
Several models in one process (N may be loaded at once): each ceiling above first loses the N - 1
largest other models' weights (reserved_bytes), then the model keeps its own weights + activations and
1/N of what is left (model_ceiling), so any N loaded models together stay inside one process ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mlxhost.memory.device import MemoryReadings

_GIB = 1 << 30


class MemoryBudgetError(RuntimeError):
    """The model itself does not fit: no KV budget can make it run."""


@dataclass(frozen=True)
class BudgetConfig:
    # "desktop": share the Mac with other apps, follow what is free now.
    # "dedicated": the machine serves only this model, take a fixed share of it.
    mode: str = "desktop"
    # Dedicated: vLLM's gpu_memory_utilization. 10% stays for the OS, the allocator's slack and
    # fragmentation, which the budget does not model.
    memory_utilization: float = 0.9
    # Desktop: memory left free, beyond what other apps hold now, so they can grow (a browser tab,
    # an IDE build) without pushing macOS into compression and swap. It scales with the machine
    # (bigger Macs run bigger apps) but never drops below 1 GiB, the order of a few busy tabs.
    # Kept small because `available` already excludes everything other apps hold: a 16 GB Mac with
    # 6 GB free still fits an 8B 4-bit model.
    desktop_reserve_fraction: float = 0.05
    desktop_reserve_min_bytes: int = 1 * _GIB
    # Share of the memory left after weights and activations that keeps finished prompts' KV for
    # reuse. A quarter holds several long system prompts / agent contexts while three quarters stay
    # for running sequences; it is also the first thing given back under pressure.
    prefix_cache_fraction: float = 0.25
    # A fixed prefix-cache size instead of the fraction (`--cache-memory`; 0 with the cache off), so
    # what the prefix cache does not take is KV's, never counted twice.
    prefix_cache_bytes: int | None = None
    # Image embeddings cache (0 for text-only models). Capped at a share of the remainder because it
    # only saves re-encoding an image, while KV is what lets a request run at all.
    vision_cache_bytes: int = 512 * (1 << 20)
    vision_cache_max_fraction: float = 0.25
    # Several models in one process: the other models' weights (those that may be loaded next to this
    # one) are not this one's to budget, and of what is left after its own weights and activations it
    # takes `share` (1/N when N models may be loaded at once), so their budgets never overlap.
    reserved_bytes: int = 0
    share: float = 1.0

    def __post_init__(self) -> None:
        if self.reserved_bytes < 0 or not 0.0 < self.share <= 1.0:
            raise ValueError("reserved_bytes must be >= 0 and share in (0, 1]")
        if self.mode not in ("desktop", "dedicated"):
            raise ValueError(f"mode must be desktop or dedicated, got {self.mode!r}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("memory_utilization must be in (0, 1]")
        for name in ("desktop_reserve_fraction", "prefix_cache_fraction", "vision_cache_max_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if self.prefix_cache_fraction + self.vision_cache_max_fraction >= 1.0:
            raise ValueError("prefix_cache_fraction + vision_cache_max_fraction must leave room for KV")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0")
        if self.desktop_reserve_min_bytes < 0 or self.vision_cache_bytes < 0:
            raise ValueError("byte sizes must be >= 0")


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes. weights + activations + kv + prefix_cache + vision_cache == ceiling."""

    ceiling: int
    weights: int
    activations: int  # headroom for everything transient: activations, logits, allocator slack
    kv: int
    prefix_cache: int
    vision_cache: int
    # What stays free for other processes when this one sits at its ceiling, given what they hold
    # now. Negative only in dedicated mode: the budget claims memory that others hold today.
    free_for_others: int
    # Kept so shrink_for_pressure can recompute with the same rules.
    config: BudgetConfig = field(default_factory=BudgetConfig)

    @property
    def mode(self) -> str:
        return self.config.mode


def _capacity(readings: MemoryReadings) -> int:
    return readings.working_set_hint or readings.pool_total


def desktop_reserve(readings: MemoryReadings, cfg: BudgetConfig) -> int:
    return max(cfg.desktop_reserve_min_bytes, int(cfg.desktop_reserve_fraction * readings.pool_total))


def compute_ceiling(readings: MemoryReadings, cfg: BudgetConfig) -> int:
    """Bytes this process may hold in total. The only place a ceiling is computed."""
    if cfg.mode == "dedicated":
        return int(cfg.memory_utilization * _capacity(readings)) - cfg.reserved_bytes
    return min(_capacity(readings), readings.obtainable - desktop_reserve(readings, cfg)) - cfg.reserved_bytes


def model_ceiling(process_ceiling: int, weights: int, activations: int, cfg: BudgetConfig) -> int:
    """One model's part of the process ceiling (`reserved_bytes`, the other models' weights, already
    taken out): its weights and activations, and `share` of the rest, all of it when alone. The other
    models' activation headroom is taken to be this one's size. Start-up and pressure both use this."""
    fixed = weights + activations
    room = process_ceiling - fixed - int((1.0 / cfg.share - 1.0) * activations)
    if room <= 0:
        return min(process_ceiling, fixed)
    return fixed + int(cfg.share * room)


def compute_budget(
    readings: MemoryReadings, weights_bytes: int, activation_bytes: int, cfg: BudgetConfig
) -> MemoryBudget:
    if weights_bytes < 0 or activation_bytes < 0:
        raise ValueError("weights_bytes and activation_bytes must be >= 0")
    ceiling = compute_ceiling(readings, cfg)
    fixed = weights_bytes + activation_bytes
    if fixed > ceiling:
        raise MemoryBudgetError(_does_not_fit(readings, cfg, ceiling, weights_bytes, activation_bytes))
    ceiling = model_ceiling(ceiling, weights_bytes, activation_bytes, cfg)
    rest = ceiling - fixed
    vision = min(cfg.vision_cache_bytes, int(cfg.vision_cache_max_fraction * rest))
    if cfg.prefix_cache_bytes is None:
        prefix = int(cfg.prefix_cache_fraction * rest)
    else:
        prefix = min(cfg.prefix_cache_bytes, rest - vision)
    return MemoryBudget(
        ceiling=ceiling,
        weights=weights_bytes,
        activations=activation_bytes,
        kv=rest - prefix - vision,
        prefix_cache=prefix,
        vision_cache=vision,
        free_for_others=readings.obtainable - ceiling,
        config=cfg,
    )


def shrink_for_pressure(
    budget: MemoryBudget, new_readings: MemoryReadings, prefix_in_use: int | None = None, kv_in_use: int | None = None
) -> MemoryBudget:
    """The budget under today's memory: pass the start-up budget, get one no larger in any field.

    Desktop mode recomputes the ceiling from the new readings and gives back the difference from the
    prefix cache first, then the vision cache, then KV (caches only save recomputation; KV holds
    running requests). When pressure passes, calling again with the start-up budget regrows the caches
    up to their start-up sizes. Weights and activations are never taken: at worst kv is 0 and the
    server should admit no new requests, but it does not raise mid-service. Dedicated mode ignores
    available memory and only refreshes free_for_others.

    With the bytes in use given (the prefix cache's blocks, the KV committed to running requests),
    budget nobody holds yet goes before any of that order: first idle KV headroom, then the prefix
    cache's empty room. Giving those up frees nothing and costs nothing now, so another app growing
    into a roomy machine's idle KV budget no longer wipes a prefix cache it never touched; under real
    pressure (KV committed, cache full) the order above applies unchanged.
    """
    if budget.mode == "dedicated":
        return replace(budget, free_for_others=new_readings.obtainable - budget.ceiling)
    fixed = budget.weights + budget.activations
    process = compute_ceiling(new_readings, budget.config)
    ceiling = max(fixed, min(budget.ceiling, model_ceiling(process, budget.weights, budget.activations, budget.config)))
    deficit = budget.ceiling - ceiling
    parts = {name: getattr(budget, name) for name in ("prefix_cache", "vision_cache", "kv")}
    unheld = {
        "kv": parts["kv"] - min(parts["kv"], kv_in_use) if kv_in_use is not None else 0,
        "prefix_cache": parts["prefix_cache"] - min(parts["prefix_cache"], prefix_in_use)
        if prefix_in_use is not None else 0,
    }
    for name, room in [*unheld.items(), ("prefix_cache", None), ("vision_cache", None), ("kv", None)]:
        taken = min(deficit, parts[name] if room is None else room)
        parts[name] -= taken
        deficit -= taken
    return replace(budget, ceiling=ceiling, free_for_others=new_readings.obtainable - ceiling, **parts)


def kv_tokens(budget: MemoryBudget, kv_bytes_per_token: int) -> int:
    """Tokens of KV that fit in the KV budget (all layers, keys and values: bytes per token)."""
    if kv_bytes_per_token <= 0:
        raise ValueError("kv_bytes_per_token must be > 0")
    return budget.kv // kv_bytes_per_token


def reserve_state(budget: MemoryBudget, state_bytes: int) -> MemoryBudget:
    """Moves the fixed per-sequence state of recurrent layers (linear attention, SSM, conv), for every
    sequence that may run at once, from KV to the fixed part: it is held whatever the sequences'
    lengths, so token arithmetic must not count it, and pressure must not take it. At most half of KV
    goes: past that `max_num_seqs` is the real bound and admission still has tokens to give."""
    take = min(state_bytes, budget.kv // 2)
    return replace(budget, activations=budget.activations + take, kv=budget.kv - take)


def _gib(n: int) -> str:
    return f"{n / _GIB:.2f} GiB"


def format_budget(b: MemoryBudget) -> str:
    """One start-up log line. GiB, as macOS reports memory; parse_memory reads "5.30GiB" back."""
    line = (
        f"memory budget ({b.mode}): ceiling {_gib(b.ceiling)} = weights {_gib(b.weights)}"
        f" + activations {_gib(b.activations)} + KV {_gib(b.kv)}"
        f" + prefix cache {_gib(b.prefix_cache)} + vision cache {_gib(b.vision_cache)}; "
    )
    if b.free_for_others >= 0:
        return line + f"{_gib(b.free_for_others)} stays free for other apps"
    return line + f"claims {_gib(-b.free_for_others)} more than is free now (other apps will be swapped)"


def _does_not_fit(
    readings: MemoryReadings, cfg: BudgetConfig, ceiling: int, weights: int, activations: int
) -> str:
    if cfg.mode == "dedicated":
        how = f"{cfg.memory_utilization:.2f} x capacity {_gib(_capacity(readings))}"
    else:
        how = (
            f"min(capacity {_gib(_capacity(readings))}, available {_gib(readings.available_now)}"
            f" + held {_gib(readings.held_by_process)} - reserve {_gib(desktop_reserve(readings, cfg))})"
        )
    return (
        f"model does not fit in memory: weights {_gib(weights)} + activations {_gib(activations)}"
        f" = {_gib(weights + activations)} > ceiling {_gib(max(0, ceiling))} ({cfg.mode} mode: {how}). "
        "Close other apps, use a smaller or more quantized model, or dedicated mode on a machine"
        " that serves only this model."
    )
