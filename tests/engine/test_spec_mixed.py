"""One mixed batch of 8 under every proposer kind (eagle3, mtp, ngram, draft, dflash): rows that draft and rows that
asked not to, a JSON-schema row, a row whose prompt prefix is read back from the SSD tier of an engine that
served it before a restart, a LoRA row and a penalized row, all on 8-bit KV. Every row's greedy output is
what plain decoding gives that row alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.lora.adapters import adapter_id, read_adapter
from mlxhost.models.loader import load_model
from mlxhost.structured.grammar import json_schema_constraint
from tests.engine.test_speculative import echo_prompt, run

KINDS = ("eagle3", "mtp", "ngram", "draft", "dflash")
KV = {"kv_bits": 8, "kv_group_size": 32}  # the fixture's head dim is 32
SCHEMA = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
PREFIX = [(i * 41) % 1900 + 5 for i in range(40)]  # two full blocks of 16 go to the SSD tier


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def adapter(loaded, tmp_path_factory) -> str:
    from mlxhost.testing.lora_fixtures import random_adapter

    return str(random_adapter(loaded.model, tmp_path_factory.mktemp("lora") / "a", seed=3, rank=4, scale=4.0))


@pytest.fixture(scope="module")
def spec_configs(qwen3_model_dir, tmp_path_factory) -> dict[str, dict]:
    from mlxhost.testing.perturb import perturbed_copy
    from mlxhost.testing.spec_heads import build_dflash_folder, build_head_folder

    root = tmp_path_factory.mktemp("mixed")
    prompts = [echo_prompt(i) for i in (0, 5, 6)] + [PREFIX + [7, 8, 9]]
    heads = {k: str(build_head_folder(root / k, qwen3_model_dir, k, prompts=prompts, train_steps=300))
             for k in ("eagle3", "mtp")}
    noisy = str(perturbed_copy(qwen3_model_dir, root / "noisy", noise=0.1))  # accepted part of the time
    return {"eagle3": {"speculative": "eagle3", "draft_model": heads["eagle3"]},
            "mtp": {"speculative": "mtp", "draft_model": heads["mtp"]},
            "ngram": {"speculative": "ngram"}, "draft": {"draft_model": noisy},
            "dflash": {"speculative": "dflash", "draft_model": str(build_dflash_folder(root / "dflash", qwen3_model_dir))}}


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 8, "num_draft_tokens": 4, **KV, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="mixed")


def with_adapter(core: EngineCore, path: str) -> str:
    files = read_adapter(path)
    aid = adapter_id("a", files)
    core.runner.lora.load(aid, files)
    return aid


def mixed(loaded, aid: str) -> list[Request]:
    def greedy(rid, prompt, max_tokens, **kw):
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw))

    return [
        greedy("lp", echo_prompt(0), 24, logprobs=True, top_logprobs=2),
        greedy("off", echo_prompt(1), 30, speculative=False),  # rides in the verification forwards undrafted
        Request("json", echo_prompt(4), SamplingParams(max_tokens=40, temperature=0.0,
                                                      constraint=json_schema_constraint(SCHEMA)),
                eos_token_ids=loaded.eos_token_ids),
        greedy("ssd", PREFIX + [7, 8, 9], 30),  # its first 32 tokens come from the SSD tier
        Request("lora", echo_prompt(5), SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True),
                adapter=aid),
        greedy("pen", echo_prompt(3), 20, repetition_penalty=1.3),  # decodes without drafts
        greedy("r6", echo_prompt(6), 36),
        greedy("r7", echo_prompt(7), 18),
    ]


@pytest.fixture(scope="module")
def alone(loaded, adapter) -> dict[str, dict]:
    """Plain decoding of each row alone, on the same 8-bit KV (no prefix cache, no speculation)."""
    core = make_core(loaded, enable_prefix_cache=False)
    aid = with_adapter(core, adapter)
    try:
        out = {r.request_id: run(core, [r])[r.request_id] for r in mixed(loaded, aid)}
    finally:
        core.runner.lora.unload(aid)
    lora = [r for r in mixed(loaded, aid) if r.request_id == "lora"][0]
    base = Request("base", lora.prompt_token_ids, SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True))
    assert run(core, [base])["base"]["ids"] != out["lora"]["ids"]  # the adapter changes this row's output
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_of_8_is_each_rows_plain_greedy_output(loaded, adapter, spec_configs, alone, kind, tmp_path):
    spec = spec_configs[kind]
    first = make_core(loaded, ssd_cache_dir=str(tmp_path), **spec)
    run(first, [Request("warm", PREFIX, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])
    first.close()

    core = make_core(loaded, ssd_cache_dir=str(tmp_path), **spec)  # a restart: nothing cached in memory
    assert core.spec is not None and core.spec.mode == spec.get("speculative", "draft")
    assert core.cache_stats()["num_cached_blocks"] == 0
    aid = with_adapter(core, adapter)
    try:
        got = run(core, mixed(loaded, aid))
    finally:
        core.runner.lora.unload(aid)
    for rid, want in alone.items():
        assert got[rid]["ids"] == want["ids"], (kind, rid)
        assert got[rid]["text"] == want["text"], (kind, rid)
    assert got["ssd"]["cached"] >= 32 and core.cache_stats()["ssd"]["hits"] > 0
    jsonschema.validate(json.loads(got["json"]["text"]), SCHEMA)
    for x, y in zip(got["lp"]["lp"], alone["lp"]["lp"], strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    stats = core.spec_stats()
    assert stats["num_steps"] > 0 and stats["num_drafted"] > 0, stats
    if kind != "dflash":  # a random-weight drafter: its drafts are rarely right
        assert stats["num_accepted"] > 0, stats
    assert stats["acceptance_by_kind"] == {kind: stats["acceptance_rate"]}
