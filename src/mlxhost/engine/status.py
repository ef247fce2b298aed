"""What `GET /v1/status` and `GET /v1/cache` report of an engine core (built on the engine thread from the
core's parts, which the core hands in: nothing here reads a core's insides)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from mlxhost.memory.device import read_memory


@dataclass(frozen=True)
class StatusSnapshot:
    """An engine's status and cache stats as of its last step (or idle wake-up, or call), built on the
    engine thread and swapped in whole (engine/loop.py): the HTTP side reads it without waiting for a
    step. Its dicts are never changed once built; a reader that wants to edit one copies it."""

    status: dict
    cache_stats: dict
    # Request id -> its entry of status["requests"] (its prefill progress): what a stream's heartbeat tells.
    requests: dict = dataclasses.field(default_factory=dict)


def take_snapshot(core: Any) -> StatusSnapshot:
    """From the core's `status()` alone (engine/contract.py): its "prefix_cache" entry is the cache stats."""
    status = core.status()
    cache = status.get("prefix_cache", {"enabled": False})
    return StatusSnapshot(status, cache, {r["id"]: r for r in status.get("requests", ())})


# /v1/status lists every running request but only the first waiting ones (queue order) and a count of the rest:
# the snapshot is rebuilt on the engine thread every ~0.1 s, and a big batch job may queue thousands.
MAX_NUM_LISTED_WAITING = 32


def requests_status(running: Iterable[Any], waiting: Collection[Any], now: float) -> dict:
    """Status's `requests` (each running request's progress, then the first `MAX_NUM_LISTED_WAITING` waiting
    ones') and `num_waiting_unlisted`; reads no more of `waiting` than it lists."""
    listed = itertools.islice(waiting, MAX_NUM_LISTED_WAITING)
    return {"requests": [request_progress(r, now) for r in itertools.chain(running, listed)],
            "num_waiting_unlisted": max(len(waiting) - MAX_NUM_LISTED_WAITING, 0)}


def request_progress(request: Any, now: float) -> dict:
    """A request's place in the engine: its prompt tokens prefilled so far (the cached part included), the
    prefix cache's part, and the prefill's rate since its first chunk (the cached part excluded)."""
    total, done = request.num_prefill_tokens, min(request.num_computed_tokens, request.num_prefill_tokens)
    state = "waiting" if request.scheduled_time is None else "prefilling" if done < total else "decoding"
    rate = None
    if state == "prefilling" and now > request.scheduled_time:
        rate = round((done - request.num_cached_tokens) / (now - request.scheduled_time), 1)
    return {"id": request.request_id, "state": state, "prefill_tokens": total, "prefilled_tokens": done,
            "cached_tokens": request.num_cached_tokens, "prefill_tokens_per_s": rate,
            "output_tokens": request.num_output_tokens, "priority": request.priority}


def describe_progress(progress: dict) -> str:
    """One request's prefill progress as the debug log says it."""
    rate = progress["prefill_tokens_per_s"]
    return (f"{progress['id']} {progress['prefilled_tokens']}/{progress['prefill_tokens']} tokens "
            f"({progress['cached_tokens']} cached)" + (f", {rate:.1f} tokens/s" if rate is not None else ""))


def memory_status(memory_mode: str, budget: Any, governor: Any) -> dict:
    """The budget in force (desktop mode: after pressure) next to the start-up one and live readings."""
    def as_dict(budget):
        if budget is None:
            return None
        d = dataclasses.asdict(budget)
        d.pop("config", None)
        return d

    return {
        "memory_mode": memory_mode,
        "budget": as_dict(governor.live if governor is not None else budget),
        "startup_budget": as_dict(budget),
        "pressure": governor.status() if governor is not None else None,
        "memory": dataclasses.asdict(read_memory()),
    }


def cache_stats(prefix: Any, store: Any, block_bytes: int, vision: dict | None = None) -> dict:
    """The prefix cache's two tiers (`store` its physical half), and the vision cache's stats where there is one."""
    vision = {"vision": vision} if vision is not None else {}
    if prefix is None:
        return {"enabled": False, **vision}
    tiers = store.stats()  # blocks and snapshots per tier; snapshots count against the budget
    budget_bytes = prefix.max_cached_blocks * block_bytes + store.snapshots.max_bytes
    return {"enabled": True, **prefix.stats(), "memory_bytes": store.nbytes, "budget_bytes": budget_bytes,
            **tiers, **vision}


def spec_stats(spec: Any) -> dict:
    """Speculative decoding's counters (mode "off" when it is not running)."""
    if spec is None:
        return {"mode": "off"}
    stats = spec.stats.as_dict()
    return {"mode": spec.mode, "policy": "auto" if spec.auto is not None else "fixed",
            "num_draft_tokens": spec.max_k, "spec_max_batch": spec.max_batch, **stats,
            # One proposer per model: its kind's acceptance (several models' kinds sit side by side in /metrics).
            "acceptance_by_kind": {spec.mode: stats["acceptance_rate"]},
            **({"auto": spec.auto.summary()} if spec.auto is not None else {})}


def vision_stats(vision_cache: Any, mm: Any) -> dict | None:
    """The vision cache's entries and the multimodal prefill's counters (`mm`); None without a vision cache."""
    if vision_cache is None:
        return None
    return {**vision_cache.stats(), "num_encoded": mm.num_encoded, "num_reused": mm.num_cache_hits}
