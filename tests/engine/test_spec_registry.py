"""A proposer added through the registry alone: a toy that drafts the token each row feeds, repeated.
Its greedy output equals plain decoding's, and the speculative mode is the proposer's name."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.spec.proposer import Proposer
from mlxhost.engine.spec.registry import PROPOSERS, make_proposer, proposer_names
from mlxhost.models.loader import load_model


class RepeatLast(Proposer):
    """Right whenever the model repeats a token: a random model often does."""

    name = "repeat"

    def __init__(self, config, vocab_width: int) -> None:
        pass

    def propose(self, step):
        num_k = max(step.budget.values())
        fed = mx.repeat(step.batch.tokens[:, None], num_k + 1, axis=1)
        return fed, [step.budget.get(i, 0) for i in range(len(step.rids))]


@pytest.fixture
def repeat(monkeypatch):
    monkeypatch.setitem(PROPOSERS, "repeat", RepeatLast)


def run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        core.add_request(r)
    out: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def requests() -> list[Request]:
    prompts = [[5, 6, 7, 8] * 3, [11, 12, 13], list(range(40, 70)), [9] * 6]
    return [Request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]


def test_unknown_proposer_is_refused():
    assert "repeat" not in proposer_names()
    with pytest.raises(ValueError, match="speculative"):
        make_proposer("repeat", EngineConfig(speculative="repeat"), 16)


def test_a_registered_proposer_runs_greedy_requests_as_plain_decoding_does(repeat, qwen3_model_dir):
    loaded = load_model(str(qwen3_model_dir))

    def core(**kw) -> EngineCore:
        config = EngineConfig(max_num_seqs=4, block_size=16, cache_memory_bytes=16 << 20, spec_max_batch=4, **kw)
        return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1024, model_key="toy")

    plain = run(core(), requests())
    spec = core(speculative="repeat", num_draft_tokens=3)
    assert run(spec, requests()) == plain
    stats = spec.spec_stats()
    assert stats["mode"] == "repeat" and stats["num_steps"] > 0 and stats["num_drafted"] > 0
