"""All MLX work of a step: chunked prefill, the batched decode forward and sampling.

The runner keeps one decode batch: mlx-lm batch caches (one per layer) whose rows are the running
requests, and `tokens`, the last sampled token of each row, still lazy. A step launches the next
decode on those lazy tokens with `mx.async_eval` and only then reads them back, so Python's
bookkeeping for step N overlaps the device computing step N+1 (the pipelining mlx-lm's
`generate_step` uses). A request that finished at step N therefore costs one wasted row in step N+1,
which is dropped at the start of the step after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.engine.request import Request, TokenLogprob
from mlxserve.engine.sampling import RowSampler, gather_logprobs, sample_batch
from mlxserve.engine.scheduler import SchedulerOutput


@dataclass
class StepTokens:
    """Tokens that became known this step, one per decoding row, in row order."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)


def _merge_caches(caches: list[list[Any]]) -> list[Any]:
    """Per-request caches (batch 1) -> one batch cache per layer, through mlx-lm's `merge`."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


class ModelRunner:
    def __init__(self, model: Any) -> None:
        self.model = model
        self._prefill_caches: dict[str, list[Any]] = {}
        self._samplers: dict[str, RowSampler] = {}
        # The decode batch.
        self._row_ids: list[str] = []
        self._cache: list[Any] = []
        self._tokens: mx.array | None = None  # [B] lazy: sampled, not yet fed to the model
        self._chosen_lp: mx.array | None = None  # [B] logprob of each sampled token
        self._top: tuple[mx.array, mx.array] | None = None  # [B, k] ids and logprobs
        self._want_logprobs = False

    @property
    def num_rows(self) -> int:
        return len(self._row_ids)

    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepTokens:
        self._drop(sched.finished_request_ids)
        for chunk in sched.prefill_chunks:
            self._prefill(chunk, requests[chunk.request_id])
        return self._decode()

    # -- batch membership ----------------------------------------------------------------------
    def _drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._prefill_caches.pop(rid, None)
            self._samplers.pop(rid, None)
        gone = set(request_ids) & set(self._row_ids)
        if not gone:
            return
        keep = [i for i, rid in enumerate(self._row_ids) if rid not in gone]
        self._row_ids = [self._row_ids[i] for i in keep]
        if not keep:
            self._cache, self._tokens, self._chosen_lp, self._top = [], None, None, None
            return
        idx = mx.array(keep)
        for c in self._cache:
            c.filter(idx)
        self._tokens = self._tokens[idx]
        if self._chosen_lp is not None:
            self._chosen_lp = self._chosen_lp[idx]
        if self._top is not None:
            self._top = (self._top[0][idx], self._top[1][idx])

    def _join(self, request_id: str, cache: list[Any], token: mx.array, lp, top) -> None:
        new = _merge_caches([cache])
        if self._cache:
            for c, n in zip(self._cache, new):
                c.extend(n)
        else:
            self._cache = new
        self._row_ids.append(request_id)
        self._tokens = token if self._tokens is None else mx.concatenate([self._tokens, token])
        if self._want_logprobs or lp is not None:
            self._append_logprobs(lp, top, token)

    def _append_logprobs(self, lp, top, token) -> None:
        # Rows that did not ask for logprobs carry zeros so every row keeps its position.
        n_old = len(self._row_ids) - 1
        old_lp = self._chosen_lp if self._chosen_lp is not None else mx.zeros((n_old,))
        self._chosen_lp = mx.concatenate([old_lp, lp if lp is not None else mx.zeros((1,))])
        self._want_logprobs = True
        if top is None and self._top is None:
            return
        k_old = self._top[0].shape[1] if self._top is not None else 0
        k = max(k_old, top[0].shape[1] if top is not None else 0)

        def pad(ids, vals, rows):
            if ids is None:
                return mx.zeros((rows, k), dtype=mx.uint32), mx.full((rows, k), -mx.inf)
            extra = k - ids.shape[1]
            if extra:
                ids = mx.concatenate([ids, mx.zeros((rows, extra), dtype=ids.dtype)], axis=1)
                vals = mx.concatenate([vals, mx.full((rows, extra), -mx.inf)], axis=1)
            return ids.astype(mx.uint32), vals

        old = pad(*(self._top or (None, None)), n_old)
        new = pad(*(top or (None, None)), 1)
        self._top = (mx.concatenate([old[0], new[0]]), mx.concatenate([old[1], new[1]]))

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, chunk, request: Request) -> None:
        rid = request.request_id
        cache = self._prefill_caches.get(rid)
        if cache is None:
            cache = make_prompt_cache(self.model)
            self._prefill_caches[rid] = cache
            self._samplers[rid] = RowSampler.make(request.sampling, request.prompt_token_ids)
        ids = request.prompt_token_ids[chunk.start : chunk.start + chunk.num_tokens]
        if not chunk.is_last:
            self.model(mx.array(ids)[None], cache=cache)
            # Bound the lazy graph: a chunk is evaluated before the next is built. Only the cache is
            # evaluated, so the LM head never runs on these positions.
            mx.eval([c.state for c in cache])
            return
        if len(ids) > 1:
            # Same reason: the last position alone gets logits (what mlx-lm's generate_step does).
            self.model(mx.array(ids[:-1])[None], cache=cache)
        logits = self.model(mx.array(ids[-1:])[None], cache=cache)
        del self._prefill_caches[rid]
        sampler = self._samplers[rid]
        tokens, logprobs = sample_batch(logits[:, -1, :], [sampler])
        lp, top = self._logprobs_for([sampler], tokens, logprobs)
        self._join(rid, cache, tokens, lp, top)

    # -- decode --------------------------------------------------------------------------------
    def _logprobs_for(self, rows: list[RowSampler], tokens, logprobs):
        if not any(r.params.logprobs for r in rows):
            return None, None
        k = max(r.params.top_logprobs for r in rows)
        chosen, top_ids, top_vals = gather_logprobs(tokens, logprobs, k)
        return chosen, (top_ids, top_vals) if top_ids is not None else None

    def _decode(self) -> StepTokens:
        if not self._row_ids:
            return StepTokens()
        fed = self._tokens
        fed_lp, fed_top = self._chosen_lp, self._top
        rows = [self._samplers[rid] for rid in self._row_ids]

        logits = self.model(fed[:, None], cache=self._cache)
        nxt, logprobs = sample_batch(logits[:, -1, :], rows)
        lp, top = self._logprobs_for(rows, nxt, logprobs)
        self._tokens, self._chosen_lp, self._top = nxt, lp, top
        self._want_logprobs = lp is not None
        mx.async_eval(nxt, *(a for a in (lp, *(top or ())) if a is not None))

        out = StepTokens(list(self._row_ids), fed.tolist())
        if fed_lp is not None:
            self._collect_logprobs(out, rows, fed_lp, fed_top)
        return out

    @staticmethod
    def _collect_logprobs(out: StepTokens, rows, fed_lp, fed_top) -> None:
        lps = fed_lp.tolist()
        top_ids = fed_top[0].tolist() if fed_top is not None else None
        top_vals = fed_top[1].tolist() if fed_top is not None else None
        for i, (rid, r) in enumerate(zip(out.request_ids, rows)):
            if not r.params.logprobs:
                continue
            k = r.params.top_logprobs
            top = tuple(zip(top_ids[i][:k], top_vals[i][:k])) if top_ids is not None and k else ()
            out.logprobs[rid] = TokenLogprob(out.token_ids[i], lps[i], top)
