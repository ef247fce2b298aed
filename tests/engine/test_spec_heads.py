"""EAGLE-3 and MTP heads inside the decode batch: greedy rows emit exactly what plain decoding emits, alone
and in a mixed batch of 8 (rows drafting and rows that do not, a constrained row, a penalized row, a
prefix-cache hit, logprobs; float and 8-bit KV); sampled rows keep the target's distribution (slow
lane). The heads are fixtures trained briefly on the tiny model's own output: right part of the time."""

from __future__ import annotations

import json
import logging
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.spec.hidden import FINAL, HiddenTap, why_no_tap
from mlxhost.models.loader import load_model
from mlxhost.structured.grammar import json_schema_constraint
from tests.engine.test_speculative import copy, echo_prompt, greedy, run
from tests.engine.test_speculative_sampling import _exact, chi2_bound, chi2_vs_exact

KINDS = ("eagle3", "mtp")


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def heads(qwen3_model_dir, tmp_path_factory):
    from mlxhost.testing.spec_heads import build_head_folder

    # Trained on the continuations of (most of) the prompts below: right often there, the rest of the time
    # wrong, so rows accept whole drafts, parts of drafts and nothing.
    # 400 steps: at 200 the EAGLE-3 head trained with OpenBLAS's rounding accepted no draft at all.
    root = tmp_path_factory.mktemp("heads")
    prompts = [echo_prompt(i) for i in (0, 1, 5, 6)] + [_PREFIX + [7, 8, 9], [11, 12, 13, 14, 15]]
    return {kind: str(build_head_folder(root / kind, qwen3_model_dir, kind, prompts=prompts, train_steps=400))
            for kind in KINDS}


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 8, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="heads")


def head_core(loaded, heads, kind, **kw) -> EngineCore:
    core = make_core(loaded, speculative=kind, draft_model=heads[kind], num_draft_tokens=4, **kw)
    assert core.spec is not None and core.spec.mode == kind
    return core


def test_the_tap_gives_the_models_logits_and_the_layers_asked_for(loaded):
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model
    tokens = mx.array([echo_prompt(0)])
    want = model(tokens, cache=make_prompt_cache(model))
    logits, hidden = HiddenTap(model, (0, 1, 1))(tokens, make_prompt_cache(model))
    assert mx.array_equal(logits, want)
    assert hidden.shape == (*tokens.shape, 3 * model.args.hidden_size)
    _, last = HiddenTap(model, (FINAL,))(tokens, make_prompt_cache(model))
    assert mx.array_equal(model.model(tokens), last)  # the LM head's input
    assert why_no_tap(model, (5,)) is not None  # a layer the model does not have


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identity_single_row(loaded, heads, kind):
    req = [greedy("a", echo_prompt(0), max_tokens=60)]
    plain = run(make_core(loaded), copy(req))
    core = head_core(loaded, heads, kind)
    got = run(core, copy(req))
    assert got["a"]["ids"] == plain["a"]["ids"]
    assert got["a"]["text"] == plain["a"]["text"]
    stats = core.spec_stats()
    assert stats["mode"] == kind and stats["num_accepted"] > 0 and stats["acceptance_rate"] < 1


SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}


def _mixed(loaded) -> list[Request]:
    return [
        greedy("lp", echo_prompt(0), max_tokens=24, logprobs=True, top_logprobs=2),
        greedy("pen", echo_prompt(1), max_tokens=20, repetition_penalty=1.3),  # decodes without drafts
        Request("json", echo_prompt(4), SamplingParams(max_tokens=40, temperature=0.0,
                                                      constraint=json_schema_constraint(SCHEMA)),
                eos_token_ids=loaded.eos_token_ids),
        greedy("hit", _PREFIX + [7, 8, 9], max_tokens=30),  # its first 32 tokens are cached
        *[greedy(f"r{i}", echo_prompt(i), max_tokens=12 + 6 * i) for i in range(5, 9)],
    ]


_PREFIX = [(i * 37) % 1900 + 3 for i in range(40)]


def _run_mixed(core, loaded) -> dict:
    run(core, [greedy("warm", _PREFIX, max_tokens=4)])  # leaves the prefix's blocks in the cache
    return run(core, _mixed(loaded))


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identity_mixed_batch_of_8(loaded, heads, kind, kv_bits):
    kv = {"kv_bits": kv_bits, "kv_group_size": 32}  # the fixture's head dim is 32
    plain = _run_mixed(make_core(loaded, **kv), loaded)
    core = head_core(loaded, heads, kind, **kv)
    got = _run_mixed(core, loaded)
    for r in _mixed(loaded):
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    assert got["hit"]["cached"] >= 32
    jsonschema.validate(json.loads(got["json"]["text"]), SCHEMA)
    for x, y in zip(got["lp"]["lp"], plain["lp"]["lp"], strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    stats = core.spec_stats()
    assert stats["num_steps"] > 0 and stats["num_accepted"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_batches_over_spec_max_batch_decode_without_the_head(loaded, heads, kind):
    """Over --spec-max-batch the plain forward is the model's own (no tap, no head); rows that resume
    speculating draft again once a forward the head saw seeds them, and output stays plain decoding's."""
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=6 + 10 * i) for i in range(5)]
    plain = run(make_core(loaded), copy(reqs))
    core = head_core(loaded, heads, kind, spec_max_batch=2)
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert stats["num_big_batch_steps"] > 0 and stats["num_steps"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_paused_rows_skip_the_head(loaded, qwen3_model_dir, tmp_path, kind):
    """An untrained head's drafts fail, its rows pause, and plain steps while every row is paused run the
    model's own forward with no head; a row that resumes drafts from a gap in the head's KV, and output
    stays plain decoding's."""
    from mlxhost.testing.spec_heads import build_head_folder

    untrained = {kind: str(build_head_folder(tmp_path / kind, qwen3_model_dir, kind, train_steps=0))}
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=80) for i in (2, 3)]
    plain = run(make_core(loaded), copy(reqs))
    core = head_core(loaded, untrained, kind)
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert stats["num_row_pauses"] > 0 and stats["num_head_skips"] > 0
    assert stats["num_steps"] > 0  # rows came back from their pauses and drafted again


@pytest.mark.parametrize("kind", KINDS)
def test_auto_takes_the_heads_kind_and_declines_steps_that_cost_more(loaded, heads, kind):
    """`--speculative auto` with a head's folder speculates with that head; costs that make verification
    a hundred plain steps send steps down the plain path (but for probes), and output stays plain
    decoding's either way."""
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=50) for i in (0, 1, 5)]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, speculative="auto", draft_model=heads[kind], num_draft_tokens=4)
    assert core.spec.mode == kind and core.spec_stats()["policy"] == "auto"
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    assert core.spec_stats()["num_steps"] > 0
    # The policy measured both kinds of step where it decided (no step had ever counted as steady once).
    measured = core.spec_stats()["auto"].values()
    assert any(size["spec_ms"] for size in measured) and any(size["plain_ms"] for size in measured)

    core = make_core(loaded, speculative="auto", draft_model=heads[kind], num_draft_tokens=4)
    for n in range(1, 9):  # measured costs, given: verifying never pays
        core.spec.auto.costs.record(False, n, 1.0)
        core.spec.auto.costs.record(True, n, 100.0)
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert stats["num_declined_steps"] > 0 and stats["num_head_skips"] > 0
    assert stats["acceptance_by_kind"] == {kind: stats["acceptance_rate"]}


def test_a_request_that_opts_out_decodes_without_drafts(loaded, heads):
    reqs = [greedy("off", echo_prompt(0), max_tokens=40, speculative=False), greedy("on", echo_prompt(1), max_tokens=40)]
    plain = run(make_core(loaded), copy(reqs))
    core = head_core(loaded, heads, "eagle3")
    got = run(core, copy(reqs[:1]))
    assert got["off"]["ids"] == plain["off"]["ids"]
    assert core.spec_stats()["num_drafted"] == 0 and core.spec_stats()["num_head_skips"] > 0
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    assert core.spec_stats()["num_drafted"] > 0


def test_auto_without_a_model_looks_up_the_prompt(loaded):
    core = make_core(loaded, speculative="auto")
    assert core.spec.mode == "ngram" and core.spec.auto is not None


def test_a_model_the_tap_cannot_walk_serves_without_the_head(tmp_path_factory, heads, caplog):
    from mlxhost.testing.families import build_family_folder

    loaded = load_model(str(build_family_folder(tmp_path_factory.mktemp("dsv2"), "deepseek_v2")))
    with caplog.at_level(logging.WARNING, logger="mlxhost.engine.spec.setup"):
        core = make_core(loaded, speculative="mtp", draft_model=heads["mtp"])
    assert core.spec is None and "cannot serve this model" in caplog.text


def test_a_head_folder_of_another_kind_is_refused(loaded, heads):
    with pytest.raises(ValueError, match="eagle3"):
        make_core(loaded, speculative="mtp", draft_model=heads["eagle3"])


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_distribution(loaded, heads, kind):
    """Slow lane: output prefixes of sampled rows under a head's drafts against the exact probabilities
    plain sampling gives them (the chi-square bound of test_speculative_sampling)."""
    prompt, n = [11, 12, 13, 14, 15], 400
    mx.random.seed(4321)  # a fixed draw: the bound's false alarm cannot make the suite flaky
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)
    config = EngineConfig(max_num_seqs=128, max_num_waiting=n, enable_prefix_cache=False, num_draft_tokens=3,
                          speculative=kind, draft_model=heads[kind], spec_max_batch=128)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)
    for i in range(n):
        core.add_request(Request(f"r{i}", prompt, params))
    ids: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert core.spec_stats()["num_drafted"] > 0
    # Token 0 comes from the prefill, token 1 from the step that seeds the head, token 2 from a drafting step.
    depth = 3
    exact = _exact(loaded.model, prompt, params, depth)
    cells = sorted(exact)
    counts = Counter(tuple(v[:depth]) for v in ids.values())
    assert set(counts) <= set(cells)
    stat, df = chi2_vs_exact(np.array([counts[c] for c in cells]), np.array([exact[c] for c in cells]))
    assert stat < chi2_bound(df), (stat, df)
