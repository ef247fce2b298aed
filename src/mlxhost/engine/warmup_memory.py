"""What the warm-up's piece helper process (engine/warmup_helper.py) holds beside the server, and the KV capacity
the server lends it while it runs where the memory its budget leaves to other processes does not hold it.

At an 8B cold start on an 80 GB H100 under 16 streams the two processes together asked for more than the
device has: the helper's steps and the server's running requests failed with out-of-memory errors. Two things
were outside the count. The weights forwards dequantize, held until they have run (the server grew from 7 to
56 GiB in 4 s): they are bounded and counted in the budget's activations now (platform/quantized_rows.py), for
both processes. And MLX keeps freed buffers cached up to its memory limit, by default nearly all of the device,
whatever the budget says: while the helper lives, the server's MLX memory limit is its ceiling less the loan and
the helper's what the server counted for the helper, so MLX frees cached buffers before it grows past them.
MLX's limit is the process's: with several models in one process (each with its own budget share and helper)
it is left alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The piece helper's KV and prefix cache (enough for every piece: the longest prompt is one prefill step plus a
# little, a few rows at a time): what it builds its core with and what `piece_helper_bytes` counts.
KV_TOKENS = 32768
PREFIX_BYTES = 256 << 20
# Of the memory the server's budget leaves to other processes, what the helper does not count on: the CUDA
# contexts of the server, the helper and the tile compilers (about half a GiB each), and other programs.
SLACK_BYTES = 4 << 30


def own_mlx_memory() -> str:
    """This process's MLX memory, for the log when a helper stops: whether the server's own buffers (MLX keeps
    freed ones cached for reuse) left the helper short of device memory."""
    import mlx.core as mx  # lazy: mlx only when used

    return (f"this process holds {mx.get_active_memory() / 2**30:.2f} GiB active and "
            f"{mx.get_cache_memory() / 2**30:.2f} GiB cached by MLX, peak {mx.get_peak_memory() / 2**30:.2f} GiB")


@dataclass
class KVLoan:
    """KV tokens the server lends the piece helper process while it lives: admission hands them to no request
    from `take` until `repay` (the helper finished, failed or was closed). Both run on the engine thread, which
    owns the capacity; a running request never loses KV by either. Meanwhile MLX's memory limit is
    `memory_limit`, so the buffers MLX keeps cached stay inside what the server left the helper."""

    capacity: Any  # memory/capacity.py's KVCapacity
    tokens: int
    kv_bytes_per_token: int
    memory_limit: int | None  # MLX's while the helper runs (None: left alone; `server_memory_limit`)
    helper_bytes: int = 0  # what the helper holds beside the server (the log)
    free_bytes: int = 0  # what the budget leaves to other processes (the log)
    out: bool = False
    _limit_before: int | None = None

    def take(self) -> None:
        import mlx.core as mx  # lazy: mlx only when used

        self.capacity.lend(self.tokens)
        self.out = True
        if self.memory_limit is not None:
            self._limit_before = mx.set_memory_limit(self.memory_limit)
            mx.clear_cache()  # what MLX cached past the new limit goes back to the device before the helper loads
        lent = (f"{self.tokens} KV tokens ({self.tokens * self.kv_bytes_per_token / 2**30:.2f} GiB) lent to the piece "
                f"helper process while it runs" if self.tokens else "the piece helper process runs, nothing lent")
        limit = f"{self.memory_limit / 2**30:.2f} GiB" if self.memory_limit is not None else "unchanged"
        log.info("warm-up: %s (it holds %.2f GiB beside the server, %.2f GiB are left to other processes); KV for new "
                 "requests meanwhile %s tokens, MLX memory limit %s", lent, self.helper_bytes / 2**30,
                 max(self.free_bytes, 0) / 2**30, self.capacity.tokens, limit)

    def repay(self, why: str) -> None:
        if not self.out:
            return
        import mlx.core as mx  # lazy: mlx only when used

        self.capacity.repay(self.tokens)
        self.out = False
        if self._limit_before is not None:
            mx.set_memory_limit(self._limit_before)
            self._limit_before = None
        back = f"its {self.tokens} KV tokens are back" if self.tokens else "nothing was lent"
        log.info("warm-up: the piece helper process %s; %s (KV for new requests %s tokens)", why, back,
                 self.capacity.tokens)


def server_memory_limit(target: Any, loan: int) -> int | None:
    """MLX's memory limit for the server while the helper runs: what the fit counts for it (its ceiling less the
    loan). None (left alone) where the process serves several models: the limit is the process's, each model's
    budget a share of it."""
    budget = target.budget
    if budget.config.share < 1.0 or budget.config.reserved_bytes:
        return None
    return max(budget.ceiling - loan * target.kv_bytes_per_token, 0)


def piece_helper_bytes(target: Any) -> int:
    """What the piece helper holds beside the server: the model again, its activations (dequantized weights in
    flight included), its small KV and prefix cache."""
    budget = target.budget
    return budget.weights + budget.activations + KV_TOKENS * target.kv_bytes_per_token + PREFIX_BYTES


def piece_helper_loan(target: Any) -> int | None:
    """KV tokens the server lends the piece helper (engine/warmup_helper.py), which loads the model a second time
    with a small KV budget, for as long as it runs: 0 where the memory the server's budget leaves to other
    processes holds it with `SLACK_BYTES` to spare, None where not even a loan makes it fit (no helper). A 32B
    bf16 model on one 140-GiB GPU does not fit: the helper's load took the memory the server's own steps then
    failed to get. The loan comes from the server's KV, which it does not hold yet: its KV grows with traffic,
    the helper lives a minute or so from start-up. A server without a budget keeps the helper. (A draft model's
    share of the budget is counted too, though the helper runs without one: the estimate errs towards no helper.)"""
    budget = target.budget
    if budget is None:
        return 0
    need = piece_helper_bytes(target)
    short = need + SLACK_BYTES - budget.free_for_others
    if short <= 0:
        return 0
    # The longest request the model takes stays admissible while the loan is out: the API refuses a request
    # whose prompt and max_tokens exceed the live capacity, and none may be refused for a start-up loan.
    keep = target.max_model_len
    lendable = target.kv_capacity.lendable(keep) if target.kv_capacity is not None else 0
    per_token = target.kv_bytes_per_token
    tokens = -(-short // per_token) if per_token > 0 else None
    if tokens is not None and tokens <= lendable:
        return tokens
    log.info("warm-up: no piece helper process (it would hold %.2f GiB beside the server, with %.2f GiB to spare: "
             "%.2f GiB are left to other processes, and %.2f GiB of KV could be lent while it runs, keeping %d tokens "
             "for the longest request); the pieces compile here, between requests", need / 2**30, SLACK_BYTES / 2**30,
             max(budget.free_for_others, 0) / 2**30, lendable * per_token / 2**30, keep)
    return None
