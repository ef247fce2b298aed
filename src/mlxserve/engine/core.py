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

from mlxserve.server.config import EngineConfig
from mlxserve.engine.runner.batch import can_batch
from mlxserve.engine.runner.batch_prefill import why_not_batched
from mlxserve.engine.grammar import GrammarSource
from mlxserve.engine.detokenizer import StopStringMatcher, make_detokenizer_factory
from mlxserve.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from mlxserve.engine.runner.model_runner import ModelRunner, reseed_after_failure
from mlxserve.engine.scheduler import Scheduler
from mlxserve.kv.kinds.kv_quant import plan_kv_quant
from mlxserve.kv.store.kv_store import KVBlockStore
from mlxserve.engine.spec.setup import make_speculative, reserve_draft
from mlxserve.kv.kinds.probe import probe_kv
from mlxserve.kv.store.setup import make_prefix_cache
from mlxserve.memory.budget import kv_tokens, reserve_state
from mlxserve.memory.pressure import MemoryGovernor
from mlxserve.memory.profile import budget_config, startup_budget
from mlxserve.platform.backend import is_cuda
from mlxserve.platform.cudnn_attention import apply_cudnn_attention

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
        self._block_bytes = per_token * config.block_size
        self.spec = make_speculative(model, config, probe.logits_width)
        if self.spec is not None and self.spec.draft_model is not None:
            # The draft model's weights are fixed; its KV grows with every running token beside the target's.
            self.budget, per_token = reserve_draft(self.budget, self.spec.draft_model, per_token)
        self.kv_capacity_tokens = config.kv_budget_tokens  # at start-up; the scheduler holds the live one
        if self.kv_capacity_tokens is None and self.budget is not None:
            self.kv_capacity_tokens = kv_tokens(self.budget, per_token)
        prefix_bytes = self.budget.prefix_cache if self.budget is not None and prefix_on else None
        self.prefix, store = make_prefix_cache(model, config, model_key, probe, prefix_bytes, self.kv_quant,
                                               self.store_cls)
        # Recurrent state can be snapshotted only where a forward stops: chunks inside a prompt end on blocks.
        self.scheduler = Scheduler(config, max_model_len, self.prefix, self.kv_capacity_tokens,
                                   align_chunks=store is not None and store.wants_snapshots)
        # Vision features by image hash (VLMs only): the budget's vision share, or the flag without one.
        self.vision_cache = None
        if is_vlm and config.vision_cache_bytes:
            from mlxserve.multimodal.vision_cache import VisionCache

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
                                           block_bytes=self._block_bytes,
                                           kv_tokens_override=config.kv_budget_tokens,
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
        self.last_sched = None
        self.last_execute_s = 0.0

    def _startup_budget(self, model: Any, chunk_tokens: int, rules: Any, make_cache: Any = None):
        # A distributed core overrides this: every rank must run the same profiling forwards.
        return startup_budget(model, chunk_tokens, rules, make_cache)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        self._text[request.request_id] = _TextState(
            self._make_detokenizer(request.prompt_token_ids),
            StopStringMatcher(request.sampling.stop),
        )

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def step(self) -> list[RequestOutput]:
        if self.governor is not None:
            self.governor.maybe_refresh()  # desktop mode: a clock read, memory read every few seconds
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        self.last_sched = sched  # what the step ran, for the slow-step log line
        started = time.perf_counter()
        try:
            step = self.runner.execute(sched, self._requests)
        except Exception as exc:  # a failure the runner could not pin on requests: the last resort
            log.exception("engine step failed")
            return self._fail_all(f"engine step failed: {exc}")
        self.last_execute_s = time.perf_counter() - started
        if step.failed_block_ids:
            self.prefix.discard_stores(step.failed_block_ids)
        outputs = [self._fail(rid, why) for rid, why in step.failed.items() if rid in self._requests]
        new: dict[str, list[int]] = {}  # a speculative step gives a request several tokens
        for rid, token in zip(step.request_ids, step.token_ids):
            new.setdefault(rid, []).append(token)
        before = {rid: r.num_output_tokens for rid in new if (r := self._requests.get(rid)) is not None}
        finished = {r.request_id for r in self.scheduler.update(new)}
        for rid in new:
            request = self._requests.get(rid)
            if request is None:
                continue
            # What the scheduler kept: EOS or max_tokens inside a speculative run cut the rest.
            tokens = request.output_token_ids[before[rid]:]
            if not tokens:
                continue
            try:
                out = self._make_output(request, tokens, rid in finished, before[rid])
            except Exception as exc:  # e.g. a detokenizer or parser error: this request only
                log.exception("output of request %s failed", rid)
                outputs.append(self._fail(rid, f"output failed: {exc}"))
                continue
            if rid in step.logprobs:
                out.logprobs = step.logprobs[rid][: len(out.new_token_ids)]
            outputs.append(out)
            if out.finished:
                self._forget(rid)
        return outputs

    def _fail(self, request_id: str, message: str) -> RequestOutput:
        request = self._requests[request_id]
        self.scheduler.fail(request_id)
        self._forget(request_id)
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens, error=message)

    def warmup(self, max_batch: int, prompt_len: int = 16) -> None:
        """Runs the decode batch through each size it can take (its buckets, else every size from 1
        to `max_batch`) and back, so the kernels a backend compiles per shape at first use (MLX's CUDA
        backend: seconds each) are compiled now and not while clients wait. Requests join so that
        the batch steps through the sizes; each stays until the largest size has run. Afterwards
        the buffers warm-up left in MLX's cache go back: they fit shapes traffic may never use."""
        import mlx.core as mx

        start = time.perf_counter()
        buckets = self.runner.buckets or list(range(1, max_batch + 1))
        sizes = [b for b in buckets if b <= max_batch]
        params = SamplingParams(max_tokens=len(sizes) + 2, temperature=0.0, ignore_eos=True)
        prompt = [i % 7 + 1 for i in range(prompt_len)]
        joined = 0
        for size in sizes:
            while joined < size:
                self.add_request(Request(f"warmup-{joined}", prompt, params))
                joined += 1
            self._warm_step()
        while self.has_work:
            self._warm_step()
        sized = time.perf_counter()
        self._warm_traffic(prompt_len)
        mx.synchronize()
        mx.clear_cache()
        log.info("warm-up over decode batch sizes %s took %.1f s (sizes %.1f s, then prompt shapes); MLX memory "
                 "after: %.2f GiB active, peak %.2f GiB", sizes if len(sizes) < 16 else f"1..{max_batch}",
                 time.perf_counter() - start, sized - start, mx.get_active_memory() / 2**30,
                 mx.get_peak_memory() / 2**30)
        mx.reset_peak_memory()

    def _warm_traffic(self, prompt_len: int) -> None:
        """The paths real traffic takes beyond batch sizes: several prompts of unequal lengths joining
        a decoding batch in one step, a prompt split over steps, prompt blocks stored from a lone row
        and from a padded batch, a prefix hit resuming mid-prompt: on MLX-CUDA the
        first burst of such joins after the size warm-up stalled for seconds (docs/BENCHMARKS.md)."""
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        block = self.config.block_size
        step_size = self.config.prefill_step_size
        longest = max(self.scheduler.max_model_len - 8, prompt_len)  # a small model's positions run out
        lengths = [min(n, longest) for n in
                   (block + 5, prompt_len, 2 * block + 17, step_size + 40, block // 2 + 3, 3 * block // 2)]
        self.add_request(Request("warmup-lone", [i % 5 + 1 for i in range(min(block + 9, longest))], params))
        self._warm_step()
        for i, n in enumerate(lengths):
            self.add_request(Request(f"warmup-burst-{i}", [(i + j) % 7 + 1 for j in range(n)], params))
        while self.has_work:
            self._warm_step()
        # The same prompts again: prefix hits resume mid-prompt (a chunk after restored blocks).
        for i, n in enumerate(lengths[:3]):
            self.add_request(Request(f"warmup-hit-{i}", [(i + j) % 7 + 1 for j in range(n)] + [9, 9], params))
        while self.has_work:
            self._warm_step()
        # Chat turns of similar length arriving together: as many as one forward prefills (rows of unequal
        # lengths above are not all taken together): on MLX-CUDA the first such forward after
        # warm-up took over a second (docs/BENCHMARKS.md).
        rows = min(self.config.max_num_prefill_rows, self.config.max_num_seqs)
        if rows > 1:
            n = min(block + 40, longest)
            for i in range(rows):
                # Ids 10-22, unlike the prompts above: no prefix hit makes one row longer than the rest.
                self.add_request(Request(f"warmup-wide-{i}", [(11 * i + j) % 13 + 10 for j in range(n - i)], params))
            while self.has_work:
                self._warm_step()
        if self.prefix is not None:
            # Warm-up's blocks are no one's prefix (an SSD tier may keep the few it wrote: no real
            # prompt is made of token ids 1-22 repeated).
            self.prefix.clear()
            self.prefix.reset_stats()

    def _warm_step(self) -> None:
        """One warm-up step; a slow one is logged with its work, so a long warm-up shows where it went
        (with an empty kernel cache an MLX-CUDA warm-up takes minutes: docs/BENCHMARKS.md)."""
        started = time.perf_counter()
        self.step()
        took = time.perf_counter() - started
        if took > 1.0:
            log.info("warm-up step took %.1f s: %s", took, self.describe_last_step())

    def describe_last_step(self) -> str:
        sched = self.last_sched
        if sched is None:
            return "nothing"
        return (f"prefill chunks {[c.num_tokens for c in sched.prefill_chunks]}, "
                f"{len(sched.decode_request_ids)} decoding in a batch of {self.runner.num_rows}, "
                f"{sum(len(ops) for ops in sched.store_ops.values())} blocks stored; the runner took "
                f"{self.last_execute_s:.2f} s, prefill {self.runner.last_prefill_s:.2f} s of it")

    def _make_output(self, request: Request, tokens: list[int], finished: bool, num_before: int) -> RequestOutput:
        state = self._text[request.request_id]
        text, hit = "", False
        for n, token in enumerate(tokens, 1):
            piece, hit = state.stop.feed(state.detok.add(token))
            text += piece
            if hit:
                break
        if hit and (not finished or n < len(tokens)):
            # A stop string ends the output at the token that completed it, even inside a speculative run.
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED, num_before + n)
            tokens, finished = tokens[:n], True
        elif finished and not hit:
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
            num_cached_tokens=request.num_cached_tokens,
        )

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
        # Rebuild the runner's state from scratch: its caches may be half-updated, and so may the
        # prefix cache's planned blocks, so that starts empty too.
        old = self.runner
        if self.spec is not None:
            self.spec.drop(list(self.spec.row_ids))
        self.runner = self.runner_cls(old.model, old.buckets, old.store, old.block_size, self.vision_cache,
                                      kv_prealloc_tokens=self.config.kv_prealloc_tokens, grammar=self.grammar,
                                      make_cache=old.make_cache, spec=self.spec,
                                      batch_prefill=self.config.max_num_prefill_rows > 1,
                                      logits_width=old.logits_width, lora=old.lora)
        self.scheduler.reset_after_failure()
        reseed_after_failure()
        return outputs

    def cache_stats(self) -> dict:
        vision = {"vision": self.vision_stats()} if self.vision_cache is not None else {}
        if self.prefix is None:
            return {"enabled": False, **vision}
        store = self.runner.store
        tiers = store.stats()  # blocks and snapshots per tier; snapshots count against the budget
        budget_bytes = self.prefix.max_cached_blocks * self._block_bytes + store.snapshots.max_bytes
        return {"enabled": True, **self.prefix.stats(), "memory_bytes": store.nbytes, "budget_bytes": budget_bytes,
                **tiers, **vision}

    def status(self) -> dict:
        """The budget in force (desktop mode: after pressure) next to the start-up one and live
        readings, for `GET /v1/status`."""

        from mlxserve.memory.device import read_memory

        def as_dict(budget):
            if budget is None:
                return None
            d = dataclasses.asdict(budget)
            d.pop("config", None)
            return d

        governor = self.governor
        return {
            "memory_mode": self.config.memory_mode,
            "budget": as_dict(governor.live if governor is not None else self.budget),
            "startup_budget": as_dict(self.budget),
            "pressure": governor.status() if governor is not None else None,
            "memory": dataclasses.asdict(read_memory()),
            "kv_capacity_tokens": self.scheduler.kv_capacity_tokens,
            "kv_bytes_per_token": self.probe.bytes_per_token,
            "kv_dtype": str(self.probe.dtype).rsplit(".", 1)[-1],
            "kv_quantization": self.kv_quant.status() if self.kv_quant is not None else None,
            "kv_prealloc_tokens": self.config.kv_prealloc_tokens,
            "num_running": self.scheduler.num_running,
            "structured_output": self.grammar.stats(),
            "num_waiting": self.scheduler.num_waiting,
            "prefix_cache": self.cache_stats(),
            "speculative": self.spec_stats(),
            "cudnn_attention": self.cudnn_attention,
        }

    def spec_stats(self) -> dict:
        """Speculative decoding's counters (mode "off" when it is not running)."""
        if self.spec is None:
            return {"mode": "off"}
        return {"mode": self.spec.mode, "num_draft_tokens": self.spec.max_k, "spec_max_batch": self.spec.max_batch,
                **self.spec.stats.as_dict()}

    def vision_stats(self) -> dict | None:
        if self.vision_cache is None:
            return None
        mm = self.runner.mm
        return {**self.vision_cache.stats(), "num_encoded": mm.num_encoded, "num_reused": mm.num_cache_hits}

    def clear_cache(self) -> int:
        """Both tiers (and the vision cache); blocks held by running requests stay until those finish."""
        from mlxserve.memory.release import give_back_memory

        if self.vision_cache is not None:
            self.vision_cache.clear()
        n = 0
        if self.prefix is not None:
            n = self.prefix.clear()
            n += self.runner.store.clear_ssd()  # both tiers, blocks and snapshots
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
