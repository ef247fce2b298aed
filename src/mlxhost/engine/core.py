"""One engine step: schedule -> run -> update, then turn new tokens into text outputs.

Runs on the engine thread only; the asyncio side talks to it through `AsyncEngine`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from mlxhost.config import EngineConfig
from mlxhost.engine.contract import CoreStats, StepInfo
from mlxhost.engine.detokenizer import StopStringMatcher, make_detokenizer_factory
from mlxhost.engine.grammar import GrammarSource
from mlxhost.engine.request import Request, RequestOutput
from mlxhost.engine.runner.batch import can_batch
from mlxhost.engine.runner.batch_prefill import why_not_batched
from mlxhost.engine.runner.model_runner import ModelRunner
from mlxhost.engine.runner.sampling import reseed_after_failure
from mlxhost.engine.scheduler import Scheduler
from mlxhost.engine.spec.setup import make_speculative, reserve_proposer
from mlxhost.engine.status import (
    cache_stats,
    describe_progress,
    memory_status,
    request_progress,
    requests_status,
    spec_stats,
    vision_stats,
)
from mlxhost.engine.warmup import BackgroundWarmup, WarmupTarget, make_warmup, warm_up
from mlxhost.kv.kinds.kv_quant import plan_kv_quant
from mlxhost.kv.kinds.probe import probe_kv
from mlxhost.kv.store.kv_store import KVBlockStore
from mlxhost.kv.store.setup import make_prefix_cache
from mlxhost.memory.budget import reserve_state
from mlxhost.memory.capacity import KVCapacity
from mlxhost.memory.pressure import MemoryGovernor
from mlxhost.memory.profile import budget_config, startup_budget
from mlxhost.memory.release import give_back_memory
from mlxhost.multimodal.vision_cache import VisionCache
from mlxhost.platform.backend import is_cuda
from mlxhost.platform.cudnn_attention import apply_cudnn_attention

log = logging.getLogger(__name__)


@dataclass
class _TextState:
    detok: Any  # IncrementalDetokenizer or ByteLevelDetokenizer
    stop: StopStringMatcher
    has_text: bool = False


class EngineCore:
    # What builds the runner and the prefix cache's physical half; a distributed server's core
    # (distributed/engine.py) puts its own in.
    runner_cls = ModelRunner
    store_cls = KVBlockStore

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig,
        max_model_len: int,
        buckets: list[int] | None = None,
        model_key: str = "",
    ) -> None:
        # Before any forward of this process: MLX reads the switch at its first attention call.
        self.cudnn_attention = apply_cudnn_attention(config.cudnn_attention)
        self.tokenizer = tokenizer
        self._make_detokenizer = make_detokenizer_factory(tokenizer)
        self.config = config
        # --kv-bits: which layers hold quantized KV (raises if the group size does not fit the model).
        self.kv_quant = plan_kv_quant(model, config.kv_bits, config.kv_group_size, config.kv_quant_mode)
        make_cache = self.kv_quant.make_cache if self.kv_quant is not None else make_prompt_cache
        probe = probe_kv(model, make_cache)
        self.probe = probe
        if config.max_num_seqs > 1 and not can_batch(make_cache(model)):
            log.warning("this model's caches (%s) have no batch version in mlx-lm: serving one request at a "
                        "time", sorted(set(probe.layer_kinds)))
            config = dataclasses.replace(config, max_num_seqs=1)
            self.config = config
        why_not = why_not_batched(model, make_cache)
        if why_not is not None and config.max_num_prefill_rows > 1:
            config = dataclasses.replace(config, max_num_prefill_rows=1)
            self.config = config
        if why_not is None and config.max_num_prefill_rows == 1:
            why_not = "--max-num-prefill-rows 1"
        log.info("prefill: %s", f"up to {config.max_num_prefill_rows} prompts per forward" if why_not is None
                 else f"one prompt per forward ({why_not})")
        prefix_on = config.enable_prefix_cache and config.cache_memory_bytes != 0 and probe.shareable
        # The start-up budget; `self.governor.live` is the one in force (desktop mode follows free memory).
        is_vlm = getattr(model, "is_vlm", False)
        self.budget = self._startup_budget(model, config.prefill_step_size, budget_config(config, prefix_on, is_vlm),
                                           make_cache)
        if self.budget is not None and probe.bytes_per_seq:
            self.budget = reserve_state(self.budget, probe.bytes_per_seq * config.max_num_seqs)
        per_token = probe.budget_bytes_per_token
        self.block_bytes = per_token * config.block_size
        self.spec = make_speculative(model, config, probe.logits_width)
        if self.spec is not None:
            # A draft model's or head's weights are fixed; its KV grows with every running token beside the target's.
            self.budget, per_token = reserve_proposer(self.budget, self.spec.proposer, model, per_token)
        # The one holder of KV capacity (memory/capacity.py): the scheduler admits by it, the governor moves it.
        self.kv_bytes_per_token = per_token  # a running request's KV per token (what the warm-up's helper needs)
        self.kv_capacity = KVCapacity.at_startup(self.budget, per_token, config.kv_budget_tokens)
        prefix_bytes = self.budget.prefix_cache if self.budget is not None and prefix_on else None
        self.prefix, store = make_prefix_cache(model, config, model_key, probe, prefix_bytes, self.kv_quant,
                                               self.store_cls)
        # Recurrent state can be snapshotted only where a forward stops: chunks inside a prompt end on blocks.
        self.scheduler = Scheduler(config, max_model_len, self.prefix, self.kv_capacity,
                                   align_chunks=store is not None and store.wants_snapshots)
        # Vision features by image hash (VLMs only): the budget's vision share, or the flag without one.
        self.vision_cache = None
        if is_vlm and config.vision_cache_bytes:
            vision_bytes = self.budget.vision_cache if self.budget is not None else config.vision_cache_bytes
            self.vision_cache = VisionCache(vision_bytes)
            log.info("vision cache: %.0f MB", vision_bytes / 1e6)
        self.grammar = GrammarSource(tokenizer, probe.logits_width, _eos_ids(tokenizer))
        self.runner = self.runner_cls(model, buckets, store, config.block_size, self.vision_cache,
                                      kv_prealloc_tokens=config.kv_prealloc_tokens, grammar=self.grammar,
                                      make_cache=make_cache, spec=self.spec,
                                      batch_prefill=self.config.max_num_prefill_rows > 1,
                                      logits_width=probe.logits_width)
        self.governor = None
        if self.budget is not None:
            self.governor = MemoryGovernor(self.budget, per_token, self.prefix, self.scheduler,
                                           block_bytes=self.block_bytes,
                                           kv_tokens_override=config.kv_budget_tokens, capacity=self.kv_capacity,
                                           refresh_s=_memory_refresh_s(config, self.budget.mode))
            self.governor.vision_cache = self.vision_cache
            if store is not None and store.wants_snapshots:
                self.governor.attach_snapshots(store.snapshots)
        log.info("KV for running requests: %s tokens of %d bytes%s%s", self.kv_capacity_tokens, per_token,
                 f" ({config.kv_bits}-bit KV in {len(self.kv_quant.layers)}/{probe.num_layers} layers"
                 f"{', ' + self.kv_quant.attention if self.kv_quant.attention else ''})"
                 if self.kv_quant is not None else "",
                 f", {config.kv_prealloc_tokens} reserved per batch up front" if config.kv_prealloc_tokens else "")
        self._requests: dict[str, Request] = {}
        self._text: dict[str, _TextState] = {}
        self.max_model_len = max_model_len
        self.last_step: StepInfo | None = None  # what the last step ran (slow-step log, step trace)

    def _startup_budget(self, model: Any, chunk_tokens: int, rules: Any, make_cache: Any = None):
        # A distributed core overrides this: every rank must run the same profiling forwards.
        return startup_budget(model, chunk_tokens, rules, make_cache, remember=self.config.measurements_dir)

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.kv_capacity.tokens

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        self._text[request.request_id] = _TextState(
            self._make_detokenizer(request.prompt_token_ids),
            StopStringMatcher(request.sampling.stop),
        )

    add_request = add  # the name tests and benchmarks drive a bare core by

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def stats(self) -> CoreStats:
        prefix, spec, scheduler = self.prefix, self.spec, self.scheduler
        return CoreStats(
            scheduler.num_running,
            scheduler.num_waiting,
            *((prefix.num_queried_tokens, prefix.num_hit_tokens, prefix.pool.num_cached) if prefix else (0, 0, 0)),
            kv_bytes_per_token=self.probe.bytes_per_token,
            spec_drafted_tokens=spec.stats.num_drafted if spec is not None else 0,
            spec_accepted_tokens=spec.stats.num_accepted if spec is not None else 0,
            spec_max_batch=spec.max_batch if spec is not None else 0,
            spec_big_batch_steps=spec.stats.num_big_batch_steps if spec is not None else 0,
            spec_kind=spec.mode if spec is not None else "",
            kv_capacity_tokens=self.kv_capacity.tokens,
            last_step=self.last_step,
        )

    def adapters(self) -> dict:
        return self.runner.lora.stats()["adapters"] if len(self.runner.lora) else {}

    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        if self.governor is not None:
            self.governor.maybe_refresh()  # desktop mode: a clock read, memory read every few seconds
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for chunk in sched.prefill_chunks:  # a prompt's first chunk ends its wait in the queue
            request = self._requests.get(chunk.request_id)
            if request is not None and request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
        started = time.perf_counter()
        try:
            step = self.runner.execute(sched, self._requests)
        except Exception as exc:  # a failure the runner could not pin on requests: the last resort
            log.exception("engine step failed")
            return self._fail_all(f"engine step failed: {exc}")
        ran = time.perf_counter()
        execute_s = ran - started
        chunk_tokens = tuple(c.num_tokens for c in sched.prefill_chunks)
        # The whole step, not the runner's phases: a prefill's device work may finish inside the decode read-back.
        num_prefilled = sum(chunk_tokens)
        self.scheduler.step_cost.observe(num_prefilled, len(sched.decode_request_ids), execute_s)
        if num_prefilled and log.isEnabledFor(logging.DEBUG):
            now = time.monotonic()
            log.debug("prefill: %s", "; ".join(describe_progress(request_progress(self._requests[c.request_id], now))
                                               for c in sched.prefill_chunks if c.request_id in self._requests))
        if self.prefix is not None:
            self.prefix.finish_ops(self.runner.cache_results)  # what the plan's loads and checks found
        if step.failed_block_ids:
            self.prefix.discard_stores(step.failed_block_ids)
        outputs = [self._fail(rid, why) for rid, why in step.failed.items() if rid in self._requests]
        new: dict[str, list[int]] = {}  # a speculative step gives a request several tokens
        for rid, token in zip(step.request_ids, step.token_ids):
            new.setdefault(rid, []).append(token)
        # What each request keeps of them: EOS, max_tokens or a stop string (found in the text) inside a
        # speculative run cut the rest. The scheduler then appends them and finishes whom they end.
        kept: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        stopped: set[str] = set()
        detok_began = time.perf_counter()
        for rid, tokens in new.items():
            request = self.scheduler.running.get(rid)
            if request is None:  # finished or aborted while its tokens were in flight
                continue
            if not request.sampling.max_tokens:  # a prefill only: the token sampled from its prompt is not output
                tokens = []
            if len(tokens) > 1:  # a lone token is always kept (it may end the request)
                tokens = tokens[: self.scheduler.num_kept(request, tokens)]
            try:
                n, texts[rid], hit = self._text_of(rid, tokens)
            except Exception as exc:  # e.g. a detokenizer error: this request only
                log.exception("output of request %s failed", rid)
                outputs.append(self._fail(rid, f"output failed: {exc}"))
                continue
            kept[rid] = tokens[:n]
            if hit:
                stopped.add(rid)
        updating = time.perf_counter()
        finished = {r.request_id for r in self.scheduler.update(kept, stopped)}
        updated = time.perf_counter()
        for rid, tokens in kept.items():
            try:
                out = self._make_output(self._requests[rid], tokens, texts[rid], rid in finished, rid in stopped)
            except Exception as exc:
                log.exception("output of request %s failed", rid)
                outputs.append(self._fail(rid, f"output failed: {exc}"))
                continue
            if rid in step.logprobs:
                out.logprobs = step.logprobs[rid][: len(out.new_token_ids)]
            out.prompt_logprobs = step.prompt_logprobs.get(rid)
            outputs.append(out)
            if out.finished:
                self._forget(rid)
        runner, ended = self.runner, time.perf_counter()
        self.last_step = StepInfo(
            chunk_tokens, len(sched.decode_request_ids), runner.num_rows,
            sum(len(ops) for ops in sched.store_ops.values()), execute_s, runner.last_prefill_s, runner.last_store_s,
            runner.last_join_s, runner.last_decode_s, schedule_s=started - began, detok_s=updating - detok_began,
            update_s=updated - updating, output_s=ended - ran - (updated - detok_began),
            sample_s=runner.last_sample_s, launch_s=runner.last_launch_s, readback_s=runner.last_readback_s)
        return outputs

    def _fail(self, request_id: str, message: str) -> RequestOutput:
        request = self._requests[request_id]
        self.scheduler.fail(request_id)
        self._forget(request_id)
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens, error=message)

    def warmup(self, max_batch: int, prompt_len: int = 16, background: bool = False, source: str | None = None,
               compile_tiles: bool = False) -> BackgroundWarmup | None:
        """The warm-up (warmup.py): all of it now, or with `background` the one the engine loop runs between
        requests, returned (`compile_tiles` and `source`: its helper processes on MLX-CUDA)."""
        if background:
            return make_warmup(self, max_batch, compile_tiles, source)
        warm_up(self, max_batch, prompt_len)
        return None

    def warmup_target(self) -> WarmupTarget:
        """What the warm-up sizes its pieces and helper processes by; the KV capacity its piece helper may borrow
        from while it runs (lent and repaid on this, the engine thread)."""
        return WarmupTarget(self.config, self.max_model_len, self.runner.buckets, self.runner.model, self.budget,
                            self.kv_bytes_per_token, self.kv_capacity)

    def reset_prefix_cache(self) -> None:
        """Drops the memory tier's blocks and the hit counters (the warm-up's are no one's prefix)."""
        if self.prefix is not None:
            self.prefix.clear()
            self.prefix.reset_stats()

    def _text_of(self, rid: str, tokens: list[int]) -> tuple[int, str, bool]:
        """Feeds `tokens` to the request's detokenizer: (how many it keeps, their text, whether the last
        kept one completed a stop string, which ends the output there, even inside a speculative run)."""
        state = self._text[rid]
        text, hit, n = "", False, 0
        for n, token in enumerate(tokens, 1):
            piece, hit = state.stop.feed(state.detok.add(token))
            text += piece
            if hit:
                break
        return n, text, hit

    def _make_output(self, request: Request, tokens: list[int], text: str, finished: bool, hit: bool,
                     ) -> RequestOutput:
        state = self._text[request.request_id]
        if finished and not hit:
            tail, hit = state.stop.feed(state.detok.flush())
            text += tail if hit else tail + state.stop.flush()
        if text:
            state.has_text = True
        elif finished and not state.has_text:
            # An empty reply is the model's own output (e.g. a random model repeating a special token,
            # which replies skip as every server does); say so, or it looks like a lost stream.
            log.info("request %s ended after %d tokens without any text: token ids %s decode to nothing",
                     request.request_id, request.num_output_tokens, sorted(set(request.output_token_ids))[:8])
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(tokens),
            text=text,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            # A stop string completed by the token that also reached max_tokens still cut the text: "stop".
            finish_reason=("stop" if hit else request.finish_reason) if finished else None,
            # After a preemption its last prefill's hit, which covers its output so far too: the prompt's part.
            num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens),
            num_cache_creation_tokens=self._num_cache_creation_tokens(request),
        )

    def _num_cache_creation_tokens(self, request: Request) -> int:
        if not request.cache_ttl_s or self.prefix is None:
            return 0
        full = request.num_prompt_tokens // self.prefix.block_size * self.prefix.block_size
        return max(0, full - request.num_cached_tokens)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._text.pop(request_id, None)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outputs = []
        for rid, request in list(self._requests.items()):
            self.scheduler.abort(rid)
            outputs.append(
                RequestOutput(rid, [], "", request.num_prompt_tokens, request.num_output_tokens, error=message)
            )
            self._forget(rid)
        # Start the runner's state from scratch: its caches may be half-updated, and so may the
        # prefix cache's planned blocks, so that starts empty too.
        self.runner.reset()
        self.scheduler.reset_after_failure()
        reseed_after_failure()
        return outputs

    # What the status and cache endpoints read (status.py).
    def cache_stats(self) -> dict:
        store = self.runner.store if self.prefix is not None else None
        return cache_stats(self.prefix, store, self.block_bytes, self.vision_stats())

    def status(self) -> dict:
        """The budget in force (desktop mode: after pressure) next to the start-up one and live readings."""
        config, probe = self.config, self.probe
        return {
            **memory_status(config.memory_mode, self.budget, self.governor),
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": probe.bytes_per_token,
            "kv_dtype": str(probe.dtype).rsplit(".", 1)[-1],
            "kv_quantization": self.kv_quant.status() if self.kv_quant is not None else None,
            "kv_prealloc_tokens": config.kv_prealloc_tokens,
            "num_running": self.scheduler.num_running,
            "structured_output": self.grammar.stats(),
            "num_waiting": self.scheduler.num_waiting,
            "prefix_cache": self.cache_stats(),
            "speculative": self.spec_stats(),
            "cudnn_attention": self.cudnn_attention,
            "step_cost": self.scheduler.step_cost.as_dict(),
            # Each request's prefill so far: every running one, the first waiting ones (status.py).
            **requests_status(self.scheduler.running.values(), self.scheduler.waiting, time.monotonic()),
        }

    def spec_stats(self) -> dict:
        return spec_stats(self.spec)

    def vision_stats(self) -> dict | None:
        return vision_stats(self.vision_cache, self.runner.mm)

    def clear_cache(self) -> int:
        """Both tiers (and the vision cache); blocks held by running requests stay until those finish. Returns
        the memory blocks dropped; their arrays and the SSD files go with the next step's plan (on every rank),
        which the engine loop runs right after this call."""
        if self.vision_cache is not None:
            self.vision_cache.clear()
        n = 0
        if self.prefix is not None:
            n = self.prefix.clear(disk=True)
        give_back_memory()  # on the engine thread, which owns the MLX stream whose buffers are cached
        return n

    def on_idle(self) -> None:
        """Nothing to run: hand blocks still queued for the SSD tier to its writer now, so a crash
        while idle loses nothing that was computed; desktop mode re-reads memory if it is time."""
        if self.governor is not None:
            self.governor.maybe_refresh()
        if self.prefix is not None and self.runner.store.ssd is not None:
            self.runner.store.spill_pending()

    def close(self) -> None:
        """Lets queued SSD writes reach the disk."""
        if self.prefix is not None:
            self.runner.store.close()


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _memory_refresh_s(config: EngineConfig, mode: str) -> float:
    """Seconds between desktop mode's reads of free memory; 0 (the start-up budget stays) on MLX-CUDA.
    There free device memory cannot tell other processes' use from ours: MLX-CUDA hands freed buffers to
    CUDA's memory pool, which keeps them beyond what MLX counts, so under load it read a fraction of what
    was free and the governor evicted the prefix cache for nothing (docs/BENCHMARKS.md, "Memory readings
    under CUDA's memory pool"). A discrete GPU is not the memory desktop apps draw on either."""
    if mode == "desktop" and config.memory_refresh_s and is_cuda():
        log.info("memory: on MLX-CUDA the budget stays as computed at start-up (free device memory counts "
                 "CUDA's pool of MLX's freed buffers as used)")
        return 0.0
    return config.memory_refresh_s
