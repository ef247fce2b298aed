"""Prefill chunks sized by a fake step-cost model so decoding rows wait at most `max_decode_gap_s` for their
next token; a prompt alone still gets whole chunks. Costs are the model's, never wall time. No model, no MLX."""

from __future__ import annotations

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.engine.step_cost import StepCostModel

EOS = 0


def make_request(rid: str, num_prompt: int, max_tokens: int = 10_000) -> Request:
    return Request(rid, list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_ids=frozenset({EOS}))


def make_scheduler(gap_s: float, prefill_step_size: int = 512, max_num_prefill_rows: int = 8) -> Scheduler:
    config = EngineConfig(max_num_seqs=8, prefill_step_size=prefill_step_size, max_decode_gap_s=gap_s,
                          max_num_prefill_rows=max_num_prefill_rows)
    return Scheduler(config, max_model_len=100_000)


class FakeCosts:
    """A machine whose step costs `decode_s` per decode forward plus `fixed_s` and `per_token_s` per prefill
    forward: what the engine core would measure, fed back as it feeds the runner's timings."""

    def __init__(self, decode_s: float, per_token_s: float, fixed_s: float = 0.0) -> None:
        self.decode_s, self.per_token_s, self.fixed_s = decode_s, per_token_s, fixed_s

    def cost(self, out) -> float:
        tokens = sum(c.num_tokens for c in out.prefill_chunks)
        return ((self.decode_s if out.decode_request_ids else 0.0)
                + (self.fixed_s + tokens * self.per_token_s if tokens else 0.0))


def run_steps(s: Scheduler, costs: FakeCosts, until) -> list:
    """Steps the scheduler with one token per running request, feeding each step's cost to its cost model."""
    steps = []
    for _ in range(10_000):
        if until():
            return steps
        out = s.schedule()
        steps.append(out)
        s.step_cost.observe(sum(c.num_tokens for c in out.prefill_chunks), len(out.decode_request_ids),
                            costs.cost(out))
        new = {rid: 7 for rid in out.decode_request_ids}
        new.update({c.request_id: 7 for c in out.prefill_chunks if c.is_last})
        s.update(new)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("fixed_s", [0.0, 0.05])
def test_a_long_prompt_arriving_mid_stream_keeps_the_decode_gap_under_the_target(fixed_s):
    gap_s = 1.0
    costs = FakeCosts(decode_s=0.2, per_token_s=0.01, fixed_s=fixed_s)  # a whole 512-token chunk: 5 s
    s = make_scheduler(gap_s)
    stream, long = make_request("stream", 8), make_request("long", 7000, max_tokens=4)
    s.add_request(stream)
    run_steps(s, costs, until=lambda: stream.num_output_tokens >= 3)
    # A lone prompt measured the prefill's cost; a 7k-token one arrives while the stream decodes.
    s.add_request(long)
    steps = run_steps(s, costs, until=lambda: long.num_output_tokens > 0)
    mixed = [out for out in steps if out.decode_request_ids and out.prefill_chunks]
    assert len(mixed) > 7000 // 512  # the prompt was cut finer than whole chunks
    modeled = [costs.cost(out) for out in mixed]
    # The first mixed step may still use the measurement of the short prompt's whole chunk; the rest hold.
    assert max(modeled[1:]) <= gap_s, max(modeled[1:])
    # ...and not far under it: the prompt still gets most of each step.
    assert sorted(modeled)[len(modeled) // 2] >= 0.7 * gap_s
    assert all("stream" in out.decode_request_ids for out in steps)  # a token every step


def test_a_prompt_alone_prefills_whole_chunks():
    s = make_scheduler(0.5)
    s.step_cost.observe(512, 0, 5.0)  # chunks cost far more than the target
    s.step_cost.observe(0, 1, 0.1)
    s.add_request(make_request("long", 2000, max_tokens=2))
    out = s.schedule()
    assert [c.num_tokens for c in out.prefill_chunks] == [512]


def test_the_largest_chunk_beside_decode_rows_keeps_the_modeled_step_under_the_target():
    s = make_scheduler(2.0, prefill_step_size=4096)
    model = s.step_cost
    model.observe(1024, 0, 10.24)  # 10 ms a token
    model.observe(0, 4, 0.5)  # a decode forward of the rows
    s.add_request(make_request("stream", 8))
    s.schedule()
    s.update({"stream": 7})
    s.add_request(make_request("long", 9000))
    out = s.schedule()
    (chunk,) = out.prefill_chunks
    assert out.decode_request_ids == ["stream"]
    assert model.modeled_step_s(chunk.num_tokens, True) <= 2.0
    assert model.modeled_step_s(chunk.num_tokens + 16, True) > 2.0 * 0.9  # the most that fits the plan


def test_decode_alone_over_the_target_still_advances_the_prompt():
    model = StepCostModel(0.1)
    model.observe(512, 0, 5.0)
    model.observe(0, 8, 0.3)  # the decode forward alone exceeds the target
    assert model.prefill_budget(512, True) == 512 // 8  # an eighth of the chunk, at least min_prefill_tokens
    assert model.prefill_budget(8, True) == 8  # never more than the step's budget


def test_off_and_unmeasured_give_whole_chunks():
    off = StepCostModel(0.0)
    off.observe(512, 0, 50.0)
    assert off.prefill_budget(512, True) == 512
    assert StepCostModel(1.0).prefill_budget(512, True) == 512  # nothing measured: as before


def test_batched_prompts_share_the_bounded_budget():
    s = make_scheduler(1.0, max_num_prefill_rows=4)
    s.step_cost.observe(512, 0, 5.12)
    s.step_cost.observe(0, 1, 0.1)
    s.add_request(make_request("stream", 8))
    s.schedule()
    s.update({"stream": 7})
    for i in range(3):
        s.add_request(make_request(f"p{i}", 1000))
    out = s.schedule()
    # Padded to the longest, their forward is rows x share tokens: the bound holds for it.
    rows = len(out.prefill_chunks)
    assert rows == 3 and s.step_cost.modeled_step_s(rows * max(c.num_tokens for c in out.prefill_chunks), True) <= 1.0
