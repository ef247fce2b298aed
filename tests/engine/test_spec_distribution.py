"""Slow lane: sampled rows keep plain sampling's distribution under the proposers that
test_speculative_sampling.py (draft model) and test_spec_heads.py (EAGLE-3, MTP) do not cover: prompt
lookup, the oracle and DFlash. Output prefixes of many requests against the exact probabilities plain
sampling gives them (a chi-square bound with a 1-in-10,000 false alarm, on a fixed seed)."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from tests.engine.test_speculative_sampling import _exact, chi2_bound, chi2_vs_exact

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def _top(model, prompt: list[int], k: int) -> list[int]:
    return [int(t) for t in np.argsort(-np.array(model(mx.array(prompt)[None])[0, -1]))[:k]]


@pytest.fixture(scope="module")
def lookup_prompt(loaded) -> list[int]:
    """A prompt of triples (s, t, the target's argmax after t) for every token t the first sample can take,
    ending in s: prompt lookup drafts on every row, and the draft is the target's likeliest next token
    (a random model never repeats its context on its own). Grown until the first token's top-k is covered."""
    s, seen, prompt = 11, [], [11]
    for _ in range(30):
        seen += [t for t in _top(loaded.model, prompt, PARAMS.top_k) if t not in seen]
        prompt = [x for t in seen for x in (s, t, _top(loaded.model, prompt + [t], 1)[0])] + [s]
        if set(_top(loaded.model, prompt, PARAMS.top_k)) <= set(seen):
            return prompt
    raise AssertionError("no covering prompt")


def sample_many(loaded, prompt: list[int], n: int, seed: int, **spec) -> tuple[dict[str, list[int]], dict]:
    mx.random.seed(seed)  # a fixed draw: the bound's false alarm cannot make the suite flaky
    config = EngineConfig(max_num_seqs=128, max_num_waiting=n, enable_prefix_cache=False, num_draft_tokens=3,
                          spec_max_batch=128, **spec)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)
    for i in range(n):
        core.add_request(Request(f"r{i}", prompt, PARAMS))
    ids: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    return ids, core.spec_stats()


def assert_plain_distribution(loaded, prompt: list[int], ids: dict[str, list[int]], depths=(2, 3)) -> None:
    for depth in depths:
        exact = _exact(loaded.model, prompt, PARAMS, depth)
        cells = sorted(exact)
        counts = Counter(tuple(v[:depth]) for v in ids.values())
        assert set(counts) <= set(cells)
        stat, df = chi2_vs_exact(np.array([counts[c] for c in cells]), np.array([exact[c] for c in cells]))
        assert stat < chi2_bound(df), (depth, stat, df)


def test_ngram_sampled_distribution(loaded, lookup_prompt):
    # Token 0 comes from the prefill; tokens 1 and 2 from speculative steps (drafts accepted about a fifth
    # of the time at the first position).
    ids, stats = sample_many(loaded, lookup_prompt, 500, 2468, speculative="ngram")
    assert stats["num_accepted"] > 0 and stats["num_drafted"] > stats["num_accepted"], stats
    assert_plain_distribution(loaded, lookup_prompt, ids)


def test_oracle_sampled_distribution(loaded, lookup_prompt, tmp_path):
    # The recording is greedy output: sampled rows accept its drafts only where they sample the argmax.
    from mlxhost.engine.spec.oracle import save_recording

    greedy, prompt = [], list(lookup_prompt)
    for _ in range(PARAMS.max_tokens):
        greedy.append(_top(loaded.model, prompt + greedy, 1)[0])
    path = save_recording(tmp_path / "rec.json", {tuple(lookup_prompt): greedy})
    ids, stats = sample_many(loaded, lookup_prompt, 500, 1357, speculative="oracle", draft_model=str(path))
    assert stats["num_accepted"] > 0 and stats["num_drafted"] > stats["num_accepted"], stats
    assert_plain_distribution(loaded, lookup_prompt, ids)


def test_dflash_sampled_distribution(loaded, lookup_prompt, qwen3_model_dir, tmp_path):
    from mlxhost.testing.spec_heads import build_dflash_folder

    drafter = build_dflash_folder(tmp_path / "d", qwen3_model_dir)
    ids, stats = sample_many(loaded, lookup_prompt, 500, 9753, speculative="dflash", draft_model=str(drafter))
    assert stats["num_drafted"] > 0, stats
    assert_plain_distribution(loaded, lookup_prompt, ids)
