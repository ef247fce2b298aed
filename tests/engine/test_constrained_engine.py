"""Constrained rows inside the continuous batch: each follows its own JSON schema, and the free rows of
the same batch produce exactly the tokens they produce without the constrained ones.

Numbers are bounded in these schemas: a random model would otherwise write digits until max_tokens
(a real model stops; the grammar allows any length)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.grammar import GrammarSource
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.structured.grammar import Constraint, GrammarFailure, json_schema_constraint
from mlxhost.testing.demo import DemoModelConfig, build_model_folder
from mlxhost.testing.tag_tokens import add_tag_tokens

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                           "maximum": 1, "multipleOf": 0.25}},
     "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]{2,5}$"},
                                      "tags": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 2}},
     "required": ["id", "tags"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def make_core(loaded) -> EngineCore:
    config = EngineConfig(max_num_seqs=16, block_size=16, cache_memory_bytes=32 << 20)
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="constrained")


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 30))]


def run(core: EngineCore, requests: list[Request], errors: dict | None = None) -> dict[str, tuple[list[int], str, str]]:
    """Every request's (token ids, text, finish reason); a failed one's error goes to `errors` if given."""
    for r in requests:
        core.add_request(r)
    out: dict[str, list] = {}
    for _ in range(5000):
        if not core.has_work:
            break
        for o in core.step():
            if errors is not None and o.error is not None:
                errors[o.request_id] = o.error
                continue
            assert o.error is None, o.error
            entry = out.setdefault(o.request_id, [[], "", None])
            entry[0] += o.new_token_ids
            entry[1] += o.text
            entry[2] = o.finish_reason or entry[2]
    return {rid: tuple(v) for rid, v in out.items()}


def test_half_constrained_batch_keeps_free_rows_identical(loaded):
    free = [Request(f"free{i}", prompt(i), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i in range(8)]
    alone = run(make_core(loaded), free)

    core = make_core(loaded)
    constrained = [
        Request(f"json{i}", prompt(100 + i),
                SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                               constraint=json_schema_constraint(SCHEMAS[i % len(SCHEMAS)])),
                eos_token_ids=loaded.eos_token_ids)
        for i in range(8)
    ]
    free = [Request(r.request_id, r.prompt_token_ids, r.sampling) for r in free]
    mixed = [r for pair in zip(constrained, free) for r in pair]
    got = run(core, mixed)
    for r in free:
        assert got[r.request_id][0] == alone[r.request_id][0]
    for i, r in enumerate(constrained):
        ids, text, finish = got[r.request_id]
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    assert core.status()["structured_output"]["num_mask_steps"] > 0


def test_grammar_source_says_why_a_grammar_stopped(loaded):
    source = GrammarSource(loaded.tokenizer, 2048, frozenset(loaded.eos_token_ids))
    eos = min(loaded.eos_token_ids)
    digit = loaded.tokenizer.encode("7")[0]
    rows = [(0, source.compiler.compile(json_schema_constraint(SCHEMAS[0]))),
            (1, source.compiler.compile(json_schema_constraint(SCHEMAS[0])))]
    failed = source.advance(rows, [digit, loaded.tokenizer.encode("{")[0]])
    assert list(failed) == [0] and isinstance(failed[0], GrammarFailure)
    assert failed[0].startswith("the json_schema grammar could not continue: ") and "\n" not in failed[0]
    # EOS ends a healthy request; after a failure it was all the mask left, so the request fails.
    assert source.advance(rows[1:], [None, eos]) == {}
    assert list(source.advance(rows[:1], [eos])) == [0]


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """The demo model with `<tool_call>` and friends as added tokens (ids 2048+)."""
    folder = build_model_folder(tmp_path_factory.mktemp("tagged"), DemoModelConfig(vocab_size=2064))
    add_tag_tokens(folder)
    return load_model(str(folder))


def test_a_grammar_dead_end_fails_only_its_request(tagged):
    # A text literal that spells an added token: llguidance's mask offers the token, then refuses it
    # (what `tool_choice: required` did on Qwen before tags became tokens). Any grammar that cannot go
    # on must end its own request with a clear error and leave the rest of the batch untouched.
    stuck = Constraint('start: "<tool_call>" "x"', "tool_call")
    free = [Request(f"free{i}", prompt(i), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
            for i in range(3)]
    alone = run(make_core(tagged), free)
    core = make_core(tagged)
    bad = Request("bad", prompt(50), SamplingParams(max_tokens=16, temperature=0.0, constraint=stuck),
                  eos_token_ids=tagged.eos_token_ids)
    good = Request("good", prompt(51), SamplingParams(max_tokens=200, temperature=1.0, seed=3,
                                                     constraint=json_schema_constraint(SCHEMAS[1])),
                   eos_token_ids=tagged.eos_token_ids)
    errors: dict = {}
    got = run(core, [bad, good] + [Request(r.request_id, r.prompt_token_ids, r.sampling) for r in free], errors)
    assert list(errors) == ["bad"] and isinstance(errors["bad"], GrammarFailure)
    assert errors["bad"].startswith("the tool_call grammar could not continue:"), errors["bad"]
    for r in free:
        assert got[r.request_id][0] == alone[r.request_id][0]
    jsonschema.validate(json.loads(got["good"][1]), SCHEMAS[1])
    assert not core.has_work
