"""Plain and speculative steps are one decode step (the runner's `_decode`): sampling features live once, in
runner/sampling.py, and reach both; greedy tokens and logprobs of speculative decoding are plain decoding's."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

import mlxhost.engine.runner.sampling as sampling
from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.batch import DecodeBatch
from mlxhost.models.loader import load_model
from tests.engine.test_speculative import copy, echo_prompt, greedy, run


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 8, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="one-decode")


def sampled(rid: str, seed: int, **kw) -> Request:
    return Request(rid, echo_prompt(seed), SamplingParams(**{"max_tokens": 24, "temperature": 0.2, "seed": seed,
                                                             "ignore_eos": True, **kw}))


def test_a_filter_added_to_sampling_reaches_plain_and_speculative_steps(loaded, qwen3_model_dir, monkeypatch):
    """A test-only filter plugged into sampling's one filter path (`apply_filters`) bans the token sampled rows
    emit most often. Plain steps sample without it and speculative steps verify without it: drafts of it (the
    target drafting for itself proposes its argmax) are rejected and the residual never draws it."""
    requests = [sampled(f"s{i}", i) for i in range(4)]
    before = run(make_core(loaded, draft_model=str(qwen3_model_dir)), copy(requests))
    banned, count = Counter(t for out in before.values() for t in out["ids"]).most_common(1)[0]
    assert count >= 5  # without the filter, a token sampled rows keep coming back to

    real = sampling.apply_filters

    def without_banned(logprobs: mx.array, sp: SamplingParams) -> mx.array:
        ids = mx.arange(logprobs.shape[-1])
        return mx.where(ids == banned, -float("inf"), real(logprobs, sp))

    monkeypatch.setattr(sampling, "apply_filters", without_banned)
    plain = run(make_core(loaded), copy(requests))
    spec_core = make_core(loaded, draft_model=str(qwen3_model_dir))
    spec = run(spec_core, copy(requests))
    for got in (plain, spec):
        assert all(len(out["ids"]) == 24 and banned not in out["ids"] for out in got.values())
    stats = spec_core.spec_stats()
    assert stats["num_steps"] > 0 and stats["num_drafted"] > 0


def test_a_processor_reaches_rows_of_speculative_steps(loaded, qwen3_model_dir):
    """A logits processor (logit bias, through the request's sampling parameters) is applied the same way in a
    plain step and in a speculative step it rides in beside drafting rows: same tokens, and the banned ones
    never come."""
    free = greedy("free", echo_prompt(0), max_tokens=30)
    plain_free = run(make_core(loaded), [free])["free"]["ids"]
    banned = sorted(set(plain_free))[:3]
    reqs = [greedy("biased", echo_prompt(0), max_tokens=30, logit_bias=tuple((t, -100.0) for t in banned)),
            greedy("drafting", echo_prompt(1), max_tokens=30), greedy("other", echo_prompt(3), max_tokens=30)]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, draft_model=str(qwen3_model_dir))
    got = run(core, copy(reqs))
    for r in reqs:
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    assert not set(banned) & set(got["biased"]["ids"])
    assert core.spec_stats()["num_steps"] > 0


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_greedy_tokens_and_logprobs_of_speculation_are_plain_decodings(loaded, qwen3_model_dir, mode):
    """Every emitted token's logprob and top alternatives, accepted drafts included, match plain decoding's
    (within float rounding: a verification forward has another shape than a decode forward)."""
    spec = {"ngram": {"speculative": "ngram"}, "self": {"draft_model": str(qwen3_model_dir)}}[mode]
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=24, logprobs=True, top_logprobs=3) for i in (0, 1, 3, 4, 5)]
    reqs.append(greedy("pen", echo_prompt(6), max_tokens=24, presence_penalty=0.5, logprobs=True, top_logprobs=2))
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, num_draft_tokens=4, **spec)
    got = run(core, copy(reqs))
    for r in reqs:
        a, b = got[r.request_id], plain[r.request_id]
        assert a["ids"] == b["ids"], r.request_id
        assert len(a["lp"]) == len(b["lp"]) == 24
        for x, y in zip(a["lp"], b["lp"]):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-4)
    assert core.spec_stats()["num_accepted"] > 0


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_only_the_batch_writes_its_fields(loaded, qwen3_model_dir, monkeypatch, mode):
    """Speculative steps change the decode batch (tokens, positions, rewound KV) through its own methods: no
    field of it is set from anywhere but batch.py."""
    writers: set[str] = set()
    real = DecodeBatch.__setattr__

    def spy(self, name, value):
        writers.add(Path(sys._getframe(1).f_code.co_filename).name)
        real(self, name, value)

    monkeypatch.setattr(DecodeBatch, "__setattr__", spy)
    spec = {"ngram": {"speculative": "ngram"}, "self": {"draft_model": str(qwen3_model_dir)}}[mode]
    core = make_core(loaded, **spec)
    run(core, [greedy(f"r{i}", echo_prompt(i), max_tokens=16) for i in (0, 1, 4)])
    assert core.spec_stats()["num_steps"] > 0
    assert writers == {"batch.py"}
