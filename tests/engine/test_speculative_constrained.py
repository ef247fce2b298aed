"""Constrained rows under speculation draft too: their grammar checks each draft token (the first it rejects
cuts the draft there) and masks every verified position, so greedy constrained rows emit exactly what plain
constrained decoding emits, alone and among free rows, with prompt lookup and with a draft model, and
sampled ones keep plain constrained sampling's distribution."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.grammar import GrammarSource
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.sampling import target_logprobs
from mlxhost.models.loader import load_model
from mlxhost.structured.grammar import json_schema_constraint
from mlxhost.structured.matcher import allocate_bitmask, apply_bitmask
from tests.engine.test_speculative import copy, echo_prompt, greedy, make_core, run
from tests.engine.test_speculative_sampling import chi2_bound, chi2_vs_exact

COLORS = ["crimson-red", "ocean-blue", "forest-green", "sunny-yellow", "royal-purple", "burnt-orange"]
PICK = {"type": "object", "properties": {"favorite": {"enum": COLORS},
                                         "others": {"type": "array", "items": {"enum": COLORS}, "maxItems": 4}},
        "required": ["favorite", "others"], "additionalProperties": False}
NOTE = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 40}}, "required": ["note"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def vocab(loaded) -> int:
    return loaded.model(mx.array([[1]])).shape[-1]  # the logits' width


@pytest.fixture(scope="module")
def grammar(loaded, vocab):
    return GrammarSource(loaded.tokenizer, vocab, frozenset(loaded.eos_token_ids))


@pytest.fixture(scope="module")
def json_prompt(loaded):
    """A prompt that already holds JSON of the schema's shape: prompt lookup finds drafts in it."""
    text = " ".join(json.dumps({"favorite": COLORS[i], "others": COLORS[i + 1 : i + 4]}) for i in (0, 2))
    return loaded.tokenizer.encode(text)


@pytest.fixture(scope="module")
def modes(qwen3_model_dir):
    return {"ngram": {"speculative": "ngram"}, "self": {"draft_model": str(qwen3_model_dir)}}


def constrained(loaded, rid: str, prompt: list[int], schema: dict, **kw) -> Request:
    params = {"max_tokens": 80, "temperature": 0.0, "constraint": json_schema_constraint(schema), **kw}
    return Request(rid, prompt, SamplingParams(**params), eos_token_ids=loaded.eos_token_ids)


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_constrained_greedy_identity_alone(loaded, modes, json_prompt, mode):
    req = [constrained(loaded, "j", json_prompt, PICK)]
    plain = run(make_core(loaded), copy(req))
    core = make_core(loaded, num_draft_tokens=5, **modes[mode])
    got = run(core, copy(req))
    assert got["j"]["ids"] == plain["j"]["ids"]
    assert got["j"]["finish"] == "stop"
    jsonschema.validate(json.loads(got["j"]["text"]), PICK)
    stats = core.spec_stats()
    assert stats["num_steps"] > 0  # the constrained row was in speculative steps
    if mode == "ngram":
        # The draft copies the keys and values from the prompt; the grammar lets them through.
        assert stats["num_drafted"] > 0 and stats["num_accepted"] > 0


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_constrained_greedy_identity_among_free_rows(loaded, modes, json_prompt, mode):
    reqs = [
        constrained(loaded, "pick", json_prompt, PICK),
        greedy("free0", echo_prompt(0), max_tokens=30),
        constrained(loaded, "note", echo_prompt(0), NOTE),
        greedy("free1", echo_prompt(3), max_tokens=20, logprobs=True, top_logprobs=2),
        constrained(loaded, "pick2", echo_prompt(4), PICK, logprobs=True),
        greedy("free2", echo_prompt(2), max_tokens=25),
    ]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, num_draft_tokens=4, **modes[mode])
    got = run(core, copy(reqs))
    for r in reqs:
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    for rid, schema in (("pick", PICK), ("note", NOTE), ("pick2", PICK)):
        jsonschema.validate(json.loads(got[rid]["text"]), schema)
    for rid in ("free1", "pick2"):  # logprobs of accepted drafts are those of the (masked) target
        a, b = got[rid]["lp"], plain[rid]["lp"]
        assert [x.token_id for x in a] == [x.token_id for x in b]
        assert [x.logprob for x in a] == pytest.approx([x.logprob for x in b], abs=1e-4)
    assert core.spec_stats()["num_accepted"] > 0


def test_sampled_constrained_rows_speculate_and_stay_valid(loaded, json_prompt):
    core = make_core(loaded, num_draft_tokens=5, speculative="ngram")
    reqs = [constrained(loaded, f"s{i}", json_prompt, PICK, temperature=1.0, seed=i) for i in range(4)]
    got = run(core, reqs)
    for r in reqs:
        assert got[r.request_id]["finish"] == "stop"
        jsonschema.validate(json.loads(got[r.request_id]["text"]), PICK)
    assert core.spec_stats()["num_accepted"] > 0


def _exact(loaded, grammar, constraint, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple, float]:
    """Plain constrained sampling's probability of every output prefix of `depth` tokens."""
    probs = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, p in probs.items():
            matcher = grammar.compiler.compile(constraint)
            for t in prefix:
                assert grammar.feed(matcher, t)
            logits = grammar.mask(loaded.model(mx.array(prompt + list(prefix))[None])[:, -1, :], [(0, matcher)])
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            dist = np.exp(np.array(target_logprobs(logprobs, params)[0], dtype=np.float64))
            for t in np.nonzero(dist > 1e-12)[0]:
                nxt[prefix + (int(t),)] = p * dist[t]
        probs = nxt
    return probs


def test_sampled_constrained_distribution_with_prompt_lookup(loaded, grammar):
    """Output prefixes of sampled constrained requests under prompt lookup (drafts copied from the prompt's
    digit lists: accepted part of the time where the grammar leaves a choice) against the exact
    probabilities plain constrained sampling gives them."""
    schema = {"type": "array", "items": {"enum": [1, 2, 3, 4]}, "minItems": 4, "maxItems": 4}
    constraint = json_schema_constraint(schema)
    prompt = loaded.tokenizer.encode(" ".join(json.dumps([1 + (i * 7 + j * 3) % 4 for j in range(4)])
                                              for i in range(6)))
    n = 500
    mx.random.seed(1234)  # a fixed draw: the bound's 1-in-10,000 false alarm cannot make the suite flaky
    params = SamplingParams(max_tokens=7, temperature=1.0, top_k=3, constraint=constraint)
    config = EngineConfig(max_num_seqs=128, max_num_waiting=n, enable_prefix_cache=False, num_draft_tokens=3,
                          speculative="ngram", spec_max_batch=128)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)
    for i in range(n):
        core.add_request(Request(f"r{i}", prompt, params, eos_token_ids=loaded.eos_token_ids))
    ids: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert 0.1 < core.spec_stats()["acceptance_rate"] < 0.9  # the grammar lets drafts through that are rejected
    for depth in (3, 5):
        exact = _exact(loaded, grammar, constraint, prompt, params, depth)
        cells = sorted(exact)
        counts = Counter(tuple(v[:depth]) for v in ids.values())
        assert set(counts) <= set(cells)
        stat, df = chi2_vs_exact(np.array([counts[c] for c in cells]), np.array([exact[c] for c in cells]))
        assert stat < chi2_bound(df), (depth, stat, df)


# -- the draft walk itself ---------------------------------------------------------------------------
def allowed_after(grammar, prefix: list[int], width: int) -> np.ndarray:
    """Which tokens a fresh matcher allows after `prefix`, as the masked logits' finite entries."""
    matcher = grammar.compiler.compile(json_schema_constraint(PICK))
    for t in prefix:
        assert grammar.feed(matcher, t)
    bitmask = allocate_bitmask(1, grammar.compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    return np.isfinite(np.array(apply_bitmask(mx.zeros((1, width)), bitmask, [0])[0]))


def test_a_draft_token_the_grammar_rejects_cuts_the_draft(loaded, grammar, vocab):
    ids = loaded.tokenizer.encode(json.dumps({"favorite": COLORS[1], "others": []}))
    bad = loaded.tokenizer.encode("zz")[0]
    matcher = grammar.compiler.compile(json_schema_constraint(PICK))
    assert grammar.feed(matcher, ids[0])  # `last`, fed as the step does
    draft = [*ids[1:5], bad, *ids[5:7]]
    masked, kept = grammar.mask_drafts(mx.zeros((2, 1 + len(draft), vocab)), [(1, matcher, draft)])
    assert kept == [4]
    finite = np.isfinite(np.array(masked))
    for j in range(5):  # positions 0..4: what the grammar allows after `last` and the first j drafts
        assert (finite[1, j] == allowed_after(grammar, ids[: 1 + j], vocab)).all(), j
        assert not finite[1, j].all()
    assert finite[1, 5:].all() and finite[0].all()  # past the cut, and other rows: untouched
    # The matcher is back after `last`: it still takes the whole document.
    assert all(grammar.feed(matcher, t) for t in ids[1:]) and matcher.is_stopped


def test_a_draft_past_the_grammars_stop_is_cut_but_eos_is_kept(loaded, grammar, vocab):
    ids = loaded.tokenizer.encode(json.dumps({"favorite": COLORS[0], "others": [COLORS[2]]}))
    eos = sorted(loaded.eos_token_ids)[0]
    other = loaded.tokenizer.encode(" ")[0]
    for draft, want in (([ids[-1], other, other], 1), ([ids[-1], eos, other], 2)):
        matcher = grammar.compiler.compile(json_schema_constraint(PICK))
        for t in ids[:-1]:
            assert grammar.feed(matcher, t)
        masked, kept = grammar.mask_drafts(mx.zeros((1, 1 + len(draft), vocab)), [(0, matcher, draft)])
        assert kept == [want]
        finite = np.isfinite(np.array(masked))
        assert np.flatnonzero(finite[0, 1]).tolist() == [eos]  # after the closing brace: only EOS
        if want == 2:  # EOS is not fed: the next position allows what the one before it did
            assert (finite[0, 2] == finite[0, 1]).all()
        assert not matcher.is_stopped  # rolled back to just before the closing brace
