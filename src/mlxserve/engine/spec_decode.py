"""Speculative decode steps: every row of the batch drafts, all rows verify in one forward.

Row i is fed `[last, d1 .. dK]` (K: the longest draft this step; shorter drafts are padded and their
padding is never accepted), keeps its accepted prefix and one more token from the target, and its KV
is rewound past what it rejected (`speculative.rewind`). Emitted this step: `last` and the accepted
drafts, all of which the row's KV now holds (the invariant the prefix cache relies on); the extra
token is fed, and emitted, next step, as in plain decoding.

Rows that cannot speculate still ride in the same forward with no draft: constrained rows (the grammar
masks only the token after `last`: simplest sound choice, no draft tokens to check) and rows with
history-dependent processors (penalties, logit bias). With prompt lookup, a step where no row is
inside a span its history already holds (judged before waiting for `last`) returns False and the runner
decodes as usual, pipelined. Drafts are point masses (copied tokens, the draft model's argmax), also for
sampled rows: `speculative.verify_group` keeps their distribution exact.

A speculative step waits for its verification (the rewind needs the accepted counts), so it gives up
the overlap of scheduling with the device that plain steps have.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.engine.ngram import NgramIndex
from mlxserve.engine.request import Request, SamplingParams, TokenLogprob
from mlxserve.engine.sampling import gather_logprobs, sample_batch
from mlxserve.engine.speculative import can_rewind, rewind, verify_group

log = logging.getLogger(__name__)

_DRAFT_PREFILL_STEP = 512
_FILLER = SamplingParams(max_tokens=1, temperature=0.0)  # filler rows of a bucketed batch verify greedily


@dataclass
class SpecStats:
    num_steps: int = 0  # speculative forwards
    num_drafted: int = 0  # draft tokens proposed to the target (padding not counted)
    num_accepted: int = 0
    num_emitted: int = 0  # tokens emitted by speculative steps (accepted drafts and the fed token)

    def as_dict(self) -> dict:
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        return {**self.__dict__, "acceptance_rate": rate}


@dataclass
class _Row:
    k: int  # this row's draft length, adapted to its recent acceptance
    index: NgramIndex = field(default_factory=NgramIndex)


class SpeculativeDecoder:
    """Per-row draft state and the speculative step. `draft_model` None: prompt lookup (n-grams)."""

    def __init__(self, num_draft_tokens: int, draft_model: Any = None, vocab_width: int = 0) -> None:
        self.max_k = num_draft_tokens
        self.draft_model = draft_model
        self.vocab_width = vocab_width
        self.stats = SpecStats()
        self._rows: dict[str, _Row] = {}

    @property
    def row_ids(self) -> list[str]:
        return list(self._rows)

    @property
    def mode(self) -> str:
        return "draft" if self.draft_model is not None else "ngram"

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)

    def prefill_draft(self, prompt: list[int]) -> list[Any]:
        """The draft model's cache over the prompt but its last token (it has no prefix cache of its
        own). The draft's cache always stops one token short of the row's last emitted token: each
        step feeds that token and the pending one together (see `_draft`)."""
        cache = make_prompt_cache(self.draft_model)
        for start in range(0, len(prompt) - 1, _DRAFT_PREFILL_STEP):
            self.draft_model(mx.array(prompt[start : min(start + _DRAFT_PREFILL_STEP, len(prompt) - 1)])[None],
                             cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    # -- the step ------------------------------------------------------------------------------
    def step(self, runner: Any, requests: dict[str, Request], out: Any) -> bool:
        batch = runner._batch
        if not can_rewind(batch.cache):
            return False
        rids = list(batch.row_ids)
        last = batch.tokens
        samplers = [runner._samplers[rid] if rid is not None else None for rid in rids]
        special = [i for i, s in enumerate(samplers) if s is not None and (s.matcher is not None or s.has_processors)]
        plain = [i for i, s in enumerate(samplers) if s is not None and i not in special]
        rows = {i: self._row(rids[i], requests[rids[i]]) for i in plain}
        if self.draft_model is None and not any(r.index.propose(1) for r in rows.values()):
            # No row is inside a span its history already holds (judged without `last`, which is still
            # being computed): decode plainly, pipelined, instead of waiting for `last` here.
            return False
        last_ids = last.tolist()
        lengths = [0] * len(rids)
        ngram_drafts: dict[int, list[int]] = {}
        for i, row in rows.items():
            request = requests[rids[i]]
            # Emitted this step: `last` and the accepted drafts; max_tokens bounds how many can count.
            k = max(0, min(row.k, request.sampling.max_tokens - request.num_output_tokens - 1))
            if self.draft_model is None:
                row.index.extend([last_ids[i]])
                ngram_drafts[i] = row.index.propose(k)
                lengths[i] = len(ngram_drafts[i])
            else:
                lengths[i] = k
        num_k = max(lengths, default=0)
        if self.draft_model is None and num_k == 0:
            return False
        if self.draft_model is not None:
            num_k = max(num_k, 1)  # the draft cache's bookkeeping assumes one draft position at least

        # Drafts and the fed tokens [B, K+1].
        if self.draft_model is None:
            fed = mx.array([[t, *ngram_drafts.get(i, ()), *[0] * (num_k - len(ngram_drafts.get(i, ())))]
                            for i, t in enumerate(last_ids)], dtype=last.dtype)
        else:
            prev = [_last_emitted(requests[rid]) if rid is not None else 0 for rid in rids]
            fed = self._draft(mx.array(prev, dtype=last.dtype), last, num_k, batch.draft_cache)
        drafts = fed[:, 1:]
        if batch.positions is not None:  # vision-language models: each row's positions carry its rope delta
            logits = runner.model(fed, cache=batch.cache, positions=batch.positions[:, None] + mx.arange(num_k + 1))
        else:
            logits = runner.model(fed, cache=batch.cache)

        # Rows without a draft that need their own treatment take the first position's logits.
        accepted_parts, final_parts, order = [], [], []
        lp_special = None
        if special:
            first = logits[mx.array(special), 0, :]
            constrained = [(j, samplers[i].matcher) for j, i in enumerate(special) if samplers[i].matcher is not None]
            if constrained:
                fed_ids = [last_ids[i] for i in special]
                rejected = runner.grammar.advance(constrained, fed_ids)
                for j in rejected:
                    out.failed[rids[special[j]]] = f"the grammar rejected token {fed_ids[j]}"
                first = runner.grammar.mask(first, [c for c in constrained if c[0] not in rejected])
            tokens, lp_special = sample_batch(first, [samplers[i] for i in special])
            accepted_parts.append(mx.zeros((len(special),), dtype=mx.int32))
            final_parts.append(tokens)
            order.extend(special)

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        num_draft = mx.array(lengths)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(samplers):
            if i in special:
                continue
            if s is None or s.params.is_greedy:
                groups.setdefault(("greedy",), []).append(i)
            elif s.key is not None:
                groups[("seed", i)] = [i]
            else:
                groups.setdefault((s.params.temperature, s.params.top_p, s.params.top_k, s.params.min_p), []).append(i)
        for idx in groups.values():
            sel = mx.array(idx) if len(idx) < len(rids) else None
            pick = (lambda a: a[sel]) if sel is not None else (lambda a: a)
            s = samplers[idx[0]]
            params = s.params if s is not None else _FILLER
            acc, fin = verify_group(pick(logprobs), pick(drafts), pick(num_draft), params,
                                    s.next_key() if s is not None and len(idx) == 1 else None)
            accepted_parts.append(acc.astype(mx.int32))
            final_parts.append(fin.astype(last.dtype))
            order.extend(idx)
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        inv = mx.array(inverse)
        accepted = mx.concatenate(accepted_parts)[inv]
        final = mx.concatenate([f.astype(last.dtype) for f in final_parts])[inv]
        mx.eval(accepted, final, drafts)
        accepted_ids, draft_ids = accepted.tolist(), drafts.tolist()

        # Rewind every row past what it rejected (fillers and rows without a draft: all K).
        num_drop = [num_k - a for a in accepted_ids]
        rewind(batch.cache, num_drop)
        if batch.draft_cache is not None:
            rewind(batch.draft_cache, num_drop)
        batch.tokens = final
        if batch.positions is not None:
            batch.positions = batch.positions + 1 + accepted

        self._emit(runner, rids, last_ids, draft_ids, accepted_ids, logprobs, final, out)
        if special and lp_special is not None:
            runner._keep_logprobs([rids[i] for i in special], [samplers[i] for i in special],
                                  final[mx.array(special)], lp_special)
        self._adapt(rids, plain, lengths, accepted_ids)
        return True

    def _row(self, rid: str, request: Request) -> _Row:
        """The row's state; with prompt lookup its index brought up to the request's known tokens."""
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = _Row(self.max_k)
        if self.draft_model is None:
            known = len(row.index.tokens) - request.num_prompt_tokens
            if known < 0 or known > request.num_output_tokens:
                row.index = NgramIndex()
                row.index.extend(request.prompt_token_ids)
                known = 0
            row.index.extend(request.output_token_ids[known:])
        return row

    def _draft(self, prev: mx.array, last: mx.array, num_k: int, cache: list[Any]) -> mx.array:
        """The draft model's greedy continuation [B, 1 + K] of `last`, in K forwards: the first feeds the
        row's last emitted token `prev` and `last` together, the others d1 .. d(K-1). Its cache thus
        grows by K + 1 positions, like the target's, and keeps `accepted + 1` of them (everything up to
        the row's new last emitted token, which the next step feeds again): the same rewind."""
        tokens, x = [last], mx.stack([prev, last], axis=1)
        for _ in range(num_k):
            logits = self.draft_model(x, cache=cache)
            nxt = mx.argmax(logits[:, -1, : self.vocab_width or None], axis=-1).astype(last.dtype)
            tokens.append(nxt)
            x = nxt[:, None]
        return mx.stack(tokens, axis=1)

    def _emit(self, runner, rids, last_ids, draft_ids, accepted_ids, logprobs, final, out) -> None:
        pending = runner._pending_lp
        stats = self.stats
        stats.num_steps += 1
        wanted = []
        for i, rid in enumerate(rids):
            if rid is None:
                continue
            a = accepted_ids[i]
            fed_lp = pending.pop(rid, None)
            if rid in out.failed:
                continue
            tokens = [last_ids[i], *draft_ids[i][:a]]
            out.request_ids.extend([rid] * len(tokens))
            out.token_ids.extend(tokens)
            stats.num_emitted += len(tokens)
            params = runner._samplers[rid].params
            if params.logprobs:
                wanted.append((i, rid, a, fed_lp, params.top_logprobs))
        for i, rid, a, fed_lp, k in wanted:
            # Accepted drafts: drawn at positions 0..a-1; the next token (fed next step) at position a.
            row_tokens = mx.array([*draft_ids[i][:a], 0])
            row_tokens[a] = final[i]
            chosen, top_ids, top_vals = gather_logprobs(row_tokens, logprobs[i, : a + 1], k)
            lps = []
            if fed_lp is not None:
                lps.append(_to_logprob(last_ids[i], fed_lp, k))
            chosen_l = chosen.tolist()
            for j in range(a):
                top = (top_ids[j], top_vals[j]) if top_ids is not None else None
                lps.append(_to_logprob(draft_ids[i][j], (chosen_l[j], top), k))
            out.logprobs[rid] = lps
            pending[rid] = (chosen[a], (top_ids[a], top_vals[a]) if top_ids is not None else None)

    def _adapt(self, rids, plain, lengths, accepted_ids) -> None:
        stats = self.stats
        for i in plain:
            n, a = lengths[i], accepted_ids[i]
            if n == 0:
                continue
            stats.num_drafted += n
            stats.num_accepted += a
            row = self._rows[rids[i]]
            # Grow after a fully accepted draft, shrink to just past what was accepted otherwise.
            row.k = min(self.max_k, row.k + 1) if a == n else max(1, a + 1)


def _last_emitted(request: Request) -> int:
    return request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]


def _to_logprob(token: int, pending: tuple, k: int) -> TokenLogprob:
    chosen, top = pending
    value = chosen if isinstance(chosen, float) else chosen.item()
    pairs = tuple(zip(top[0][:k].tolist(), top[1][:k].tolist())) if top is not None and k else ()
    return TokenLogprob(token, value, pairs)

