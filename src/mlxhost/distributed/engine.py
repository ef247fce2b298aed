"""The engine core of a distributed server: rank 0 plans, every rank runs the same step.

Each step rank 0 sends a `StepPlan`: the scheduler's output, which carries the prefix cache's physical
work as ops (evictions, SSD loads, resume checks), and the requests that start prefilling (plain data).
Every rank runs the same `ModelRunner.execute`, which runs those ops on its own shard of the cache first,
so their KV caches, prefix blocks and random state stay the same as rank 0's. Sampling needs no exchange:
after mlx-lm's all-reduce (tensor parallel) or all-gather (pipeline) every rank holds the same logits, and
all ranks start from one seed. That is checked, not assumed: each plan carries a checksum of the tokens rank
0 sampled last step, and a rank that sampled others stops (and with it the server) instead of serving a diverged model. The
checksum covers what the ops found too (a load that failed on one rank only: its SSD shard differs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxhost.distributed.channel import Channel
from mlxhost.distributed.config import DistributedConfig
from mlxhost.distributed.forward import wrap
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request
from mlxhost.engine.runner.model_runner import ModelRunner, StepTokens
from mlxhost.engine.scheduler import SchedulerOutput
from mlxhost.engine.spec.setup import auto_proposer
from mlxhost.engine.warmup import BackgroundWarmup, tile_compiler
from mlxhost.kv.cache_ops import CacheResults
from mlxhost.memory.profile import startup_budget
from mlxhost.platform.quantized_rows import row_layers, set_tiled_rows

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """This rank's state no longer matches rank 0's: it must stop."""


@dataclass
class RankContext:
    dist: DistributedConfig
    channel: Channel
    seed: int
    supervisor: Any = None  # rank 0 only: supervisor.Supervisor
    one_host: bool = False  # rank 0 only: every rank runs on its host (and shares its kernel cache)

    @property
    def rank(self) -> int:
        return self.channel.rank


@dataclass
class StepPlan:
    step: int
    sched: SchedulerOutput | None  # None: shut down
    new_requests: list[Request] = field(default_factory=list)
    digest: int = 0  # of the tokens rank 0 got from the previous step
    # Rank 0's tiled-kernel limit (platform/quantized_rows.py `tiled_rows`), None where the model has no
    # row-folding layers: every rank switches a row count to the tiled kernel at the same step, so the layers
    # every rank computes whole (the LM head) give every rank the same logits.
    tiled_rows: int | None = None


def step_digest(out: StepTokens, cache_results: CacheResults = CacheResults()) -> int:
    return zlib.crc32(pickle.dumps((out.request_ids, out.token_ids, sorted(out.failed), cache_results)))


class DistributedRunner(ModelRunner):
    """The runner of every rank. Rank 0 calls `execute` (it sends the plan first); the others call
    `follow` in a loop, which receives the plan and runs the same step."""

    ctx: RankContext

    def attach(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self._step = 0
        self._digest = 0
        self._sent: set[str] = set()  # rank 0: requests the other ranks know
        self._requests: dict[str, Request] = {}  # the other ranks: the requests in flight
        self._forwards: dict[int, list[tuple]] = {}  # rank 0: step -> the forwards it ran (recent steps)
        self._calls: list[tuple] = []  # the forwards of the last step
        self.model = wrap(self.model, staged=ctx.dist.pipeline_parallel > 1)
        self._row_layers = row_layers(self.model.model)  # (walked once: the plan's limit is applied each step)

    @property
    def num_steps(self) -> int:
        return self._step

    # -- rank 0 --------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepTokens:
        ctx = self.ctx
        new = [requests[c.request_id] for c in sched.prefill_chunks if c.request_id not in self._sent]
        self._sent.update(r.request_id for r in new)
        tiled = self._row_layers[0].tiled_rows if self._row_layers else None
        plan = StepPlan(self._step, sched, new, digest=self._digest, tiled_rows=tiled)
        what = describe(sched, self._step)
        started = time.perf_counter()
        ctx.supervisor.step_started(what)
        try:
            ctx.channel.broadcast(plan)
        except RuntimeError as exc:  # a peer's connection closed
            ctx.supervisor.fatal(f"sending step {self._step} failed: {exc}")
        sent = time.perf_counter()
        out = self._run(sched, requests)
        if out.failed:
            # A rank that died mid-forward fails the step's rows here; say so as the loss it is.
            dead = ctx.supervisor.dead_rank(wait_s=0.5)
            if dead is not None:
                ctx.supervisor.fatal(dead)
        ctx.supervisor.step_done()
        log.debug("%s: plan sent in %.2f ms, ran %.1f ms", what, (sent - started) * 1e3,
                  (time.perf_counter() - sent) * 1e3)
        self._check_forwards()
        self._sent.difference_update(sched.finished_request_ids, out.failed)
        return out

    def _check_forwards(self) -> None:
        """The forwards the other ranks reported against rank 0's own: a difference means their
        collectives no longer pair up, which would stall or corrupt the next ones."""
        mine = self._forwards
        reports = getattr(self.ctx.channel, "signatures", {})
        for rank, theirs in reports.items():
            for step in [s for s in list(theirs) if s in mine]:  # list(): the reader thread adds to it
                calls = theirs.pop(step)
                if calls != mine[step]:
                    self.ctx.supervisor.fatal(f"rank {rank} ran forwards {calls} in step {step}, rank 0 {mine[step]}: "
                                              "the ranks' collectives no longer pair up")
        for step in [s for s in mine if s < self._step - 64]:
            del mine[step]

    def shutdown(self) -> None:
        self.ctx.channel.broadcast_last(StepPlan(self._step, None))

    # -- every rank ----------------------------------------------------------------------------
    def _run(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepTokens:
        out = super().execute(sched, requests)
        self._digest = step_digest(out, self.cache_results)
        calls = self.model.take_calls() if hasattr(self.model, "take_calls") else []
        if self.ctx.rank == 0:
            self._forwards[self._step] = calls
        self._calls = calls
        if out.failed:
            # A failed prefill or decode re-seeded mlx's generator from the clock: re-seed all ranks alike.
            mx.random.seed((self.ctx.seed + self._step) % 2**32)
        self._step += 1
        return out

    # -- ranks > 0 -----------------------------------------------------------------------------
    def follow(self) -> bool:
        """Receives and runs one step; False when rank 0 shuts down. Reports the step to rank 0 (how long
        the plan was waited for, how long the step ran, its forwards) and its phase while it runs."""
        channel = self.ctx.channel
        channel.set_phase(f"waiting for step {self._step}'s plan")
        waiting = time.perf_counter()
        plan: StepPlan = channel.broadcast()
        if plan.sched is not None and (plan.step != self._step or plan.digest != self._digest):
            raise DivergenceError(f"step {self._step}: rank 0 sampled other tokens in the previous step, or its "
                                  f"prefix cache's loads found other blocks (or it is at step {plan.step}); the "
                                  "ranks diverged")
        if plan.sched is None:
            return False
        if plan.tiled_rows is not None and self._row_layers and self._row_layers[0].tiled_rows != plan.tiled_rows:
            set_tiled_rows(self._row_layers, plan.tiled_rows)
        for request in plan.new_requests:
            self._requests[request.request_id] = request
        what = describe(plan.sched, self._step)
        channel.set_phase(f"running {what}")
        running = time.perf_counter()
        out = self._run(plan.sched, self._requests)
        done = time.perf_counter()
        channel.report_step(self._step - 1, running - waiting, done - running, self._calls)
        log.debug("%s: waited %.1f ms for the plan, ran %.1f ms", what, (running - waiting) * 1e3,
                  (done - running) * 1e3)
        for rid in (*plan.sched.finished_request_ids, *out.failed):
            self._requests.pop(rid, None)
        return True


def describe(sched: SchedulerOutput, step: int) -> str:
    """A step's work in a few words, for the timeline and the stall messages."""
    chunks = [c.num_tokens for c in sched.prefill_chunks]
    return (f"step {step} (prefill {chunks if len(chunks) < 9 else f'{len(chunks)} chunks, {sum(chunks)} tokens'}, "
            f"{len(sched.decode_request_ids)} decoding)")


def fixed_speculation(config: Any) -> Any:
    """`--speculative auto` over ranks: its proposer, speculating wherever it can. `auto` decides each step by
    costs it times itself, and every rank would time its own steps: near the threshold one rank would verify
    drafts while another decoded plainly, and their collectives would no longer pair up."""
    if config.speculative != "auto":
        return config
    name = auto_proposer(config)
    log.warning("--speculative auto over ranks: %s drafts on every step it can (each rank would time its own "
                "steps and could decide otherwise)", name)
    return dataclasses.replace(config, speculative=name)


class DistributedEngineCore(EngineCore):
    runner_cls = DistributedRunner

    def __init__(self, model: Any, tokenizer: Any, config: Any, max_model_len: int, buckets: list[int] | None = None,
                 model_key: str = "", *, ctx: RankContext) -> None:
        self.ctx = ctx
        if config.ssd_cache_dir:  # each rank keeps its own shard of every block, in its own folder
            config = dataclasses.replace(config, ssd_cache_dir=os.path.join(
                config.ssd_cache_dir, f"{ctx.dist.layout}-rank{ctx.rank}"))
        config = fixed_speculation(config)
        mx.random.seed(ctx.seed)  # one random stream on every rank: sampling stays identical
        # Rank 0's decode buckets on every rank: it picks them on its own backend and flags, and a batch padded
        # on one rank and not on another runs collectives of other sizes (on MLX-CUDA rank 0 padded to
        # buckets and the others did not: NCCL's all-reduces stopped pairing up and the steps stalled).
        buckets = ctx.channel.broadcast(buckets)
        # The rank layout is part of the key: blocks of another layout (other shards) never match.
        super().__init__(model, tokenizer, config, max_model_len, buckets, f"{model_key}:{ctx.dist.layout}")
        self.runner.attach(ctx)
        self._agree_on_capacity()

    def _startup_budget(self, model: Any, chunk_tokens: int, rules: Any, make_cache: Any = None):
        # Every rank must run the same profiling forwards (they hold collectives): rank 0's timing decides.
        return startup_budget(model, chunk_tokens, rules, make_cache,
                              agree=lambda slow: bool(self.ctx.channel.broadcast(slow)))

    def _agree_on_capacity(self) -> None:
        """Rank 0 admits for every rank: it takes the smallest KV capacity and prefix-cache size of all."""
        mine = (self.kv_capacity_tokens, self.prefix.max_cached_blocks if self.prefix is not None else None)
        everyone = self.ctx.channel.gather(mine)
        if self.ctx.rank != 0:
            return
        kv = [k for k, _ in everyone if k is not None]
        if kv and (self.kv_capacity_tokens is None or min(kv) < self.kv_capacity_tokens):
            self.kv_capacity.set_limit(min(kv))  # the one holder: the scheduler and the governor read it
            log.info("KV capacity: %d tokens, the smallest rank's", self.kv_capacity_tokens)
        blocks = [b for _, b in everyone if b is not None]
        if self.prefix is not None and blocks and min(blocks) < self.prefix.max_cached_blocks:
            self.prefix.set_max_cached_blocks(min(blocks))
            log.info("prefix cache: %d blocks, the smallest rank's", min(blocks))
        if len(blocks) not in (0, len(everyone)):
            raise ValueError("some ranks have a prefix cache and others none: start them with the same flags")

    def warmup(self, max_batch: int, prompt_len: int = 16, background: bool = False, source: str | None = None,
               compile_tiles: bool = False) -> BackgroundWarmup | None:
        """Rank 0 drives it: every warm-up step is a plan the other ranks run too (same shapes, same kernels
        compiled on every rank at the same time). On MLX-CUDA, where every rank runs on rank 0's host (and
        shares its kernel cache), the tiled quantized kernels compile in helper processes meanwhile
        (engine/warmup.py), as one rank's do: until they are ready the quantized layers dequantize those rows,
        on every rank (the plans carry the limit). `background` (`--warmup auto` / `background`): what the
        helpers have left once the pieces are done goes on while serving (returned: the engine loop polls it);
        otherwise it is waited for. Ranks on other hosts would meet a switch to the tiled kernels
        with an empty cache and compile inside a serving step: there the warm-up compiles them itself.
        `compile_tiles` (MLX-CUDA) asks for the tile helpers; no piece helper (`source`) runs beside the ranks.
        On the other ranks a no-op: they run rank 0's warm-up steps as they follow its plans."""
        if self.ctx.rank != 0:
            return None
        log.info("warm-up over %d ranks starts", self.ctx.dist.world_size)
        compiler = tile_compiler(self.warmup_target()) if compile_tiles and self.ctx.one_host else None
        warm = BackgroundWarmup(max_batch, self.runner.buckets, prompt_len, compiler=compiler, model=self.runner.model)
        try:
            warm.run_to_end(self, helpers=not background)
        except BaseException:
            warm.close()
            raise
        return None if warm.finished else warm

    def status(self) -> dict:
        dist = self.ctx.dist
        return {**super().status(), "distributed": {
            "tensor_parallel": dist.tensor_parallel, "pipeline_parallel": dist.pipeline_parallel,
            "backend": dist.backend, "world_size": dist.world_size, "num_steps": self.runner.num_steps}}

    def _fail_all(self, message: str):
        self.ctx.supervisor.fatal(f"engine step failed on rank 0: {message}")
        outputs = super()._fail_all(message)  # only after a shutdown began (fatal returned)
        self.runner.attach(self.ctx)  # the rebuilt runner
        return outputs

    def close(self) -> None:
        if self.ctx.rank == 0:
            self.ctx.supervisor.closing()
            try:
                self.runner.shutdown()
            except RuntimeError as exc:
                log.warning("telling the other ranks to stop failed: %s", exc)
        super().close()


def follow_until_shutdown(core: DistributedEngineCore) -> None:
    """The loop of a rank > 0: plans in, steps run, until rank 0 shuts down."""
    try:
        while core.runner.follow():
            pass
    finally:
        core.close()
