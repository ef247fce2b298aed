"""Speculative decoding inside the batch: greedy rows emit exactly what plain decoding emits, with prompt
lookup and with draft models of every acceptance rate (the target itself: 100%; another random model:
low), alone and among 16 concurrent rows with mixed drafts, constrained and penalized rows, logprobs,
EOS / max_tokens / stop strings inside accepted runs, and the prefix cache."""

from __future__ import annotations

import json
import logging
import random

import jsonschema
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.structured.grammar import json_schema_constraint


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def make_core(loaded, **kw) -> EngineCore:
    # Speculation in batches of up to 16 rows: what these tests check is its identity there.
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 16, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="spec")


def run(core: EngineCore, requests: list[Request]) -> dict[str, dict]:
    for r in requests:
        core.add_request(r)
    out: dict[str, dict] = {}
    for _ in range(5000):
        if not core.has_work:
            break
        for o in core.step():
            assert o.error is None, o.error
            e = out.setdefault(o.request_id, {"ids": [], "text": "", "finish": None, "lp": [], "cached": 0})
            e["ids"] += o.new_token_ids
            e["text"] += o.text
            e["finish"] = o.finish_reason or e["finish"]
            e["lp"] += o.logprobs or []
            e["cached"] = o.num_cached_tokens
    return out


def echo_prompt(seed: int) -> list[int]:
    """A prompt that repeats a phrase (prompt lookup finds drafts) or random tokens (it finds none)."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 9))]
    if seed % 3 == 2:
        return [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 30))]
    return phrase * rng.randrange(2, 5) + phrase[: rng.randrange(1, len(phrase))]


def greedy(rid: str, prompt: list[int], max_tokens: int = 24, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                                  **kw}))


def copy(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, r.prompt_token_ids, r.sampling, r.eos_token_ids) for r in requests]


@pytest.fixture(scope="module")
def concurrent_requests():
    # Mixed lengths: rows finish, fillers appear and new rows join while others are mid-draft.
    return [greedy(f"r{i}", echo_prompt(i), max_tokens=8 + 5 * (i % 6)) for i in range(24)]


@pytest.fixture(scope="module")
def plain_outputs(loaded, concurrent_requests):
    return run(make_core(loaded), copy(concurrent_requests))


@pytest.fixture(scope="module")
def noisy_dir(qwen3_model_dir, tmp_path_factory):
    """The target with noise on its weights: a draft accepted part of the time (~30% here)."""
    from mlxhost.testing.perturb import perturbed_copy

    return perturbed_copy(qwen3_model_dir, tmp_path_factory.mktemp("noisy"), noise=0.1)


@pytest.fixture(scope="module")
def drafts(qwen3_model_dir, llama_model_dir, noisy_dir):
    return {"ngram": {"speculative": "ngram"}, "self": {"draft_model": str(qwen3_model_dir)},
            "noisy": {"draft_model": str(noisy_dir)}, "other": {"draft_model": str(llama_model_dir)}}


@pytest.mark.parametrize("mode", ["ngram", "self", "noisy", "other"])
def test_greedy_identity_single_row(loaded, drafts, mode):
    spec = drafts[mode]
    req = [greedy("a", echo_prompt(0), max_tokens=40)]
    plain = run(make_core(loaded), copy(req))
    core = make_core(loaded, num_draft_tokens=5, **spec)
    got = run(core, copy(req))
    assert got["a"]["ids"] == plain["a"]["ids"]
    assert got["a"]["text"] == plain["a"]["text"]
    stats = core.spec_stats()
    assert stats["num_drafted"] > 0
    if mode == "self":
        assert stats["acceptance_rate"] == 1.0  # the target drafting for itself is always right
        assert stats["num_steps"] < 40 // 3
    if mode == "other":
        assert stats["acceptance_rate"] < 0.2


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_a_lone_row_speculates_on_the_lean_path(loaded, drafts, mode):
    """A lone row keeps mlx-lm's KVCache under speculation (its trim is the rewind), drafts are
    accepted, and the output is plain greedy's."""
    req = [greedy("a", echo_prompt(3), max_tokens=40)]  # prompt lookup accepts drafts on this one
    plain = run(make_core(loaded), copy(req))
    core = make_core(loaded, num_draft_tokens=5, **drafts[mode])
    core.add_request(copy(req)[0])
    ids, lean_steps = [], 0
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            ids += o.new_token_ids
        lean_steps += core.runner.batch.is_lean
    assert ids == plain["a"]["ids"]
    assert lean_steps > 0 and core.spec_stats()["num_accepted"] > 0


@pytest.mark.parametrize("mode", ["ngram", "self", "noisy"])
def test_greedy_identity_16_concurrent(loaded, drafts, concurrent_requests, plain_outputs, mode):
    spec = drafts[mode]
    core = make_core(loaded, **spec)
    got = run(core, copy(concurrent_requests))
    for r in concurrent_requests:
        assert got[r.request_id]["ids"] == plain_outputs[r.request_id]["ids"], r.request_id
        assert len(got[r.request_id]["ids"]) == r.sampling.max_tokens
    stats = core.spec_stats()
    assert 0 < stats["num_accepted"] <= stats["num_drafted"]


def _draft_in_step(core: EngineCore) -> bool:
    """A draft model's cache of each live row holds all the row's KV but its last emitted token."""
    batch = core.runner.batch
    live = [i for i, rid in enumerate(batch.row_ids) if rid is not None]
    # A lone row decodes through mlx-lm's KVCache (the lean path): one int offset.
    target, draft = (c.offset.tolist() if hasattr(c.offset, "tolist") else [c.offset]
                     for c in (batch.cache[0], batch.draft_cache[0]))
    return all(draft[i] == target[i] - 1 for i in live)


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_batches_over_spec_max_batch_decode_plainly(loaded, drafts, mode):
    """More rows than --spec-max-batch: steps decode plainly (no drafts, no verification); as rows finish
    and the batch shrinks, speculation resumes, and greedy output stays token-identical. A draft model's
    cache catches up on what the plain steps decoded: the target drafting for itself is still always right."""
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=6 + 8 * i) for i in range(6)]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, spec_max_batch=2, **drafts[mode])
    for r in copy(reqs):
        core.add_request(r)
    got: dict[str, list[int]] = {}
    sizes = {"big": 0, "small": 0}
    while core.has_work:
        before = core.spec_stats()
        for o in core.step():
            assert o.error is None
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        after = core.spec_stats()
        num_live = core.runner.batch.num_live  # the rows this step decoded (finished ones leave next step)
        if not num_live:
            continue
        big = after["num_big_batch_steps"] - before["num_big_batch_steps"]
        spec = after["num_steps"] - before["num_steps"]
        assert big == (num_live > 2)
        if num_live > 2:
            assert spec == 0 and after["num_drafted"] == before["num_drafted"]
            sizes["big"] += 1
        elif spec:
            sizes["small"] += 1
            if mode == "self":
                assert _draft_in_step(core)
    assert sizes["big"] > 0 and sizes["small"] > 0
    assert {r.request_id: got[r.request_id] for r in reqs} == {r.request_id: plain[r.request_id]["ids"] for r in reqs}
    stats = core.spec_stats()
    assert stats["spec_max_batch"] == 2 and stats["num_plain_steps"] >= stats["num_big_batch_steps"] == sizes["big"]
    if mode == "self":
        assert stats["acceptance_rate"] == 1.0


def test_a_row_whose_drafts_keep_failing_pauses_drafting(loaded, drafts):
    """A draft that is rarely right (another random model): after a few rejected drafts the row stops
    drafting, tries again after longer and longer pauses, and catches the draft's cache up each time."""
    req = [greedy("a", echo_prompt(2), max_tokens=120)]
    plain = run(make_core(loaded), copy(req))
    core = make_core(loaded, **drafts["other"])
    core.add_request(copy(req)[0])
    ids = []
    while core.has_work:
        before = core.spec_stats()["num_steps"]
        for o in core.step():
            ids += o.new_token_ids
        if core.spec_stats()["num_steps"] > before and core.runner.batch.num_live:
            assert _draft_in_step(core)
    assert ids == plain["a"]["ids"]
    stats = core.spec_stats()
    assert stats["num_row_pauses"] >= 2 and stats["num_plain_steps"] > stats["num_steps"]
    assert stats["num_drafted"] < 40  # drafting every step would propose a token or more each of ~120 steps


def test_mixed_batch_constrained_penalized_logprobs(loaded, qwen3_model_dir):
    """Constrained rows draft (their grammar checks the drafts), penalized rows ride in speculative steps
    without drafts; logprobs of emitted tokens (accepted drafts included) match plain decoding's."""
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
    reqs = [
        greedy("lp", echo_prompt(0), max_tokens=20, logprobs=True, top_logprobs=3),
        greedy("pen", echo_prompt(1), max_tokens=20, repetition_penalty=1.3, logprobs=True, top_logprobs=2),
        Request("json", echo_prompt(4), SamplingParams(max_tokens=60, temperature=0.0,
                                                      constraint=json_schema_constraint(schema)),
                eos_token_ids=loaded.eos_token_ids),
        greedy("free", echo_prompt(3), max_tokens=20),
    ]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, draft_model=str(qwen3_model_dir))
    got = run(core, copy(reqs))
    for r in reqs:
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    jsonschema.validate(json.loads(got["json"]["text"]), schema)
    for rid in ("lp", "pen"):  # a drafting row, and a penalized one riding along without a draft
        a, b = got[rid]["lp"], plain[rid]["lp"]
        assert len(a) == len(b) == 20
        for x, y in zip(a, b):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert core.spec_stats()["num_accepted"] > 0


def test_eos_max_tokens_and_stop_string_inside_an_accepted_run(loaded, qwen3_model_dir):
    base = run(make_core(loaded), [greedy("a", echo_prompt(0), max_tokens=30)])["a"]
    ids, text = base["ids"], base["text"]
    core = make_core(loaded, draft_model=str(qwen3_model_dir), num_draft_tokens=6)
    # A stop token in the middle of a 7-token run: output ends at it, like plain decoding.
    stop_at = next(i for i in range(9, 20) if ids[i] not in ids[:i])
    got = run(core, [greedy("eos", echo_prompt(0), max_tokens=30, stop_token_ids=(ids[stop_at],)),
                     greedy("len", echo_prompt(0), max_tokens=11)])
    assert got["eos"]["ids"] == ids[: stop_at + 1] and got["eos"]["finish"] == "stop"
    assert got["len"]["ids"] == ids[:11] and got["len"]["finish"] == "length"
    # A stop string: the text before it, and no token after the one that completed it.
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    if stop.strip():
        got = run(core, [greedy("s", echo_prompt(0), max_tokens=30, stop=(stop,))])["s"]
        assert got["finish"] == "stop"
        assert got["text"] == text[: text.index(stop)]
        assert got["ids"] == ids[: len(got["ids"])] and len(got["ids"]) < 30


def test_prefix_cache_hit_with_speculation(loaded, qwen3_model_dir):
    """Accepted tokens' blocks are cached: a second request whose prompt is the first's prompt + output
    hits blocks that were written by speculative steps, and still decodes identically."""
    prompt = echo_prompt(1)
    core = make_core(loaded, draft_model=str(qwen3_model_dir))
    first = run(core, [greedy("a", prompt, max_tokens=40)])["a"]
    follow = prompt + first["ids"] + [7, 8]
    got = run(core, [greedy("b", follow, max_tokens=16)])["b"]
    assert got["cached"] >= 16 * ((len(prompt) + 30) // 16)
    plain = run(make_core(loaded, enable_prefix_cache=False), [greedy("b", follow, max_tokens=16)])["b"]
    assert got["ids"] == plain["ids"]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_unrewindable_families_serve_without_speculation(tmp_path_factory, family, caplog):
    from mlxhost.testing.families import build_family_folder

    loaded = load_model(str(build_family_folder(tmp_path_factory.mktemp(family), family)))
    with caplog.at_level(logging.WARNING, logger="mlxhost.engine.spec.setup"):
        core = make_core(loaded, speculative="ngram")
    assert core.spec is None and "speculative decoding is off" in caplog.text
    reqs = [greedy("a", echo_prompt(0), max_tokens=8)]
    assert run(core, copy(reqs))["a"]["ids"] == run(make_core(loaded), copy(reqs))["a"]["ids"]


def test_mla_family_speculates(tmp_path_factory):
    from mlxhost.testing.families import build_family_folder

    loaded = load_model(str(build_family_folder(tmp_path_factory.mktemp("dsv2"), "deepseek_v2")))
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=16) for i in range(4)]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, speculative="ngram")
    assert core.spec is not None
    got = run(core, copy(reqs))
    assert all(got[r.request_id]["ids"] == plain[r.request_id]["ids"] for r in reqs)


def test_draft_model_memory_is_budgeted(loaded, qwen3_model_dir):
    """The draft's weights leave the KV share and its KV counts per running token: fewer tokens admitted."""
    # Dedicated mode: a budget from the machine's capacity, not from free memory that moves meanwhile.
    plain = make_core(loaded, memory_mode="dedicated")
    spec = make_core(loaded, memory_mode="dedicated", draft_model=str(qwen3_model_dir))
    if plain.budget is None:
        pytest.skip("no memory budget on this machine")
    assert spec.budget.weights > plain.budget.weights and spec.budget.kv < plain.budget.kv
    assert spec.kv_capacity_tokens < plain.kv_capacity_tokens * 0.6  # the same model twice: about half


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dflash"])
def test_head_and_drafter_memory_is_budgeted(loaded, qwen3_model_dir, tmp_path, kind):
    """A head's or drafter's own weights leave the KV share (not the target's arrays it binds: the embedding,
    the LM head), and its layers' KV counts per running token, one target layer's worth each."""
    from mlx.utils import tree_flatten

    from mlxhost.testing.spec_heads import build_dflash_folder, build_head_folder

    if kind == "dflash":
        folder = build_dflash_folder(tmp_path / kind, qwen3_model_dir)
    else:
        folder = build_head_folder(tmp_path / kind, qwen3_model_dir, kind, train_steps=0)
    plain = make_core(loaded, memory_mode="dedicated")
    spec = make_core(loaded, memory_mode="dedicated", speculative=kind, draft_model=str(folder))
    if plain.budget is None:
        pytest.skip("no memory budget on this machine")
    module = spec.spec.proposer.held()
    target_ids = {id(v) for _, v in tree_flatten(loaded.model.parameters())}
    own = [v for _, v in tree_flatten(module.parameters()) if id(v) not in target_ids]
    assert own
    assert spec.budget.weights - plain.budget.weights == sum(v.nbytes for v in own)
    assert spec.budget.kv == plain.budget.kv - sum(v.nbytes for v in own)
    per_layer = plain.kv_bytes_per_token // len(loaded.model.layers)
    assert spec.kv_bytes_per_token == plain.kv_bytes_per_token + per_layer * len(module.layers)


def test_scheduler_takes_a_run_of_tokens_and_cuts_it_at_eos():
    from mlxhost.engine.scheduler import Scheduler

    s = Scheduler(EngineConfig(max_num_seqs=2, enable_prefix_cache=False), 4096, None, None)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({9})))
    s.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=4)))
    s.schedule()
    assert s.update({"a": [5, 6], "b": [5, 6, 7]}) == []
    finished = s.update({"a": [7, 9, 8, 8], "b": [5, 6, 7]})
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    assert {tuple(r.output_token_ids) for r in s._finished} == {(5, 6, 7, 9), (5, 6, 7, 5)}
