"""The oracle proposer (a benchmark tool): replaying plain decoding's recorded greedy output, every draft is
accepted and output is plain decoding's; a prompt missing from the recording, or a row whose output
leaves it, still decodes exactly (its drafts are verified like any other)."""

from __future__ import annotations

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.spec.oracle import load_recording, save_recording
from mlxhost.models.loader import load_model
from tests.engine.test_speculative import copy, echo_prompt, greedy, run


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 8, "num_draft_tokens": 4, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)


def test_replaying_plain_output_accepts_every_draft(loaded, tmp_path):
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=20 + 7 * i) for i in range(4)]
    plain = run(make_core(loaded), copy(reqs))
    path = save_recording(tmp_path / "rec.json", {tuple(r.prompt_token_ids): plain[r.request_id]["ids"]
                                                  for r in reqs})
    assert load_recording(path)[tuple(reqs[0].prompt_token_ids)] == plain["r0"]["ids"]
    core = make_core(loaded, speculative="oracle", draft_model=str(path))
    assert core.spec.mode == "oracle"
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert stats["num_drafted"] > 0 and stats["acceptance_rate"] == 1.0
    assert stats["acceptance_by_kind"] == {"oracle": 1.0}


def test_a_wrong_or_missing_recording_stays_exact(loaded, tmp_path):
    reqs = [greedy("wrong", echo_prompt(0), max_tokens=24), greedy("missing", echo_prompt(1), max_tokens=24)]
    plain = run(make_core(loaded), copy(reqs))
    wrong = plain["wrong"]["ids"][:6] + [(t + 1) % 2000 for t in plain["wrong"]["ids"][6:]]
    path = save_recording(tmp_path / "rec.json", {tuple(reqs[0].prompt_token_ids): wrong})
    core = make_core(loaded, speculative="oracle", draft_model=str(path))
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert 0 < stats["num_accepted"] < stats["num_drafted"]


def test_oracle_needs_a_recording(loaded, tmp_path):
    with pytest.raises(ValueError, match="recording"):
        make_core(loaded, speculative="oracle")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not an oracle recording"):
        make_core(loaded, speculative="oracle", draft_model=str(tmp_path / "x.json"))
