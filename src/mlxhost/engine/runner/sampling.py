"""Per-request sampling inside one batch, built from mlx-lm's public samplers and processors."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxhost.engine.request import SamplingParams, TokenLogprob

# OpenAI's presence/frequency penalties look at everything generated so far; mlx-lm's processors
# take a context window, so we pass one as large as any generation.
_WHOLE_GENERATION = 1 << 30


def _filter_key(sp: SamplingParams) -> tuple:
    # Greedy rows take one argmax whatever their filters.
    return ("greedy",) if sp.is_greedy else (sp.temperature, sp.top_p, sp.top_k, sp.min_p)


@dataclass
class RowSampler:
    """Sampling state of one request: its filters, processors, token history and RNG key."""

    params: SamplingParams
    prompt_processors: list  # logit bias, repetition penalty: look at prompt + generation
    output_processors: list  # presence/frequency penalties: generation only
    history: mx.array | None = None  # prompt + generated token ids (lazy), only when processors need it
    num_prompt: int = 0
    key: mx.array | None = None
    matcher: Any = None  # structured.matcher.RowMatcher of a constrained request (engine thread only)

    @classmethod
    def make(cls, params: SamplingParams, prompt_ids: list[int]) -> "RowSampler":
        prompt_processors = make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        )
        output_processors = make_logits_processors(
            presence_penalty=params.presence_penalty or None,
            presence_context_size=_WHOLE_GENERATION,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=_WHOLE_GENERATION,
        )
        history = None
        if prompt_processors or output_processors:
            history = mx.array(prompt_ids, dtype=mx.uint32)
        key = mx.random.key(params.seed) if params.seed is not None else None
        return cls(params, prompt_processors, output_processors, history, len(prompt_ids), key)

    @property
    def has_processors(self) -> bool:
        return self.history is not None

    def process(self, logits: mx.array) -> mx.array:
        for proc in self.prompt_processors:
            logits = proc(self.history, logits)
        if self.output_processors:
            generated = self.history[self.num_prompt :]
            for proc in self.output_processors:
                logits = proc(generated, logits)
        return logits

    def append(self, token: mx.array) -> None:
        if self.history is not None:
            self.history = mx.concatenate([self.history, token.astype(mx.uint32)])

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


def apply_filters(logprobs: mx.array, sp: SamplingParams) -> mx.array:
    """`sp`'s top-p, min-p and top-k (mlx-lm's filters), in the order sampling applies them."""
    if 0.0 < sp.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sp.top_p)
    if sp.min_p > 0.0:
        logprobs = apply_min_p(logprobs, sp.min_p)
    if sp.top_k > 0:
        logprobs = apply_top_k(logprobs, sp.top_k)
    return logprobs


def _sample_rows(logprobs: mx.array, sp: SamplingParams, key: mx.array | None) -> mx.array:
    if sp.is_greedy:
        return mx.argmax(logprobs, axis=-1)
    return mx.random.categorical(apply_filters(logprobs, sp) * (1.0 / sp.temperature), key=key)


def group_rows(rows: list[RowSampler], skip: frozenset[int] = frozenset()) -> list[list[int]]:
    """Rows (by index) that sample in one call: those sharing filter settings. A seeded row samples with its
    own key, so alone; rows in `skip` are left out. Plain and speculative steps group alike."""
    if len(rows) == 1 and not skip:
        return [[0]]
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if i not in skip:
            key = ("seed", i) if r.key is not None and not r.params.is_greedy else _filter_key(r.params)
            groups.setdefault(key, []).append(i)
    return list(groups.values())


def in_row_order(parts: list[mx.array], groups: list[list[int]]) -> mx.array:
    """Per-group results (`parts[g]` row for row with `groups[g]`) as one array in row order."""
    if len(parts) == 1:
        return parts[0]
    inverse = [0] * sum(map(len, groups))
    for pos, i in enumerate(i for idx in groups for i in idx):
        inverse[i] = pos
    return mx.concatenate(parts)[mx.array(inverse)]


def _rows(a: mx.array, idx: list[int]) -> mx.array:
    return a[mx.array(idx)] if len(idx) < a.shape[0] else a


def sample_batch(logits: mx.array, rows: list[RowSampler]) -> tuple[mx.array, mx.array]:
    """Samples one token per row of `logits` [B, V]; returns (tokens [B], logprobs [B, V]).

    Rows that share filter settings and need no processors or seed are sampled in one call: in the
    common case (every request greedy, or every request with the same temperature) the whole batch
    is one argmax or one categorical.
    """
    if any(r.has_processors for r in rows):
        logits = mx.concatenate(
            [r.process(logits[i : i + 1]) if r.has_processors else logits[i : i + 1] for i, r in enumerate(rows)]
        )
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    groups = group_rows(rows)
    if len(groups) == 1:  # the common case, kept to one call: every row greedy, or all alike
        tokens = _sample_rows(logprobs, rows[0].params, rows[0].next_key() if len(rows) == 1 else None)
    else:
        tokens = in_row_order([_sample_rows(_rows(logprobs, idx), rows[idx[0]].params,
                                            rows[idx[0]].next_key() if len(idx) == 1 else None) for idx in groups],
                              groups)
    for i, r in enumerate(rows):
        if r.has_processors:
            r.append(tokens[i : i + 1])
    return tokens, logprobs


def verify_batch(logits: mx.array, rows: list[RowSampler], drafts: mx.array,
                 num_draft: list[int]) -> tuple[mx.array, mx.array, mx.array]:
    """The speculative counterpart of `sample_batch`: `logits` [B, K+1, V] of rows fed `[last, d1 .. dK]`,
    `num_draft[i]` of them row i's own. Returns (accepted counts [B], each row's next token [B], the
    logprobs [B, K+1, V] its emitted tokens' entries come from). Rows with processors draft nothing: they
    sample their first position through `sample_batch`, as a plain step would."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    special = [i for i, r in enumerate(rows) if r.has_processors]
    groups = group_rows(rows, frozenset(special))
    accepted, final = [], []
    if special:
        tokens, first = sample_batch(logits[mx.array(special), 0, :], [rows[i] for i in special])
        accepted.append(mx.zeros((len(special),), dtype=mx.int32))
        final.append(tokens.astype(drafts.dtype))
        logprobs[mx.array(special), 0] = first
        groups = [special, *groups]
    num = mx.array(num_draft)
    for idx in groups[1 if special else 0 :]:
        r = rows[idx[0]]
        acc, fin = verify_group(_rows(logprobs, idx), _rows(drafts, idx), _rows(num, idx), r.params,
                                r.next_key() if len(idx) == 1 else None)
        accepted.append(acc.astype(mx.int32))
        final.append(fin.astype(drafts.dtype))
    return in_row_order(accepted, groups), in_row_order(final, groups), logprobs


def target_logprobs(logprobs: mx.array, sp: SamplingParams) -> mx.array:
    """The distribution plain sampling draws from for `sp` (filters, then temperature), as
    normalized log-probabilities [N, V]; `logprobs` [N, V] are the model's."""
    scaled = apply_filters(logprobs, sp) * (1.0 / sp.temperature)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def verify_group(
    logprobs: mx.array, drafts: mx.array, num_draft: mx.array, sp: SamplingParams, key: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Rows sharing sampling settings: `logprobs` [b, K+1, V] (the model's, normalized), `drafts`
    [b, K], `num_draft` [b] (positions past a row's own draft are padding and never accepted).
    Returns (accepted counts [b], each row's next token [b]).

    Every draft is a point mass (copied tokens, a draft's argmax), so the rejection rule of Leviathan et
    al. (2023) takes its simplest form: greedy rows accept while the draft is the argmax; sampled rows
    accept draft d with probability p(d), and at the first rejection draw from p with d removed (after a
    fully accepted draft, from p at position K). Each emitted token has the distribution plain sampling
    gives it."""
    b, t, v = logprobs.shape
    k = t - 1
    in_draft = mx.arange(k)[None, :] < num_draft[:, None]  # [b, K]
    if sp.is_greedy:
        best = mx.argmax(logprobs, axis=-1)  # [b, K+1]
        ok = (best[:, :k] == drafts) & in_draft
        accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
        return accepted, mx.take_along_axis(best, accepted[:, None], axis=1)[:, 0]
    keys = mx.random.split(key) if key is not None else (None, None)
    target = target_logprobs(logprobs.reshape(b * t, v), sp).reshape(b, t, v)
    p_draft = mx.exp(mx.take_along_axis(target[:, :k], drafts[..., None], axis=-1)[..., 0])  # [b, K]
    ok = (mx.random.uniform(shape=(b, k), key=keys[0]) < p_draft) & in_draft
    accepted = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1)
    # Where a draft token stood, the residual distribution: p without it, renormalized by categorical.
    # Past a row's draft (and at position K) nothing is removed: plain p.
    at = mx.take_along_axis(target, accepted[:, None, None], axis=1)[:, 0]  # [b, V]
    rejected = mx.take_along_axis(mx.pad(drafts, [(0, 0), (0, 1)]), accepted[:, None], axis=1)  # [b, 1]
    removed = (mx.arange(v)[None, :] == rejected) & (accepted < num_draft)[:, None]
    at = mx.where(removed, -float("inf"), at)
    return accepted, mx.random.categorical(at, key=keys[1])


def gather_logprobs(
    tokens: mx.array, logprobs: mx.array, top_k: int
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """The sampled tokens' logprobs and, when asked for, the top-k alternatives per row."""
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if top_k <= 0:
        return chosen, None, None
    top_ids = mx.argsort(-logprobs, axis=-1)[:, :top_k]
    top_vals = mx.take_along_axis(logprobs, top_ids, axis=-1)
    return chosen, top_ids, top_vals


def keep_logprobs(table: dict, rids: list, rows: list[RowSampler], tokens: mx.array, logprobs: mx.array) -> list:
    """Lazily, the logprobs of `tokens` [B] for the rows that asked: pending on each one's state
    (`table[rids[i]]`) until the token is fed and emitted. Returns the arrays made (to launch with the step's)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
    if not wanted:
        return []
    chosen, top_ids, top_vals = gather_logprobs(tokens, logprobs, max(rows[i].params.top_logprobs for i in wanted))
    made = []
    for i in wanted:
        pending = (chosen[i], (top_ids[i], top_vals[i]) if top_ids is not None else None)
        table[rids[i]].pending_logprob = pending
        made.extend(pending_arrays(pending))
    return made


def gather_emitted(logprobs: mx.array, drafts: mx.array, accepted: mx.array, final: mx.array, wanted: list[int],
                   k: int) -> tuple:
    """A speculative step's `wanted` rows: at every position 0..K the logprob of the token emitted there if
    that many drafts are accepted (the draft, or at the row's accepted count its next token), and the top
    `k` alternatives, flattened [len(wanted) * (K+1)]. Which positions count is read with the accepted counts."""
    t = drafts.shape[1] + 1
    at = mx.arange(t)[None, :] == accepted[:, None]
    emitted = mx.where(at, final[:, None], mx.pad(drafts, [(0, 0), (0, 1)]))  # [B, K+1]
    w = mx.array(wanted)
    lp = logprobs[w].reshape(len(wanted) * t, logprobs.shape[-1])
    return gather_logprobs(emitted[w].reshape(-1), lp, k)


# Positions scored at once: a slice's float32 temporaries are this many rows of the vocabulary, not a whole
# prefill chunk's (512 x 152k float32 logits alone are 300 MB; the memory profile counts one chunk's logits in
# the model's dtype). Each slice is evaluated before the next is built, so only one slice's are alive at once.
_SCORE_ROWS = 64


def score_positions(logits: mx.array, targets: list[int], k: int) -> tuple:
    """Each position's logprob of the token that follows it ([n, vocab] logits, n targets) and, with k > 0,
    its top k alternatives: (chosen [n], top ids [n, k] or None, their logprobs or None). Unlike
    `gather_logprobs` it takes raw logits, normalised a slice of rows at a time, never the whole log-softmax."""
    chosen, top_ids, top_vals = [], [], []
    for s in range(0, len(targets), _SCORE_ROWS):
        rows = logits[s : s + _SCORE_ROWS].astype(mx.float32)
        lse = mx.logsumexp(rows, axis=-1, keepdims=True)
        chosen.append(mx.take_along_axis(rows, mx.array(targets[s : s + _SCORE_ROWS])[:, None], axis=-1)[:, 0]
                      - lse[:, 0])
        if k > 0:
            ids = mx.argpartition(rows, -k, axis=-1)[:, -k:]
            vals = mx.take_along_axis(rows, ids, axis=-1)
            order = mx.argsort(-vals, axis=-1)  # best first, as the sampled tokens' alternatives are
            top_ids.append(mx.take_along_axis(ids, order, axis=-1))
            top_vals.append(mx.take_along_axis(vals, order, axis=-1) - lse)
        mx.eval(chosen[-1], *top_ids[-1:], *top_vals[-1:])
    if k <= 0:
        return mx.concatenate(chosen), None, None
    return mx.concatenate(chosen), mx.concatenate(top_ids), mx.concatenate(top_vals)


def prompt_entries(prompt: list[int], scores: list[tuple]) -> list[TokenLogprob]:
    """The prompt's logprob entries from its forwards' `score_positions`, in order (the first token's None)."""
    entries = [TokenLogprob(prompt[0], None)]
    for chosen, top_ids, top_vals in scores:
        values = chosen.tolist()
        ids = top_ids.tolist() if top_ids is not None else [[]] * len(values)
        vals = top_vals.tolist() if top_vals is not None else [[]] * len(values)
        for value, row_ids, row_vals in zip(values, ids, vals):
            entries.append(TokenLogprob(prompt[len(entries)], value, tuple(zip(row_ids, row_vals))))
    return entries


def to_logprob(token: int, pending: tuple, k: int) -> TokenLogprob:
    """A token's entry from its pending (chosen, (top ids, top logprobs)): arrays the device evaluated
    already (read whole: a slice would be a new op, queued behind the next forward), or the Python
    values a speculative step read back."""
    chosen, top = pending
    value = chosen if isinstance(chosen, float) else chosen.item()
    pairs = ()
    if top is not None and k:
        ids, vals = (t if isinstance(t, list) else t.tolist() for t in top)
        # Tokens a grammar masked out (-inf, not valid JSON) were never alternatives: fewer than k then.
        pairs = tuple((i, v) for i, v in zip(ids[:k], vals[:k]) if v != float("-inf"))
    return TokenLogprob(token, value, pairs)


def pending_arrays(pending: tuple) -> list[mx.array]:
    """The arrays of a pending (chosen, top) to evaluate (a speculative step leaves Python values)."""
    chosen, top = pending
    return [a for a in (chosen, *(top or ())) if isinstance(a, mx.array)]


def reseed_after_failure() -> None:
    """mlx-lm's samplers are mx.compile'd over mx.random.state; one that raised mid-trace leaves a
    placeholder array there and every later unseeded sample would fail. Start a fresh key."""
    mx.random.seed(time.time_ns() % 2**32)
