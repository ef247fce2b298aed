"""Warm-up while serving (engine/warmup.py) on the tiny fixture model: every piece runs and leaves nothing behind,
a request that arrives stops the warm-up's step and is served alone, the server is ready before the warm-up ends,
the tiled-kernel helper's reports move the layers' dequantize limit, and the piece helper borrows KV capacity
while it runs where the memory left to other processes does not hold it. Order and events only, no timing."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import mlx.core as mx
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.loop import WARMUP_ISOLATE_ENV, Assembled, AsyncEngine, warmup_isolation
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.batch import make_buckets
from mlxhost.engine.warmup import WARMUP_AFTER_ENV, BackgroundWarmup
from mlxhost.memory.budget import BudgetConfig
from mlxhost.models.loader import load_model
from mlxhost.platform import backend
from mlxhost.platform.quantized_rows import ALL_TILED_ROWS, fold_quantized_rows

PIECES = ["lone prompt", "decode batch sizes", "unequal prompts joining", "prefix hits", "prompts prefilled together"]
CONFIG = EngineConfig(max_num_seqs=8, block_size=16, prefill_step_size=48)


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def _core(loaded) -> EngineCore:
    return EngineCore(loaded.model, loaded.tokenizer, CONFIG, 4096, make_buckets(8))


def _real(rid: str = "real") -> Request:
    return Request(rid, list(range(3, 60)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def _tokens(core, request) -> list[int]:
    core.add_request(request)
    tokens = []
    while core.has_work:
        tokens += [t for o in core.step() if o.request_id == request.request_id for t in o.new_token_ids]
    return tokens


class _Helper:
    """Stands in for the tiled-kernel helper process: reports what the test queues."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, int, float]] = []
        self.started = self.closed = False

    def start(self) -> None:
        self.started = True

    def poll(self):
        out, self.queued = self.queued, []
        return out

    def close(self) -> None:
        self.closed = True


def test_every_piece_runs_and_leaves_nothing_behind(loaded):
    core = _core(loaded)
    warm = BackgroundWarmup(8, core.runner.buckets)
    warm.run_to_end(core)
    assert warm.finished and warm.report.pieces_done == PIECES and warm.report.num_interrupted == 0
    assert warm.report.num_steps > len(PIECES)
    assert not core.has_work and core.runner.num_rows == 0
    stats = core.cache_stats()
    assert stats["num_cached_blocks"] == 0 and stats["queried_tokens"] == 0 and stats["hit_tokens"] == 0
    assert stats["evictions"] > 0  # it did store blocks (cleared afterwards)
    assert _tokens(core, _real()) == _tokens(_core(loaded), _real())  # as on a core that never warmed up


def test_a_request_stops_the_warmup_and_runs_alone_then_the_piece_starts_over(loaded):
    core = _core(loaded)
    warm = BackgroundWarmup(8, core.runner.buckets)
    while warm.report.pieces_done != PIECES[:1] or core.scheduler.num_running < 2:  # inside "decode batch sizes"
        assert warm.between_steps(core) == 0.0
        core.step()
    warm.interrupt(core)  # as the engine loop does before it adds a request
    core.add_request(_real())
    tokens, running = [], []
    while core.has_work:
        assert warm.between_steps(core) is None  # real work: the warm-up adds nothing
        running.append(set(core.scheduler.running))
        tokens += [t for o in core.step() if o.request_id == "real" for t in o.new_token_ids]
    assert all(ids <= {"real"} for ids in running) and {"real"} in running  # never beside warm-up rows
    assert tokens == _tokens(_core(loaded), _real())
    warm.run_to_end(core)
    assert warm.report.pieces_done == PIECES and warm.report.num_interrupted == 1
    assert core.cache_stats()["enabled"] and not core.has_work


def test_the_engine_is_ready_before_the_warmup_ends_and_serves_during_it(loaded):
    helper = _Helper()
    made = {}

    steps: list[set[str]] = []

    def make_core():
        core = _core(loaded)
        made["warm"] = BackgroundWarmup(8, core.runner.buckets, compiler=helper, model=core.runner.model)
        step = core.step
        core.step = lambda: steps.append(set(core.scheduler.running)) or step()  # what each step runs
        return Assembled(core, made["warm"])

    engine = AsyncEngine(make_core, max_num_waiting=10)

    async def main():
        engine.start(asyncio.get_running_loop())  # returns once the engine is ready to take requests
        warm = made["warm"]
        assert helper.started and not warm.finished  # the helper still compiles: the warm-up has not ended
        outs = [o async for o in engine.generate(_real())]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 12
        assert not warm.finished  # served during the warm-up
        helper.queued.append(("done", 0, 1.0))
        deadline = time.monotonic() + 300  # a bound for a stuck engine, not a timing assertion
        while not warm.finished:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        engine.stop()
        return warm

    warm = asyncio.run(main())
    assert warm.report.pieces_done == PIECES and warm.report.helper == "done"
    assert any("real" in ids for ids in steps)
    assert not any("real" in ids and any(rid.startswith("warmup-") for rid in ids) for ids in steps)
    assert helper.closed  # the warm-up ends the helper process (the engine's stop does too)


def _folded_core_with_fake_helper(model_dir):
    """A 4-bit model's core with row-folding layers, one of those layers, and a warm-up whose tile helper is fake."""
    loaded = load_model(str(model_dir))
    fold_quantized_rows(loaded.model)
    core = EngineCore(loaded.model, loaded.tokenizer, CONFIG, 4096, make_buckets(8))
    helper = _Helper()
    warm = BackgroundWarmup(8, core.runner.buckets, compiler=helper, model=loaded.model)
    return loaded, core, loaded.model.model.layers[0].self_attn.q_proj, helper, warm


def test_the_helpers_reports_move_the_layers_dequantize_limit(qwen3_4bit_model_dir):
    loaded, core, layer, helper, warm = _folded_core_with_fake_helper(qwen3_4bit_model_dir)
    assert layer.tiled_rows == 7  # nothing compiled yet: 8 rows and more dequantize
    helper.queued.append(("ready", 16, 40.0))
    warm.between_steps(core)
    assert layer.tiled_rows == 16 and warm.report.tiled_rows == 16
    helper.queued.append(("failed", 0, 0.0))
    warm.between_steps(core)
    assert layer.tiled_rows == 16 and warm.report.helper == "failed"  # what was compiled stays usable
    warm.run_to_end(core)
    assert warm.finished
    helper2 = _Helper()
    helper2.queued += [("ready", 8, 1.0), ("done", 0, 2.0)]
    warm2 = BackgroundWarmup(8, core.runner.buckets, compiler=helper2, model=loaded.model)
    assert layer.tiled_rows == 7
    warm2.between_steps(core)
    assert layer.tiled_rows == ALL_TILED_ROWS and warm2.report.helper == "done"  # everything compiled: no limit


def test_run_to_end_without_the_helpers_does_not_wait_for_them(qwen3_4bit_model_dir):
    # A distributed engine's ranks run every piece before serving; the helper's compiles go on while it serves.
    _, core, layer, helper, warm = _folded_core_with_fake_helper(qwen3_4bit_model_dir)
    warm.run_to_end(core, helpers=False)
    assert warm.report.pieces_done == PIECES and not warm.finished and not core.has_work
    assert layer.tiled_rows == 7 and warm.report.helper == "compiling"  # every piece ran on dequantized rows
    helper.queued += [("ready", 16, 5.0), ("done", 0, 6.0)]
    assert warm.between_steps(core) is None and warm.finished
    assert layer.tiled_rows == ALL_TILED_ROWS and helper.closed


def test_stopping_the_engine_stops_the_helper(loaded):
    helper = _Helper()

    def make_core():
        core = _core(loaded)
        return Assembled(core, BackgroundWarmup(8, core.runner.buckets, compiler=helper, model=core.runner.model))

    engine = AsyncEngine(make_core, max_num_waiting=10)

    async def main():
        engine.start(asyncio.get_running_loop())
        engine.stop()

    asyncio.run(main())
    assert helper.started and helper.closed


def test_with_tile_compiles_the_real_helpers_run_beside_the_warmup_to_its_end(qwen3_4bit_model_dir, tmp_path,
                                                                               monkeypatch):
    from mlxhost.engine.warmup import make_warmup

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    loaded = load_model(str(qwen3_4bit_model_dir))
    fold_quantized_rows(loaded.model)  # as the loader does on MLX-CUDA
    core = EngineCore(loaded.model, loaded.tokenizer, CONFIG, 4096, make_buckets(8))
    layer = loaded.model.model.layers[0].mlp.down_proj
    warm = make_warmup(core, 8, compile_tiles=True, source=str(qwen3_4bit_model_dir))
    assert warm.report.helper == "compiling" and layer.tiled_rows == 7
    warm.run_to_end(core)
    assert warm.report.helper == "done" and warm.report.tiled_rows == 127 and layer.tiled_rows == ALL_TILED_ROWS
    assert warm.report.pieces_done == PIECES and warm.report.piece_helper == "done"
    events = warm.report.events
    for name in PIECES:  # each piece ran in the helper process before it ran here
        assert events.index(f"helper: {name}") < events.index(f"start: {name}") < events.index(f"done: {name}")
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())


def test_a_piece_waits_for_the_piece_helper_and_all_run_once_the_helper_fails(loaded):
    core = _core(loaded)
    helper = _Helper()
    warm = BackgroundWarmup(8, core.runner.buckets, piece_helper=helper)
    assert helper.started and warm.between_steps(core) > 0 and not core.has_work  # nothing reported: it idles
    helper.queued.append(("piece", "lone prompt", 1.0))
    while (wait := warm.between_steps(core)) == 0.0:
        core.step()
    assert wait > 0 and warm.report.pieces_done == ["lone prompt"]  # the next piece waits for the helper again
    helper.queued.append(("failed", 0, 0.0))
    warm.run_to_end(core)
    assert warm.report.pieces_done == PIECES and warm.report.piece_helper == "failed" and helper.closed


def test_the_piece_helper_runs_every_piece_and_stops_at_the_first_failed_warmup_request(loaded, monkeypatch):
    from mlxhost.engine.warmup_helper import run_pieces

    core = _core(loaded)
    done: list[str] = []
    assert run_pieces(core, BackgroundWarmup(8, core.runner.buckets), done.append) is None and done == PIECES
    # An out-of-memory step (MLX-CUDA's context is unusable after it): the helper stops at once, reporting no
    # piece as done, and the server runs them all itself.
    real_step = core.step
    monkeypatch.setattr(core, "step", lambda: [dataclasses.replace(o, error="cudaMallocAsync failed: out of memory")
                                               for o in real_step()])
    done = []
    assert run_pieces(core, BackgroundWarmup(8, core.runner.buckets), done.append) == \
        "cudaMallocAsync failed: out of memory"
    assert done == []


def test_a_piece_helper_that_finds_too_little_free_memory_at_its_start_leaves_every_piece_to_the_server(
        loaded, qwen3_model_dir, monkeypatch, tmp_path, capfd):
    from types import SimpleNamespace

    import mlxhost.engine.warmup as warmup

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    core = _core(loaded)
    target = core.warmup_target()
    budget = SimpleNamespace(weights=2**30, activations=2**28, free_for_others=2**40, ceiling=2**40,
                             config=BudgetConfig())
    monkeypatch.setattr(core, "warmup_target", lambda: dataclasses.replace(target, budget=budget))
    monkeypatch.setattr(warmup, "piece_helper_bytes", lambda target: 2**60)  # more than any machine has free
    monkeypatch.setattr(warmup, "piece_helper_loan", lambda target: 0)
    # The real helper process, started from the model's folder: it exits before loading anything.
    warm = warmup.make_warmup(core, 8, compile_tiles=True, source=str(qwen3_model_dir))
    assert warm.report.piece_helper == "compiling"
    warm.run_to_end(core)
    assert warm.report.piece_helper == "failed" and warm.report.pieces_done == PIECES
    assert not any(e.startswith("helper: ") for e in warm.report.events)
    assert "GiB are free and it needs" in capfd.readouterr().err


def test_a_piece_helper_that_reports_nothing_for_too_long_is_stopped_and_its_loan_comes_back_at_its_end(
        loaded, monkeypatch):
    import mlxhost.engine.warmup as warmup

    core = _loan_core(loaded, monkeypatch, short_tokens=1000)
    warm, helper = _make_with_fake_helper(core, monkeypatch)
    assert core.kv_capacity_tokens == 3000 and warm.between_steps(core) > 0  # lent; the first piece waits for it
    monkeypatch.setattr(warmup, "PIECE_HELPER_QUIET_S", 0.0)  # as if it had been silent that long
    time.sleep(0.01)
    warm.between_steps(core)
    assert helper.closed and warm.report.piece_helper == "failed"
    for _ in range(60):  # the pieces run here meanwhile; the warm-up waits for the helper's end
        if warm.between_steps(core) == 0.0:
            core.step()
    assert warm.report.pieces_done == PIECES and not warm.finished
    assert core.kv_capacity_tokens == 3000  # lent until its process is gone: it may still hold the memory
    # A piece it reported late is not taken as run there, and its end brings the loan back.
    helper.queued += [("piece", "lone prompt", 1.0), ("failed", 0, 0.0)]
    warm.run_to_end(core)
    assert warm.finished and core.kv_capacity_tokens == 4000 and warm.report.piece_helper == "failed"
    assert not any(e.startswith("helper: ") for e in warm.report.events)


def test_the_piece_helper_starts_only_where_a_second_copy_of_the_model_fits(loaded, monkeypatch):
    from types import SimpleNamespace

    import mlxhost.engine.warmup as warmup
    from mlxhost.engine.warmup_memory import KV_TOKENS, PREFIX_BYTES, SLACK_BYTES, piece_helper_bytes
    from mlxhost.memory.capacity import KVCapacity

    gib = 2**30
    # 61 GiB of weights with 13 GiB left to other processes (a 32B bf16 model on one 140-GiB GPU): no helper, and
    # its KV of 44 GiB (176k tokens) cannot lend the 63 GiB more it needs either.
    big = SimpleNamespace(budget=SimpleNamespace(weights=61 * gib, activations=7 * gib, kv=44 * gib,
                                                 free_for_others=13 * gib), kv_bytes_per_token=262_144,
                          kv_capacity=KVCapacity(44 * gib // 262_144), max_model_len=32768, model=None)
    assert warmup.piece_helper_loan(big) is None
    small = SimpleNamespace(budget=SimpleNamespace(weights=4 * gib, activations=1 * gib, kv=20 * gib,
                                                   free_for_others=15 * gib), kv_bytes_per_token=147_456,
                            kv_capacity=KVCapacity(20 * gib // 147_456), max_model_len=32768, model=None)
    need = 5 * gib + KV_TOKENS * 147_456 + PREFIX_BYTES
    # Fits what is left with SLACK_BYTES to spare (the processes' CUDA contexts): nothing lent.
    assert need + SLACK_BYTES < 15 * gib and warmup.piece_helper_loan(small) == 0
    small.budget.free_for_others = need + SLACK_BYTES - 1  # one byte short of the slack: a loan of one token
    assert warmup.piece_helper_loan(small) == 1
    assert warmup.piece_helper_loan(SimpleNamespace(budget=None)) == 0  # no budget to go by: as before
    # The helper's dequantized weights in flight are in the budget's activations it copies (memory/profile.py):
    # nothing is added beside them.
    small.budget.activations += 3 * gib
    assert piece_helper_bytes(small) == need + 3 * gib
    # make_warmup then runs the pieces on the engine thread alone.
    monkeypatch.setattr(warmup, "piece_helper_loan", lambda core: None)
    core = _core(loaded)
    warm = warmup.make_warmup(core, 8, compile_tiles=True, source="unused")
    assert warm.report.piece_helper == "off" and warm._piece_helper is None
    warm.close()


# -- the piece helper borrows KV ---------------------------------------------------------------------------
LOAN_LEN = 512  # max_model_len: what the capacity keeps while lent
LOAN_CEILING = 16 * 2**30  # the stand-in budget's ceiling


def _loan_core(loaded, monkeypatch, short_tokens: int | None):
    """A core whose capacity is 4,000 tokens (--kv-budget-tokens) under a stand-in budget that leaves the piece
    helper `short_tokens` of KV short of what other processes may use (None: no budget)."""
    from types import SimpleNamespace

    from mlxhost.engine.warmup_memory import KV_TOKENS, PREFIX_BYTES, SLACK_BYTES

    core = EngineCore(loaded.model, loaded.tokenizer, dataclasses.replace(CONFIG, kv_budget_tokens=4000),
                      LOAN_LEN, make_buckets(8))
    per_token, target = core.kv_bytes_per_token, core.warmup_target()
    budget = None
    if short_tokens is not None:
        need = 2**30 + 2**28 + KV_TOKENS * per_token + PREFIX_BYTES
        budget = SimpleNamespace(weights=2**30, activations=2**28, ceiling=LOAN_CEILING, config=BudgetConfig(),
                                 free_for_others=need + SLACK_BYTES - short_tokens * per_token)
    monkeypatch.setattr(core, "warmup_target", lambda: dataclasses.replace(target, budget=budget))
    return core


def _make_with_fake_helper(core, monkeypatch) -> tuple[BackgroundWarmup, _Helper]:
    import mlxhost.engine.warmup as warmup

    helper = _Helper()

    def fake(*args, module: str = "", **kwargs):
        assert module == "mlxhost.engine.warmup_helper"  # the tiny float model has no tiled kernels
        return helper

    monkeypatch.setattr(warmup, "TileCompiler", fake)
    return warmup.make_warmup(core, 8, compile_tiles=True, source="unused"), helper


@pytest.mark.parametrize("end", ["done", "failed", "closed"])
def test_the_piece_helper_borrows_kv_while_it_runs_and_gives_it_back(loaded, monkeypatch, end):
    limit_before = mx.get_memory_limit()
    core = _loan_core(loaded, monkeypatch, short_tokens=1000)
    warm, helper = _make_with_fake_helper(core, monkeypatch)
    assert helper.started and warm.report.piece_helper == "compiling"
    # Lowered on the one capacity the scheduler admits by and the API's "never fits" check reads.
    assert core.kv_capacity_tokens == core.scheduler.kv_capacity_tokens == core.stats().kv_capacity_tokens == 3000
    # MLX frees cached buffers rather than grow past the ceiling less the loan while the helper runs.
    assert mx.get_memory_limit() == LOAN_CEILING - 1000 * core.kv_bytes_per_token
    warm.between_steps(core)
    assert core.kv_capacity_tokens == 3000  # still running: still lent
    if end == "closed":
        warm.close()
        assert helper.closed
    else:
        helper.queued.append((end, 0, 1.0))
        warm.between_steps(core)
        assert warm.report.piece_helper == end
    assert core.kv_capacity_tokens == core.scheduler.kv_capacity_tokens == 4000
    assert mx.get_memory_limit() == limit_before  # and the limit is back
    warm.close()  # repaid once only
    assert core.kv_capacity_tokens == 4000 and mx.get_memory_limit() == limit_before


def test_the_piece_helper_is_refused_where_not_even_a_loan_covers_it(loaded, monkeypatch):
    # 4,000 tokens less the 512 kept for the longest request leave 3,488 to lend: one more is too many.
    core = _loan_core(loaded, monkeypatch, short_tokens=4000 - LOAN_LEN + 1)
    warm, helper = _make_with_fake_helper(core, monkeypatch)
    assert not helper.started and warm.report.piece_helper == "off" and core.kv_capacity_tokens == 4000
    warm.close()
    core = _loan_core(loaded, monkeypatch, short_tokens=4000 - LOAN_LEN)  # exactly what may be lent
    warm, helper = _make_with_fake_helper(core, monkeypatch)
    assert helper.started and core.kv_capacity_tokens == LOAN_LEN
    warm.close()
    assert core.kv_capacity_tokens == 4000


@pytest.mark.parametrize("short_tokens", [None, 0])
def test_without_a_budget_or_with_room_left_the_helper_runs_and_borrows_nothing(loaded, monkeypatch, short_tokens):
    limit_before = mx.get_memory_limit()
    core = _loan_core(loaded, monkeypatch, short_tokens=short_tokens)
    warm, helper = _make_with_fake_helper(core, monkeypatch)
    assert helper.started and core.kv_capacity_tokens == 4000
    # With a budget, MLX's limit is the server's ceiling while the helper runs, even with nothing lent.
    assert mx.get_memory_limit() == (limit_before if short_tokens is None else LOAN_CEILING)
    warm.close()
    assert mx.get_memory_limit() == limit_before


def test_with_several_models_in_the_process_mlxs_limit_is_left_alone():
    from types import SimpleNamespace

    from mlxhost.engine.warmup_memory import server_memory_limit

    for config, limit in [(BudgetConfig(), 2**34 - 10 * 1024), (BudgetConfig(share=0.5), None),
                          (BudgetConfig(reserved_bytes=2**30), None)]:
        target = SimpleNamespace(budget=SimpleNamespace(ceiling=2**34, config=config), kv_bytes_per_token=1024,
                                 model=None)
        assert server_memory_limit(target, 10) == limit


def test_lent_kv_is_kept_from_admission_and_a_moved_limit_keeps_the_loan_out():
    from mlxhost.engine.scheduler import Scheduler
    from mlxhost.memory.capacity import KVCapacity

    capacity = KVCapacity(120)
    sched = Scheduler(EngineConfig(max_num_seqs=8), max_model_len=1024, kv_capacity=capacity)
    capacity.lend(60)
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(1, 11)), SamplingParams(max_tokens=20)))  # 30 tokens each
    sched.schedule()
    assert list(sched.running) == ["r0", "r1"] and sched.num_waiting == 2  # 2 x 30 <= 60 < 3 x 30
    capacity.set_limit(150)  # the governor moves the limit: the loan stays out
    assert capacity.tokens == 90 and capacity.lendable(keep=80) == 10
    capacity.repay(60)
    sched.schedule()
    assert list(sched.running) == ["r0", "r1", "r2", "r3"]  # nothing running was touched; the rest join


def test_the_warmup_gets_a_thread_of_its_own_by_default_on_cuda_only(monkeypatch):
    for on_cuda, expected in ((True, "thread"), (False, "off")):
        monkeypatch.setattr(backend, "is_cuda", lambda on_cuda=on_cuda: on_cuda)
        assert warmup_isolation({}) == expected
        assert warmup_isolation({WARMUP_ISOLATE_ENV: "stream"}) == "stream"  # the switch wins either way


@pytest.mark.parametrize("mode", ["off", "stream", "thread"])
def test_warmup_steps_wherever_they_run_leave_real_output_unchanged(loaded, monkeypatch, mode):
    """MLXHOST_WARMUP_ISOLATE: the warm-up's steps as every step, on a stream or on a thread of their own; a
    request during and one after the warm-up get the tokens a core that never warmed up gives, and a warm-up
    thread is gone at its end."""
    monkeypatch.setenv(WARMUP_ISOLATE_ENV, mode)
    steps: list[tuple[str, bool]] = []  # (thread, whether the step was the warm-up's)
    made = {}

    def make_core():
        core = _core(loaded)
        made["warm"] = BackgroundWarmup(8, core.runner.buckets)
        step = core.step

        def traced():
            steps.append((threading.current_thread().name, made["warm"].owns_step))
            return step()

        core.step = traced
        return Assembled(core, made["warm"])

    engine = AsyncEngine(make_core, max_num_waiting=10)

    async def tokens_of(request):
        return [t async for o in engine.generate(request) for t in o.new_token_ids]

    async def main():
        engine.start(asyncio.get_running_loop())
        during = await tokens_of(_real())
        deadline = time.monotonic() + 300  # a bound for a stuck engine, not a timing assertion
        while not made["warm"].finished:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        after = await tokens_of(_real("after"))
        engine.stop()
        return during, after

    during, after = asyncio.run(main())
    expected = _tokens(_core(loaded), _real())
    assert during == expected and after == expected
    assert made["warm"].report.pieces_done == PIECES
    warm_threads = {name for name, warm in steps if warm}
    real_threads = {name for name, warm in steps if not warm}
    assert warm_threads and real_threads and not any(name.startswith("mlxhost-warm") for name in real_threads)
    if mode == "thread":
        assert all(name.startswith("mlxhost-warm") for name in warm_threads)
        assert not any(t.name.startswith("mlxhost-warm") for t in threading.enumerate())
    else:
        assert warm_threads == real_threads  # the engine thread, on its own stream or on another


def test_the_host_is_tidied_after_the_warmup_only_when_asked(loaded, monkeypatch):
    """MLXHOST_WARMUP_AFTER: "collect,freeze" freezes what survives the warm-up; unset, the collector is untouched."""
    import gc

    for value, frozen in (("", False), ("collect,trim,freeze", True)):
        monkeypatch.setenv(WARMUP_AFTER_ENV, value)
        gc.unfreeze()
        core = _core(loaded)
        BackgroundWarmup(8, core.runner.buckets).run_to_end(core)
        assert (gc.get_freeze_count() > 0) == frozen
    gc.unfreeze()
