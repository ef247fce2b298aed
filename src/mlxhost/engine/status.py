"""What `GET /v1/status` and `GET /v1/cache` report of an engine core (read on the engine thread)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


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
    status = core.status()
    return StatusSnapshot(status, core.cache_stats(), {r["id"]: r for r in status.get("requests", ())})


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


def engine_status(core: Any) -> dict:
    """The budget in force (desktop mode: after pressure) next to the start-up one and live readings."""
    from mlxhost.memory.device import read_memory

    def as_dict(budget):
        if budget is None:
            return None
        d = dataclasses.asdict(budget)
        d.pop("config", None)
        return d

    governor = core.governor
    return {
        "memory_mode": core.config.memory_mode,
        "budget": as_dict(governor.live if governor is not None else core.budget),
        "startup_budget": as_dict(core.budget),
        "pressure": governor.status() if governor is not None else None,
        "memory": dataclasses.asdict(read_memory()),
        "kv_capacity_tokens": core.kv_capacity_tokens,
        "kv_bytes_per_token": core.probe.bytes_per_token,
        "kv_dtype": str(core.probe.dtype).rsplit(".", 1)[-1],
        "kv_quantization": core.kv_quant.status() if core.kv_quant is not None else None,
        "kv_prealloc_tokens": core.config.kv_prealloc_tokens,
        "num_running": core.scheduler.num_running,
        "structured_output": core.grammar.stats(),
        "num_waiting": core.scheduler.num_waiting,
        "prefix_cache": cache_stats(core),
        "speculative": spec_stats(core),
        "cudnn_attention": core.cudnn_attention,
        "step_cost": core.scheduler.step_cost.as_dict(),
        "requests": core.prefill_progress(),
    }


def cache_stats(core: Any) -> dict:
    vision = {"vision": vision_stats(core)} if core.vision_cache is not None else {}
    if core.prefix is None:
        return {"enabled": False, **vision}
    store = core.runner.store
    tiers = store.stats()  # blocks and snapshots per tier; snapshots count against the budget
    budget_bytes = core.prefix.max_cached_blocks * core.block_bytes + store.snapshots.max_bytes
    return {"enabled": True, **core.prefix.stats(), "memory_bytes": store.nbytes, "budget_bytes": budget_bytes,
            **tiers, **vision}


def spec_stats(core: Any) -> dict:
    """Speculative decoding's counters (mode "off" when it is not running)."""
    spec = core.spec
    if spec is None:
        return {"mode": "off"}
    stats = spec.stats.as_dict()
    return {"mode": spec.mode, "policy": "auto" if spec.auto is not None else "fixed",
            "num_draft_tokens": spec.max_k, "spec_max_batch": spec.max_batch, **stats,
            # One proposer per model: its kind's acceptance (several models' kinds sit side by side in /metrics).
            "acceptance_by_kind": {spec.mode: stats["acceptance_rate"]}}


def vision_stats(core: Any) -> dict | None:
    if core.vision_cache is None:
        return None
    mm = core.runner.mm
    return {**core.vision_cache.stats(), "num_encoded": mm.num_encoded, "num_reused": mm.num_cache_hits}


def describe_last_step(core: Any) -> str:
    sched = core.last_sched
    if sched is None:
        return "nothing"
    return (f"prefill chunks {[c.num_tokens for c in sched.prefill_chunks]}, "
            f"{len(sched.decode_request_ids)} decoding in a batch of {core.runner.num_rows}, "
            f"{sum(len(ops) for ops in sched.store_ops.values())} blocks stored; the runner took "
            f"{core.last_execute_s:.2f} s, prefill {core.runner.last_prefill_s:.2f} s of it")
