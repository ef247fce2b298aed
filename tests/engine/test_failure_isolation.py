"""A step that raises for one request fails that request only: the others finish token-identical to
running alone, and the prefix cache stays usable. Faults are injected by a model wrapper."""

from __future__ import annotations

import logging

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model

POISON = 1999  # a prompt holding this token makes the wrapped model raise while prefilling it


class FaultyModel:
    """The fixture model, raising on a poisoned prompt chunk or on the decode step numbered `fail_decode`."""

    def __init__(self, model, fail_decode: int | None = None) -> None:
        self._model = model
        self.fail_decode = fail_decode
        self.num_decodes = 0

    def __getattr__(self, name):  # make_cache, layers, ...: what mlx-lm's helpers look for
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None, **kw):
        if any(POISON in row for row in inputs.tolist()):  # alone, or among prompts prefilled together
            raise RuntimeError("injected prefill fault")
        if inputs.shape[1] == 1 and cache is not None and type(cache[0]).__name__.startswith("Batch"):
            self.num_decodes += 1
            if self.num_decodes == self.fail_decode:
                raise RuntimeError("injected decode fault")
        return self._model(inputs, cache=cache, **kw)


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def make_core(model, tokenizer, max_num_seqs: int = 8) -> EngineCore:
    config = EngineConfig(max_num_seqs=max_num_seqs, block_size=16, cache_memory_bytes=32 << 20)
    return EngineCore(model, tokenizer, config, max_model_len=4096, model_key="faults")


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def drain(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, str]]:
    ids: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for _ in range(1000):
        if not core.has_work:
            return ids, errors
        for o in core.step():
            ids.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
    raise AssertionError("the engine did not finish")


GOOD = [[5 + i for i in range(40)], [300 + i for i in range(23)]]
BAD = [7] * 30 + [POISON] + [8] * 5


def alone(loaded) -> list[list[int]]:
    core = make_core(loaded.model, loaded.tokenizer)
    out = []
    for i, p in enumerate(GOOD):
        core.add_request(Request(f"g{i}", p, greedy()))
        out.append(drain(core)[0][f"g{i}"])
    return out


def test_a_failed_prefill_fails_only_its_request(loaded, caplog):
    expected = alone(loaded)
    core = make_core(FaultyModel(loaded.model), loaded.tokenizer)
    core.add_request(Request("g0", GOOD[0], greedy()))
    first = [t for o in core.step() for t in o.new_token_ids]  # g0 is decoding when the bad one arrives
    core.add_request(Request("bad", BAD, greedy()))
    core.add_request(Request("g1", GOOD[1], greedy()))
    with caplog.at_level(logging.CRITICAL):
        ids, errors = drain(core)
    ids["g0"] = first + ids["g0"]
    assert set(errors) == {"bad"} and "injected prefill fault" in errors["bad"]
    assert [ids["g0"], ids["g1"]] == expected
    # The engine and its prefix cache carry on: a repeat of g0 hits its blocks and matches.
    core.add_request(Request("again", GOOD[0], greedy()))
    again, errors = drain(core)
    assert not errors and again["again"] == expected[0]
    assert core.cache_stats()["num_used_blocks"] == 0


def test_a_failed_decode_fails_its_batch_not_the_waiting_requests(loaded, caplog):
    expected = alone(loaded)
    model = FaultyModel(loaded.model, fail_decode=3)
    core = make_core(model, loaded.tokenizer, max_num_seqs=2)
    core.add_request(Request("d0", [9] * 12, greedy()))
    core.add_request(Request("d1", [11] * 20, greedy()))
    core.add_request(Request("waiting", GOOD[0], greedy()))  # no row for it until the others end
    with caplog.at_level(logging.CRITICAL):
        ids, errors = drain(core)
    assert model.num_decodes >= 3
    assert set(errors) == {"d0", "d1"} and all("injected decode fault" in e for e in errors.values())
    assert ids["waiting"] == expected[0]
    # Later requests run in a fresh batch and match running alone.
    for i, p in enumerate(GOOD):
        core.add_request(Request(f"n{i}", p, greedy()))
    ids, errors = drain(core)
    assert not errors and [ids["n0"], ids["n1"]] == expected
