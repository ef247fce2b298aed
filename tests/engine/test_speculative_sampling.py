"""Sampled rows keep the target distribution under speculative decoding (chi-square tests).

Two levels: the verification rule itself on many rows at once (against the exact distribution plain
sampling uses, with a deliberately wrong rule shown to fail the same bound), and the whole engine with
a draft model (output prefixes over many requests against their exact probabilities)."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.sampling import target_logprobs, verify_group
from mlxhost.models.loader import load_model

_Z = 3.719  # one-sided normal quantile for p = 1e-4: a correct rule fails about once in 10,000 runs


def chi2_bound(df: int) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile at p = 1e-4."""
    return df * (1 - 2 / (9 * df) + _Z * math.sqrt(2 / (9 * df))) ** 3


def chi2_vs_exact(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5  # cells expected too rarely are pooled into one
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep] * n, probs[~keep].sum() * n)
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


# -- the rule, many rows at once ---------------------------------------------------------------------
V, N = 12, 60_000


def _setup(seed: int = 0):
    mx.random.seed(seed)
    logits = mx.random.normal((1, 3, V)) * 1.5
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sp = SamplingParams(max_tokens=8, temperature=0.8, top_k=8)
    # Drafts of every kind: the likeliest token, an unlikely one, one top_k filters out.
    order = np.argsort(-np.array(logprobs[0, 0]))
    choices = mx.array([int(order[0]), int(order[3]), int(order[-1])])
    drafts = mx.stack([choices[mx.random.randint(0, 3, (N,))], choices[mx.random.randint(0, 3, (N,))]], axis=1)
    return mx.broadcast_to(logprobs, (N, 3, V)), drafts, sp


def _target(logprobs, sp, position: int) -> np.ndarray:
    return np.exp(np.array(target_logprobs(logprobs[:1, position], sp)[0], dtype=np.float64))


def _first_two(accepted, final, drafts):
    """Each row's first two emitted tokens (the second only where the first was an accepted draft)."""
    acc, fin, d = np.array(accepted), np.array(final), np.array(drafts)
    first = np.where(acc >= 1, d[:, 0], fin)
    second = np.where(acc >= 2, d[:, 1], fin)[acc >= 1]
    return first, second


def test_rule_keeps_each_position_distribution():
    logprobs, drafts, sp = _setup()
    accepted, final = verify_group(logprobs, drafts, mx.full((N,), 2), sp)
    first, second = _first_two(accepted, final, drafts)
    for tokens, position in ((first, 0), (second, 1)):
        stat, df = chi2_vs_exact(np.bincount(tokens, minlength=V), _target(logprobs, sp, position))
        assert stat < chi2_bound(df), (position, stat, df)


def test_bound_catches_a_wrong_rule():
    """The same bound rejects a plausible bug: on rejection, sampling from p instead of the residual."""
    logprobs, drafts, sp = _setup()
    p0 = target_logprobs(logprobs[:, 0], sp)
    ok = mx.random.uniform(shape=(N,)) < mx.exp(mx.take_along_axis(p0, drafts[:, :1], axis=-1)[:, 0])
    first = np.array(mx.where(ok, drafts[:, 0], mx.random.categorical(p0)))
    stat, df = chi2_vs_exact(np.bincount(first, minlength=V), _target(logprobs, sp, 0))
    assert stat > chi2_bound(df)


def test_greedy_rule_accepts_exactly_the_argmax_prefix():
    logprobs = mx.log(mx.array([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]] * 3))
    drafts = mx.array([[1, 0], [1, 2], [2, 0]])
    accepted, final = verify_group(logprobs, drafts, mx.array([2, 2, 1]), SamplingParams(max_tokens=4, temperature=0))
    assert accepted.tolist() == [2, 1, 0]
    assert final.tolist() == [2, 0, 1]


# -- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def _exact(model, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """Plain sampling's probability of every output prefix of `depth` tokens (top_k keeps the tree small)."""
    probs = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in probs.items():
            logits = model(mx.array(prompt + list(prefix))[None])[:, -1, :]
            dist = np.exp(np.array(target_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)[0],
                                   dtype=np.float64))
            for t in np.nonzero(dist > 1e-12)[0]:
                nxt[prefix + (int(t),)] = p * dist[t]
        probs = nxt
    return probs


def test_engine_sampling_distribution_with_a_draft_model(loaded, qwen3_model_dir):
    """Output prefixes of sampled requests under speculation (the target drafting for itself, greedily,
    accepted part of the time) against the exact probabilities plain sampling gives them."""
    prompt, n = [11, 12, 13, 14, 15], 500
    mx.random.seed(1234)  # a fixed draw: the bound's 1-in-10,000 false alarm cannot make the suite flaky
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    config = EngineConfig(max_num_seqs=128, max_num_waiting=n, enable_prefix_cache=False, num_draft_tokens=3,
                          draft_model=str(qwen3_model_dir), spec_max_batch=128)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)
    for i in range(n):
        core.add_request(Request(f"r{i}", prompt, params))
    ids: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert 0.1 < core.spec_stats()["acceptance_rate"] < 0.95  # sampled rows reject greedy drafts at times
    # Token 0 comes from the prefill, tokens 1 and 2 from speculative steps: prefixes of 2 and 3 tokens.
    for depth in (2, 3):
        exact = _exact(loaded.model, prompt, params, depth)
        cells = sorted(exact)
        counts = Counter(tuple(v[:depth]) for v in ids.values())
        assert set(counts) <= set(cells)
        stat, df = chi2_vs_exact(np.array([counts[c] for c in cells]), np.array([exact[c] for c in cells]))
        assert stat < chi2_bound(df), (depth, stat, df)
