"""The prefill half of the runner: a prompt's chunks, alone or several prompts in one forward.

A request's first chunk makes its `RowState` (its caches, sampler, captures, multimodal plan); its
last chunk samples its first token and hands its caches to the decode batch. A prefill that raises
fails its own request only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import mlx.core as mx

from mlxhost.engine.grammar import GrammarSource
from mlxhost.engine.request import Request
from mlxhost.engine.runner.batch_prefill import pick_rows, prefill_rows
from mlxhost.engine.runner.capture import capture, captured_arrays, start_captures
from mlxhost.engine.runner.mm_prefill import MultimodalPrefill
from mlxhost.engine.runner.sampling import (
    RowSampler,
    keep_logprobs,
    prompt_entries,
    reseed_after_failure,
    sample_batch,
    score_positions,
)
from mlxhost.engine.runner.state import RowState, RowTable
from mlxhost.engine.scheduler import PrefillChunk
from mlxhost.kv.store.kv_store import KVBlockStore
from mlxhost.lora.manager import AdapterSet

log = logging.getLogger(__name__)

# A finished prompt: its request id, its caches, its first token (lazy).
Joined = tuple[str, list[Any], mx.array]


class Prefiller:
    """Runs a step's prefill chunks. The runner owns it and hands it the row table it starts rows in; the
    rest it is given (model, caches' factory, block store, grammar, adapters, multimodal prefill) it only
    calls. How prompts are prefilled (together or alone, the last chunk in one forward or two, the first
    pass's padding) is its own state."""

    def __init__(self, model: Any, rows: RowTable, *, make_cache: Callable[[Any], list[Any]],
                 store: KVBlockStore | None, block_size: int, grammar: GrammarSource | None, lora: AdapterSet,
                 mm: MultimodalPrefill | None, batch_prefill: bool, logits_width: int, one_forward_logits: int,
                 pad_to: int) -> None:
        self.model = model
        self.rows = rows
        self.make_cache = make_cache
        self.store = store
        self.block_size = block_size
        self.grammar = grammar
        self.lora = lora
        self.mm = mm
        self.batch_prefill = batch_prefill  # prompts prefilled together where the model's caches take padding
        self.logits_width = logits_width  # the LM head's width (vocab); 0: unknown, taken as 1M
        # A last chunk whose logits (tokens x vocab) stay under this runs as one forward (model_runner.py).
        self.one_forward_logits = one_forward_logits
        self.pad_to = pad_to  # batched prefill's first pass padded to a multiple of this many tokens
        self._decoding = False  # rows decode this step: chunks' graphs are launched, not waited for

    def run(self, chunks: list[PrefillChunk], requests: dict[str, Request], out: Any, decoding: bool) -> list[Joined]:
        """This step's chunks; returns the prompts they finished, in the order they finished. `decoding`:
        rows of the decode batch run this step too (their read-back bounds the prefill's work)."""
        self._decoding = decoding
        together = [c for c in chunks if self._can_prefill_together(requests[c.request_id])]
        together = [together[i] for i in pick_rows([c.start + c.num_tokens for c in together])]
        joined = []
        for chunk in chunks:
            done = None if chunk in together else self._prefill_or_fail(chunk, requests[chunk.request_id], out)
            if done is not None:
                joined.append(done)
        if together:
            joined.extend(self._prefill_together(together, requests, out))
        return joined

    def take_prompt_scores(self, joined: list[Joined], requests: dict[str, Request], out: Any) -> list[Joined]:
        """Scored prompts that finished: their entries read back now (a scoring request waits for its
        prompt's forwards here; no other request asks for it). One whose read-back fails (its last forward
        runs here) fails alone and does not join. Returns the prompts that join."""
        kept = []
        for done in joined:
            rid = done[0]
            row = self.rows[rid]
            if row.prompt_scores is not None:
                try:
                    out.prompt_logprobs[rid] = prompt_entries(requests[rid].prompt_token_ids, row.prompt_scores)
                except Exception as exc:
                    self._fail_prefill(rid, exc, out)
                    continue
                row.prompt_scores = None
            kept.append(done)
        return kept

    def _begin_prefill(self, request: Request) -> list:
        """The request's prefill cache, made (and its row state set up) at its first chunk."""
        rid = request.request_id
        row = self.rows.get(rid)
        if row is None:
            self.lora.check(request.adapter)
            cache = self.make_cache(self.model)
            if request.cached_block_ids:
                # Timed on its own (a synced restore) only where it delays nothing: no rows decoding.
                self.store.make_cache(request.cached_block_ids, cache, sync=not self._decoding)
            sampler = RowSampler.make(request.sampling, request.prompt_token_ids)
            if request.sampling.constraint is not None:
                sampler.matcher = self.grammar.compiler.compile(request.sampling.constraint)
            row = RowState(rid, sampler, prefill_cache=cache)
            if request.sampling.prompt_logprobs is not None:
                row.prompt_scores = []
            start_captures(row, request, self.store, self.block_size)
            if request.media:
                row.media, row.position_delta = self.mm.start(request)
            self.rows[rid] = row
        return row.prefill_cache

    def _prefill(self, chunk: PrefillChunk, request: Request):
        rid = request.request_id
        cache = self._begin_prefill(request)
        row = self.rows[rid]
        if request.media:
            def forward(start: int, end: int):
                return self.mm.forward(request, row.media, start, end, cache)
        else:
            def forward(start: int, end: int):
                return self.model(mx.array(request.prefill_token_ids[start:end])[None], cache=cache)
        scoring = row.prompt_scores is not None
        if row.captured is not None:
            model_forward = forward

            def forward(start: int, end: int):
                # Stop at the snapshot boundary if it falls inside, so the state there can be copied.
                at = row.snap_at
                head = None
                if at is not None and start < at < end:
                    head = model_forward(start, at)
                    capture(row, cache, start, at, request.num_cached_tokens, self.store, self.block_size)
                    start = at
                out = model_forward(start, end)
                capture(row, cache, start, end, request.num_cached_tokens, self.store, self.block_size)
                # Logits left unused are never computed: only a scored prompt reads the head's.
                return mx.concatenate([head, out], axis=1) if scoring and head is not None else out
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if not chunk.is_last:
            logits = forward(start, end)
            # Bound the lazy graph: a chunk is evaluated before the next is built. Only the cache is
            # evaluated (and a scored prompt's logprobs), so the LM head runs on these positions for those only.
            self._bound([c.state for c in cache], captured_arrays(row),
                        self._score(row, request, logits, start, end) if scoring else [])
            return None
        if not scoring and end - start > 1 and (end - start) * (self.logits_width or 1 << 20) > self.one_forward_logits:
            # Same reason: the last position alone gets logits (what mlx-lm's generate_step does).
            forward(start, end - 1)
            start = end - 1
        logits = forward(start, end)
        if scoring:
            self._score(row, request, logits, start, end)
        return self._first_token(rid, cache, logits[:, -1, :])

    @staticmethod
    def _score(row: RowState, request: Request, logits: mx.array, start: int, end: int) -> list:
        """A scored prompt's logprobs of positions [start, end): each position's of the prompt token after
        it (the last prompt position's logits give the first output token instead). Kept on the row, lazily."""
        targets = request.prompt_token_ids[start + 1 : end + 1]
        if not targets:  # a last chunk of the last prompt token alone
            return []
        scores = score_positions(logits[0, : len(targets)], targets, request.sampling.prompt_logprobs)
        row.prompt_scores.append(scores)
        return [a for a in scores if a is not None]

    def _first_token(self, rid: str, cache: list, logits: mx.array):
        """Samples a finished prompt's first token from its last position's logits [1, vocab]."""
        row = self.rows[rid]
        row.prefill_cache = row.snap_at = row.media = None
        sampler = row.sampler
        if sampler.matcher is not None:
            logits = self.grammar.mask(logits, [(0, sampler.matcher)])
        tokens, logprobs = sample_batch(logits, [sampler])
        keep_logprobs(self.rows, [rid], [sampler], tokens, logprobs)
        return rid, cache, tokens

    def _can_prefill_together(self, request: Request) -> bool:
        # A request whose prefill captures prefix-cache data (sliding windows, recurrent snapshots) runs
        # its own forwards (`capture` reads batch-1 caches); those families never batch anyway.
        row = self.rows.get(request.request_id)
        return (self.batch_prefill and not request.media and request.sampling.prompt_logprobs is None
                and (row is None or row.captured is None))

    def _prefill_together(self, chunks: list[PrefillChunk], requests: dict[str, Request], out):
        """Several requests' chunks in one forward (batch_prefill.py). Returns the prompts it finished, as
        `_prefill` does; a request whose prefill fails, fails alone."""
        rows = []
        for chunk in chunks:
            try:
                rows.append((chunk, self._begin_prefill(requests[chunk.request_id])))
            except Exception as exc:  # e.g. a grammar that does not compile: this request only
                self._fail_prefill(chunk.request_id, exc, out)
        if not rows:
            return []
        try:
            with self.lora.rows([requests[c.request_id].adapter for c, _ in rows]):
                logits, grown = prefill_rows(self.model, [cache for _, cache in rows], [
                    requests[c.request_id].prefill_token_ids[c.start : c.start + c.num_tokens] for c, _ in rows],
                    bound=self._bound, pad_to=self.pad_to, joining=[c.is_last for c, _ in rows])
            going_on = [layers for (c, _), layers in zip(rows, grown) if not c.is_last]
            if going_on:  # bound the lazy graph, as `_prefill` does between chunks
                self._bound([c.state for layers in going_on for c in layers])
        except Exception:
            # The rows' own caches are untouched: run them one by one, so a request that cannot be
            # prefilled fails alone.
            log.warning("batched prefill of requests %s failed; prefilling them one at a time",
                        ", ".join(c.request_id for c, _ in rows), exc_info=True)
            reseed_after_failure()
            grown = None
        joined = []
        for i, (chunk, cache) in enumerate(rows):
            if grown is None:
                done = self._prefill_or_fail(chunk, requests[chunk.request_id], out)
            elif chunk.is_last:
                cache[:] = grown[i]
                try:
                    done = self._first_token(chunk.request_id, cache, logits[i : i + 1])
                except Exception as exc:
                    done = self._fail_prefill(chunk.request_id, exc, out)
            else:
                cache[:], done = grown[i], None
            if done is not None:
                joined.append(done)
        return joined

    def _bound(self, *arrays) -> None:
        """Ends a lazy graph at `arrays` (a prefill chunk's caches). While rows decode, the arrays are only
        launched: the decode's read-back at the end of the step waits for them anyway, and waiting here
        would leave the device idle while the host builds the rest of the step (the join, the decode
        graph). With no decode rows nothing else would bound the work queued, so it is waited for."""
        if self._decoding:
            mx.async_eval(*arrays)
        else:
            mx.eval(*arrays)

    def _prefill_or_fail(self, chunk: PrefillChunk, request: Request, out):
        """`_prefill`; if it raises, only this request fails."""
        try:
            with self.lora.rows([request.adapter]):
                return self._prefill(chunk, request)
        except Exception as exc:
            return self._fail_prefill(chunk.request_id, exc, out)

    def _fail_prefill(self, rid: str, exc: Exception, out) -> None:
        log.error("prefill of request %s failed", rid, exc_info=exc)
        out.failed[rid] = f"prefill failed: {exc}"
        self.rows.free([rid])  # all it has: a prompt that has not joined holds no row of the decode batch
        reseed_after_failure()

