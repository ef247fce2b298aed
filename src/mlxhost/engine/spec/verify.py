"""Verifying drafts inside the decode batch, and rewinding the rows' KV past rejected drafts.

Every draft here is a point mass (prompt lookup copies tokens; a draft model proposes its argmax), so
the rejection rule of Leviathan et al. (2023) takes its simplest form. Row i was fed
`[last, d1 .. dK]`; position j's target distribution p_j (after top-p / top-k / min-p and temperature)
decides draft d_{j+1}:
  - greedy rows accept while d_{j+1} == argmax p_j: token for token what plain decoding emits;
  - sampled rows accept d_{j+1} with probability p_j(d_{j+1}); at the first rejection the row's next
    token is drawn from p_j with d_{j+1} removed and renormalized (max(0, p - q) for a point mass q),
    and after a fully accepted draft from p_K. Each emitted token then has exactly the distribution
    plain sampling gives it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.engine.request import SamplingParams
from mlxhost.engine.runner.sampling import apply_filters
from mlxhost.kv.kinds import KINDS


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
    Returns (accepted counts [b], each row's next token [b])."""
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


def rewind(cache: list[Any], num_drop: list[int]) -> None:
    """Drops the last `num_drop[i]` positions of row i from every layer of a batch KV cache.

    mlx-lm's `BatchKVCache.trim` drops the same count from every row; the rows that drop more are
    then shifted right by the rest through its own right-padding path (`prepare(right_padding=...)`
    and `finalize()`: the row rolls, its tail wraps into the left padding, which the mask hides)."""
    if not num_drop:
        return
    common = min(num_drop)
    rest = [n - common for n in num_drop]
    for c in cache:
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()


def can_rewind(cache: list[Any]) -> bool:
    """Whether every layer's kind can be rewound (kv/kinds): plain KV, a batch one or mlx-lm's `KVCache` of a
    lone row's lean path (its `trim` drops that row's tail). Sliding windows and recurrent state cannot: a
    rotating buffer overwrote what a rejected draft displaced, a state has no history."""
    return KINDS.can_rewind(cache)
