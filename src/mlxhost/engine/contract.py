"""The one contract every engine core implements: the text core, an encoder's, an audio model's and a
distributed server's. `AsyncEngine` (loop.py) drives a core through these methods only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mlxhost.engine.request import Request, RequestOutput


@dataclass(frozen=True)
class StepInfo:
    """What a core's last step ran: the slow-step log line and the step trace (loop.py) read it."""

    prefill_chunk_tokens: tuple[int, ...] = ()
    num_decoding: int = 0
    num_rows: int = 0  # the decode batch's rows, padding included
    num_stored_blocks: int = 0
    execute_s: float = 0.0  # the runner's whole step
    prefill_s: float = 0.0
    store_s: float = 0.0
    join_s: float = 0.0
    decode_s: float = 0.0
    # The host's time around the runner (core.py): up to it (the scheduler's decision, mostly), the detokenizer
    # and stop strings, the scheduler's update, and the rest after it (outputs, bookkeeping); with execute_s
    # they add up to the core's whole step.
    schedule_s: float = 0.0
    detok_s: float = 0.0
    update_s: float = 0.0
    output_s: float = 0.0
    # Inside decode_s, a plain step's sampling (and logprobs) graph, its async_eval, and reading back the
    # tokens fed (the wait for the device; a step with a grammar reads them before sampling, in the rest).
    # The rest of decode_s is the forward's graph. 0 in speculative steps.
    sample_s: float = 0.0
    launch_s: float = 0.0
    readback_s: float = 0.0

    def describe(self) -> str:
        return (f"prefill chunks {list(self.prefill_chunk_tokens)}, {self.num_decoding} decoding in a batch of "
                f"{self.num_rows}, {self.num_stored_blocks} blocks stored; the runner took {self.execute_s:.2f} s, "
                f"prefill {self.prefill_s:.2f} s of it")


@dataclass(frozen=True)
class CoreStats:
    """A core's counters after its last step, read by the HTTP side (metrics, the queue limit) across threads."""

    num_running: int = 0
    num_waiting: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_blocks: int = 0
    kv_bytes_per_token: int = 0  # what one token's KV costs (smaller under --kv-bits)
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_max_batch: int = 0  # --spec-max-batch (0: speculation off)
    spec_big_batch_steps: int = 0  # decode steps that did not speculate: the batch was over spec_max_batch
    spec_kind: str = ""  # the proposer's name ("": speculation off); not summed over engines
    kv_capacity_tokens: int | None = None  # the live KV capacity (None: no KV cache); not summed either
    last_step: StepInfo | None = None  # None until a step ran; not summed either


# Fields a sum over several engines leaves out (frontends/common/metrics.py).
NOT_SUMMED = ("spec_kind", "kv_capacity_tokens", "last_step")


@runtime_checkable
class Core(Protocol):
    """Owned by one engine thread. A core that cannot run generation requests (an encoder's, an audio model's:
    their work comes as `AsyncEngine.call` jobs) refuses `add` with ValueError, has no work and steps to []."""

    def add(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    @property
    def has_work(self) -> bool: ...

    def stats(self) -> CoreStats: ...

    def status(self) -> dict:
        """What `/v1/status` shows of this core; its "prefix_cache" entry is what `/v1/cache` shows."""
        ...

    def on_idle(self) -> None: ...

    def close(self) -> None: ...

    def clear_cache(self) -> int: ...

    def adapters(self) -> dict[str, Any]:
        """The LoRA adapters loaded (an empty dict where the core takes none)."""
        ...
