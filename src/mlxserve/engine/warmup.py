"""Warm-up: the shapes traffic will meet, run once before clients wait on them.

A backend that compiles kernels per shape at first use (MLX's CUDA backend: seconds each) would
otherwise compile them while the first clients wait. Runs through the engine core's own step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlxserve.engine.request import Request, SamplingParams

log = logging.getLogger(__name__)


def warm_up(core: Any, max_batch: int, prompt_len: int = 16) -> None:
    """Runs the decode batch through each size it can take (its buckets, else every size from 1
    to `max_batch`) and back, then the paths real traffic takes (`_warm_traffic`). Requests join so
    that the batch steps through the sizes; each stays until the largest size has run. Afterwards
    the buffers warm-up left in MLX's cache go back: they fit shapes traffic may never use."""
    import mlx.core as mx

    start = time.perf_counter()
    buckets = core.runner.buckets or list(range(1, max_batch + 1))
    sizes = [b for b in buckets if b <= max_batch]
    params = SamplingParams(max_tokens=len(sizes) + 2, temperature=0.0, ignore_eos=True)
    prompt = [i % 7 + 1 for i in range(prompt_len)]
    joined = 0
    for size in sizes:
        while joined < size:
            core.add_request(Request(f"warmup-{joined}", prompt, params))
            joined += 1
        _warm_step(core)
    while core.has_work:
        _warm_step(core)
    sized = time.perf_counter()
    _warm_traffic(core, prompt_len)
    mx.synchronize()
    mx.clear_cache()
    log.info("warm-up over decode batch sizes %s took %.1f s (sizes %.1f s, then prompt shapes); MLX memory "
             "after: %.2f GiB active, peak %.2f GiB", sizes if len(sizes) < 16 else f"1..{max_batch}",
             time.perf_counter() - start, sized - start, mx.get_active_memory() / 2**30,
             mx.get_peak_memory() / 2**30)
    mx.reset_peak_memory()


def _warm_traffic(core: Any, prompt_len: int) -> None:
    """The paths real traffic takes beyond batch sizes: several prompts of unequal lengths joining
    a decoding batch in one step, a prompt split over steps, prompt blocks stored from a lone row
    and from a padded batch, a prefix hit resuming mid-prompt: on MLX-CUDA the
    first burst of such joins after the size warm-up stalled for seconds (docs/BENCHMARKS.md)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    block = core.config.block_size
    step_size = core.config.prefill_step_size
    longest = max(core.scheduler.max_model_len - 8, prompt_len)  # a small model's positions run out
    lengths = [min(n, longest) for n in
               (block + 5, prompt_len, 2 * block + 17, step_size + 40, block // 2 + 3, 3 * block // 2)]
    core.add_request(Request("warmup-lone", [i % 5 + 1 for i in range(min(block + 9, longest))], params))
    _warm_step(core)
    for i, n in enumerate(lengths):
        core.add_request(Request(f"warmup-burst-{i}", [(i + j) % 7 + 1 for j in range(n)], params))
    while core.has_work:
        _warm_step(core)
    # The same prompts again: prefix hits resume mid-prompt (a chunk after restored blocks).
    for i, n in enumerate(lengths[:3]):
        core.add_request(Request(f"warmup-hit-{i}", [(i + j) % 7 + 1 for j in range(n)] + [9, 9], params))
    while core.has_work:
        _warm_step(core)
    # Chat turns of similar length arriving together: as many as one forward prefills (rows of unequal
    # lengths above are not all taken together): on MLX-CUDA the first such forward after
    # warm-up took over a second (docs/BENCHMARKS.md).
    rows = min(core.config.max_num_prefill_rows, core.config.max_num_seqs)
    if rows > 1:
        n = min(block + 40, longest)
        for i in range(rows):
            # Ids 10-22, unlike the prompts above: no prefix hit makes one row longer than the rest.
            core.add_request(Request(f"warmup-wide-{i}", [(11 * i + j) % 13 + 10 for j in range(n - i)], params))
        while core.has_work:
            _warm_step(core)
    if core.prefix is not None:
        # Warm-up's blocks are no one's prefix (an SSD tier may keep the few it wrote: no real
        # prompt is made of token ids 1-22 repeated).
        core.prefix.clear()
        core.prefix.reset_stats()


def _warm_step(core: Any) -> None:
    """One warm-up step; a slow one is logged with its work, so a long warm-up shows where it went
    (with an empty kernel cache an MLX-CUDA warm-up takes minutes: docs/BENCHMARKS.md)."""
    started = time.perf_counter()
    core.step()
    took = time.perf_counter() - started
    if took > 1.0:
        log.info("warm-up step took %.1f s: %s", took, core.describe_last_step())
