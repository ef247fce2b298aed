"""The engine core on the tiny fixture model: a failing step, aborts, and outputs."""

from __future__ import annotations

import logging

import pytest

from mlxserve.config import EngineConfig
from mlxserve.engine.engine_core import EngineCore
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture
def core(loaded):
    return EngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4), max_model_len=4096)


def run(core: EngineCore, requests: list[Request], max_steps: int = 1000) -> dict[str, list]:
    for r in requests:
        core.add_request(r)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not core.has_work:
            return outputs
        for out in core.step():
            outputs[out.request_id].append(out)
    raise AssertionError("the engine did not finish")


def sampled(rid: str, **kw) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(**{"max_tokens": 4, "temperature": 1.0, "ignore_eos": True, **kw}))


def test_outputs_carry_tokens_and_counts(core):
    outs = run(core, [sampled("a", temperature=0.0)])["a"]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4]
    assert all(len(o.new_token_ids) == 1 and o.num_prompt_tokens == 3 for o in outs)
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]


def test_sampling_still_works_after_a_failed_step(core, caplog):
    # A top_k the sampler rejects (the API clamps it; the engine gets it raw here) fails the step inside
    # an mx.compile'd function. Later unseeded sampling must not inherit a broken mx.random state.
    with caplog.at_level(logging.CRITICAL, logger="mlxserve.engine.engine_core"):
        failed = run(core, [sampled("bad", top_k=10**6)])["bad"]
    assert failed and failed[-1].error
    after = run(core, [sampled("good")])["good"]
    assert [o.error for o in after] == [None] * 4
    assert after[-1].finish_reason == "length"


def test_abort_running_request_frees_it(core):
    core.add_request(sampled("long", max_tokens=1000))
    core.add_request(sampled("short", max_tokens=8))
    for _ in range(3):
        core.step()
    core.abort("long")
    after = []
    for _ in range(100):
        if not core.has_work:
            break
        after += core.step()
    assert {o.request_id for o in after} == {"short"}
    assert after[-1].finish_reason == "length" and after[-1].num_output_tokens == 8
    assert core.scheduler.num_running == 0 and not core.has_work
