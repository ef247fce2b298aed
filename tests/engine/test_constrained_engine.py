"""Constrained rows inside the continuous batch: each follows its own JSON schema, and the free rows of
the same batch produce exactly the tokens they produce without the constrained ones.

Numbers are bounded in these schemas: a random model would otherwise write digits until max_tokens
(a real model stops; the grammar allows any length)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine_core import EngineCore
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.loader import load_model
from mlxserve.structured.grammar import json_schema_constraint

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


def run(core: EngineCore, requests: list[Request]) -> dict[str, tuple[list[int], str, str]]:
    for r in requests:
        core.add_request(r)
    out: dict[str, list] = {}
    for _ in range(5000):
        if not core.has_work:
            break
        for o in core.step():
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
