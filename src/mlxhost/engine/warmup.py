"""Warm-up while serving: the shapes MLX-CUDA compiles at first use, run in small pieces between real steps.

MLX's CUDA backend compiles kernels at first use, some per shape; with an empty kernel cache a warm-up before
serving took minutes, most of it in a few tiled quantized-matmul kernels (docs/BENCHMARKS.md, "Compile stalls
on MLX-CUDA"). The server answers once the model is loaded instead. The tiled kernels compile in a helper
process (platform/tile_compile.py) while the layers dequantize the row counts not compiled yet; the rest of
the warm-up runs on the engine thread, one engine step at a time, only while no request is in the engine. A
request that arrives stops it: the warm-up's requests are aborted before the real one is added (the piece
starts again once the engine is idle), so no real step carries warm-up rows and a request waits at most for
the one warm-up step in flight. Pieces run in the order traffic needs them: a lone prompt and its decode, the
decode batch sizes from small to large, prompts of unequal lengths joining a batch and split over steps,
prefix hits, and as many prompts as one forward prefills.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.warmup_memory import (
    KVLoan,
    own_mlx_memory,
    piece_helper_bytes,
    piece_helper_loan,
    server_memory_limit,
)
from mlxhost.platform.kernel_cache import count_modules, kernel_dir
from mlxhost.platform.tile_compile import (
    MIN_TILED_ROWS,
    TileCompiler,
    quantized_shapes,
    tile_checkpoints,
    tile_groups,
    tiled_row_limit,
)

log = logging.getLogger(__name__)

# With only the helper process left to hear from, how long the idle engine waits on its inbox between looks.
HELPER_POLL_S = 0.5
# A safety net for a hung piece helper (stuck in the driver, say): one that reports nothing for this long is
# stopped, and the server runs the pieces left. Its first report comes after it has loaded the model; on an
# H100 an 8B helper's came 3 s after its start, its slowest piece 15 s after the one before. (A helper whose
# steps fail stops at the first failure itself, engine/warmup_helper.py.)
PIECE_HELPER_QUIET_S = 600.0
# For A/B runs: what `_tidy_host` does to the host's heap once the warm-up is over.
WARMUP_AFTER_ENV = "MLXHOST_WARMUP_AFTER"


@dataclass(frozen=True)
class WarmupTarget:
    """What the warm-up reads of a core (its `warmup_target()`), and nothing else of its insides."""

    config: EngineConfig
    max_model_len: int
    buckets: list[int] | None
    model: Any
    budget: Any = None  # the core's start-up MemoryBudget (None: no budget)
    kv_bytes_per_token: int = 0
    kv_capacity: Any = None  # the core's KVCapacity (memory/capacity.py): the piece helper may borrow from it


class WarmableCore(Protocol):
    """The core methods the warm-up runs its pieces through (engine/contract.py's, and two of its own)."""

    has_work: bool

    def add(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def warmup_target(self) -> WarmupTarget: ...

    def reset_prefix_cache(self) -> None: ...


@dataclass
class WarmupReport:
    """What the warm-up did (the start-up log; tests)."""
    pieces_done: list[str] = field(default_factory=list)
    num_interrupted: int = 0  # pieces stopped by a request
    num_steps: int = 0
    longest_step_s: float = 0.0  # the longest a request could have waited behind the warm-up
    engine_s: float = 0.0  # engine-thread time the warm-up's steps took
    helper: str = "off"  # the tile helper: off, compiling, done, failed
    tiled_rows: int = 0  # compiled row counts reported by the helper so far
    piece_helper: str = "off"  # the piece helper (engine/warmup_helper.py): off, compiling, done, failed
    events: list[str] = field(default_factory=list)  # "helper: PIECE", "start: PIECE", "done: PIECE" in order
    finished_s: float | None = None  # seconds from the warm-up's start to its end


@dataclass
class _Piece:
    name: str
    make: Callable[[Any], Iterator[None]]  # core -> steps: adds warm-up requests, yields before each engine step


class BackgroundWarmup:
    """Owned by the engine thread. The loop (engine/loop.py) calls `between_steps` before each step and
    `interrupt` before it adds a request; `run_to_end` runs it all at once (tests, benchmarks)."""

    def __init__(self, max_batch: int, buckets: list[int] | None, prompt_len: int = 16,
                 compiler: Any = None, model: Any = None, piece_helper: Any = None,
                 kv_loan: KVLoan | None = None) -> None:
        self.sizes = [b for b in buckets or range(1, max_batch + 1) if b <= max_batch]
        self.prompt_len = prompt_len
        self.report = WarmupReport()
        self._pieces = [_Piece("lone prompt", self._lone), _Piece("decode batch sizes", self._batch_sizes),
                        _Piece("unequal prompts joining", self._joins), _Piece("prefix hits", self._hits),
                        _Piece("prompts prefilled together", self._together)]
        self._current: Iterator[None] | None = None
        self._rids: list[str] = []
        self._owns_work = False
        self._step_started: float | None = None
        self._started = time.perf_counter()
        self._real_seen = False
        self._pieces_over = False
        self._compiler, self._model = compiler, model
        if compiler is not None:
            from mlxhost.platform.quantized_rows import set_tiled_rows  # lazy: pulls in mlx

            set_tiled_rows(model, MIN_TILED_ROWS - 1)  # dequantize from 8 rows on until the helper says otherwise
            compiler.start()
            self.report.helper = "compiling"
        # Pieces the helper process ran first (their kernels are on disk); without one, every piece may run.
        self._piece_helper = piece_helper
        self._helped: set[str] = set()
        self._helper_heard = time.perf_counter()  # its last report (or its start)
        self._kv_loan = kv_loan if piece_helper is not None else None
        if piece_helper is not None:
            if self._kv_loan is not None:
                self._kv_loan.take()  # before the helper loads: admission never counts on what it will hold
            try:
                piece_helper.start()
            except BaseException:
                if self._kv_loan is not None:
                    self._kv_loan.repay("did not start")
                raise
            self.report.piece_helper = "compiling"

    @property
    def finished(self) -> bool:
        return self.report.finished_s is not None

    @property
    def owns_step(self) -> bool:
        """The engine's next step runs the warm-up's requests, not real ones."""
        return self._owns_work and not self.finished

    @property
    def num_pieces(self) -> int:
        """Pieces not done yet."""
        return len(self._pieces)

    def between_steps(self, core: WarmableCore) -> float | None:
        """Before an engine step: applies the helper's reports and, with no request in the engine, sets up the
        next warm-up step. Returns 0 (step now), seconds the idle engine may wait on its inbox (only the helper
        is left), or None (real requests run, or the warm-up is over)."""
        self._apply_reports()
        now = time.perf_counter()
        if self._step_started is not None:
            took = now - self._step_started
            self._step_started = None
            self.report.num_steps += 1
            self.report.engine_s += took
            self.report.longest_step_s = max(self.report.longest_step_s, took)
        if self.finished or (core.has_work and not self._owns_work):
            return None
        while self._pieces:
            if self._current is None:
                name = self._pieces[0].name
                if self.report.piece_helper == "compiling" and name not in self._helped:
                    return HELPER_POLL_S  # its kernels are still being compiled in the helper process
                self._current = self._pieces[0].make(core)
                self.report.events.append(f"start: {name}")
            try:
                next(self._current)
            except StopIteration:
                self._current = None
                self._rids.clear()
                self.report.pieces_done.append(self._pieces.pop(0).name)
                self.report.events.append(f"done: {self.report.pieces_done[-1]}")
                continue
            self._owns_work = True
            self._step_started = time.perf_counter()
            return 0.0
        if not self._pieces_over:
            self._pieces_over = True
            self._owns_work = False
            self._after_pieces(core)
        if "compiling" in (self.report.helper, self.report.piece_helper) or (
                self._kv_loan is not None and self._kv_loan.out):  # a stopped helper's loan comes back at its end
            return HELPER_POLL_S
        self._finish()
        return None

    def interrupt(self, core: WarmableCore) -> None:
        """A request is about to be added: the warm-up's requests are aborted; their piece starts over later."""
        self._real_seen = True
        if not self._owns_work or self._current is None:
            return
        for rid in self._rids:
            core.abort(rid)
        self._rids.clear()
        self._current = None
        self._owns_work = False
        self._step_started = None  # the step about to run is the request's, not the warm-up's
        self.report.num_interrupted += 1

    def run_to_end(self, core: WarmableCore, helpers: bool = True) -> None:
        """Every piece now, nothing else running meanwhile, and the helpers' compiles waited for; with
        `helpers=False` only the pieces: the helpers' reports go on applying in `between_steps` (a distributed
        engine's ranks warm up in step before serving, and compile no tiled kernel meanwhile)."""
        while not self.finished:
            wait = self.between_steps(core)
            if not helpers and self._pieces_over:
                return
            if wait:
                time.sleep(wait)
            elif core.has_work:
                core.step()

    def close(self) -> None:
        try:
            for helper in (self._compiler, self._piece_helper):
                if helper is not None:
                    helper.close()
        finally:
            if self._kv_loan is not None:
                self._kv_loan.repay("was stopped")  # after close: its process has ended

    # -- the pieces -------------------------------------------------------------------------------------
    def _add(self, core: WarmableCore, rid: str, prompt: list[int], max_tokens: int) -> None:
        self._rids.append(rid)
        core.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    def _lone(self, core: WarmableCore) -> Iterator[None]:
        """What the first request takes: one prompt a little over a block, then its decode alone."""
        target = core.warmup_target()
        longest = max(target.max_model_len - 8, self.prompt_len)  # a small model's positions run out
        self._add(core, "warmup-lone", [i % 5 + 1 for i in range(min(target.config.block_size + 9, longest))], 4)
        while core.has_work:
            yield

    def _batch_sizes(self, core: WarmableCore) -> Iterator[None]:
        """The decode batch through each size it can take (its buckets, else every size up to max_batch), small
        to large: requests join one step at a time, each staying until the largest size has run."""
        prompt = [i % 7 + 1 for i in range(self.prompt_len)]
        joined = 0
        for size in self.sizes:
            while joined < size:
                self._add(core, f"warmup-{joined}", prompt, len(self.sizes) + 2)
                joined += 1
            yield
        while core.has_work:
            yield

    def _lengths(self, target: WarmupTarget) -> list[int]:
        block, longest = target.config.block_size, max(target.max_model_len - 8, self.prompt_len)
        return [min(n, longest) for n in (block + 5, self.prompt_len, 2 * block + 17,
                                          target.config.prefill_step_size + 40, block // 2 + 3, 3 * block // 2)]

    def _joins(self, core: WarmableCore) -> Iterator[None]:
        """Prompts of unequal lengths joining a decoding batch in one step, one split over steps, blocks stored
        from a lone row and from a padded batch: on MLX-CUDA the first burst of such joins after a warm-up of
        sizes alone stalled for seconds (docs/BENCHMARKS.md)."""
        target = core.warmup_target()
        longest = max(target.max_model_len - 8, self.prompt_len)
        self._add(core, "warmup-joined", [i % 5 + 1 for i in range(min(target.config.block_size + 9, longest))], 4)
        yield
        for i, n in enumerate(self._lengths(target)):
            self._add(core, f"warmup-burst-{i}", [(i + j) % 7 + 1 for j in range(n)], 4)
        while core.has_work:
            yield

    def _hits(self, core: WarmableCore) -> Iterator[None]:
        """The joined prompts again, longer: prefix hits resume mid-prompt (a chunk after restored blocks)."""
        for i, n in enumerate(self._lengths(core.warmup_target())[:3]):
            self._add(core, f"warmup-hit-{i}", [(i + j) % 7 + 1 for j in range(n)] + [9, 9], 4)
        while core.has_work:
            yield

    def _together(self, core: WarmableCore) -> Iterator[None]:
        """Chat turns of similar length arriving together, as many as one forward prefills (rows of unequal
        lengths above are not all taken together): on MLX-CUDA the first such forward took over a second."""
        target = core.warmup_target()
        rows = min(target.config.max_num_prefill_rows, target.config.max_num_seqs)
        longest = max(target.max_model_len - 8, self.prompt_len)
        n = min(target.config.block_size + 40, longest)
        for i in range(rows if rows > 1 else 0):
            # Ids 10-22, unlike the prompts above: no prefix hit makes one row longer than the rest.
            self._add(core, f"warmup-wide-{i}", [(11 * i + j) % 13 + 10 for j in range(n - i)], 4)
        while core.has_work:
            yield

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _apply_reports(self) -> None:
        if self._piece_helper is not None:
            reports = self._piece_helper.poll()
            if reports:
                self._helper_heard = time.perf_counter()
            elif (self.report.piece_helper == "compiling"
                  and time.perf_counter() - self._helper_heard > PIECE_HELPER_QUIET_S):
                log.warning("warm-up: the piece helper process reported nothing for %.0f s; it is stopped and the "
                            "pieces left compile here", PIECE_HELPER_QUIET_S)
                self._piece_helper.close()  # its end is reported once its process is gone: the loan comes back then
                self.report.piece_helper = "failed"
            for kind, name, seconds in reports:
                if kind == "piece":
                    if self.report.piece_helper != "compiling":
                        continue  # stopped here already: the server runs its pieces
                    self._helped.add(name)
                    self.report.events.append(f"helper: {name}")
                    log.info("warm-up: the helper process ran '%s' (%.1f s after it started)", name, seconds)
                elif kind in ("done", "failed"):
                    if self.report.piece_helper == "compiling":
                        self.report.piece_helper = kind
                        if kind == "failed":
                            log.warning("warm-up: the piece helper process stopped; the pieces left compile here "
                                        "(%s)", own_mlx_memory())
                    if self._kv_loan is not None:
                        # Both come once its output has closed and the process has ended (tile_compile.py).
                        self._kv_loan.repay("finished" if kind == "done" else "stopped")
        if self._compiler is None:
            return
        from mlxhost.platform.quantized_rows import ALL_TILED_ROWS, set_tiled_rows  # lazy: pulls in mlx

        for kind, rows, seconds in self._compiler.poll():
            if kind == "ready":
                set_tiled_rows(self._model, rows)
                self.report.tiled_rows = rows
                log.info("warm-up: tiled quantized kernels ready up to %d rows (%.1f s in the helper process)",
                         rows, seconds)
            elif kind == "done":
                set_tiled_rows(self._model, ALL_TILED_ROWS)
                self.report.helper = "done"
                log.info("warm-up: the helper process compiled the tiled quantized kernels in %.1f s", seconds)
            else:
                self.report.helper = "failed"
                log.warning("warm-up: the tiled-kernel helper process stopped; rows above %d keep dequantizing "
                            "(correct, slower at 8-127 rows)", self.report.tiled_rows)

    def _after_pieces(self, core: WarmableCore) -> None:
        import mlx.core as mx  # lazy: mlx only when used

        if not self._real_seen:
            # Warm-up's blocks are no one's prefix, its hits no one's (an SSD tier may keep the few it wrote:
            # no real prompt is made of token ids 1-22 repeated). Once real requests came, their blocks stay.
            core.reset_prefix_cache()
        mx.synchronize()
        mx.clear_cache()  # buffers that fit warm-up's shapes, which traffic may never use
        r = self.report
        log.info("warm-up: %d pieces in %d engine steps, %.1f s of engine time (longest step %.2f s), %d "
                 "interrupted by requests; sizes %s; MLX memory %.2f GiB active, peak %.2f GiB", len(r.pieces_done),
                 r.num_steps, r.engine_s, r.longest_step_s, r.num_interrupted,
                 self.sizes if len(self.sizes) < 16 else f"1..{self.sizes[-1]}", mx.get_active_memory() / 2**30,
                 mx.get_peak_memory() / 2**30)
        mx.reset_peak_memory()

    def _finish(self) -> None:
        self.close()
        _tidy_host(os.environ.get(WARMUP_AFTER_ENV, ""))
        self.report.finished_s = time.perf_counter() - self._started
        log.info("warm-up finished %.1f s after it started (tiled-kernel helper: %s, piece helper: %s)",
                 self.report.finished_s, self.report.helper, self.report.piece_helper)


def _tidy_host(what: str) -> None:
    """For A/B runs (MLXHOST_WARMUP_AFTER, docs/BENCHMARKS.md "What the warm-up leaves behind"): once the warm-up
    is over, "collect" runs Python's full garbage collection, "trim" that and glibc's malloc_trim (the free parts
    of the host's heap go back to the system), "freeze" moves every surviving object out of the collector's
    reach; comma-separated, any of them. Unset: nothing."""
    if "collect" in what or "trim" in what:
        gc.collect()
    if "trim" in what:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim this way
            pass
    if "freeze" in what:
        gc.freeze()


def tile_compiler(target: WarmupTarget) -> Any:
    """The helper processes that compile the model's tiled quantized kernels (platform/tile_compile.py), not
    started; None where the model has none worth compiling."""
    model = target.model
    shapes = quantized_shapes(model)
    rows = tile_checkpoints(target.buckets, tiled_row_limit(model))
    if not (shapes and rows):
        return None
    cache = kernel_dir()
    log.info("warm-up: tiled quantized kernels for %d matmul shapes at rows %s compile in %d helper "
             "processes, one per tile (kernel cache %s, %d modules); until each is ready those rows dequantize",
             len(shapes), rows, len(tile_groups(rows)), cache, count_modules(cache))
    return TileCompiler(shapes, rows, cache)


def make_warmup(core: WarmableCore, max_batch: int, compile_tiles: bool, source: str | None = None,
                ) -> BackgroundWarmup:
    """The warm-up a server runs while it serves. `compile_tiles` (MLX-CUDA): the model's tiled quantized kernels
    compile in a helper process meanwhile, into the kernel cache MLX uses (platform/kernel_cache.py); with the
    model's `source` too, another helper process runs each piece first (engine/warmup_helper.py), borrowing
    KV from the server while it runs where the memory left to other processes does not hold it."""
    target = core.warmup_target()
    compiler = piece_helper = kv_loan = None
    loan = piece_helper_loan(target) if compile_tiles and source is not None else None
    if loan is not None:
        need = piece_helper_bytes(target) if target.budget is not None else None
        spec = {"cache_dir": str(kernel_dir()), "source": source, "config": dataclasses.asdict(target.config),
                "max_model_len": target.max_model_len, "buckets": target.buckets, "max_batch": max_batch,
                "needs_bytes": need}  # what it holds beside the server: it checks the device has that free first
        piece_helper = TileCompiler([], [], kernel_dir(), module="mlxhost.engine.warmup_helper", spec=spec)
        if target.budget is not None:  # also with nothing lent: MLX's memory limit is set while it runs
            kv_loan = KVLoan(target.kv_capacity, loan, target.kv_bytes_per_token, server_memory_limit(target, loan),
                             need, target.budget.free_for_others)
    if compile_tiles:
        compiler = tile_compiler(target)
    warm = BackgroundWarmup(max_batch, target.buckets, compiler=compiler, model=target.model,
                            piece_helper=piece_helper, kv_loan=kv_loan)
    log.info("warm-up runs while serving: %d pieces between requests", warm.num_pieces)
    return warm


def warm_up(core: WarmableCore, max_batch: int, prompt_len: int = 16) -> None:
    """The whole warm-up before anything else runs (`--warmup on`)."""
    BackgroundWarmup(max_batch, core.warmup_target().buckets, prompt_len).run_to_end(core)
