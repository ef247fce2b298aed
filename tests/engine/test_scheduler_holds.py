"""A request's hold on the prefix cache is one value, given back exactly once wherever the request leaves the
scheduler: finished, aborted (running or waiting), failed or preempted. Fake token ids, no MLX."""

from __future__ import annotations

from collections import Counter

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.kv.prefix_cache import PrefixCacheManager, PrefixHold
from tests.engine.test_scheduler_prefix import BS, make_request, prompt_of, run_to_end, step, warm


class CountingManager(PrefixCacheManager):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.released: Counter[str] = Counter()

    def _release(self, hold: PrefixHold) -> None:
        self.released[hold.request_id] += 1
        super()._release(hold)


def make(**kw) -> Scheduler:
    config = EngineConfig(**{"max_num_seqs": 4, "prefill_step_size": 512, "block_size": BS, **kw})
    return Scheduler(config, max_model_len=1024, prefix=CountingManager(32, BS, "m"))


def admitted_with_a_hit(s: Scheduler, rid: str = "r") -> Request:
    warm(s, prompt_of(9))
    s.prefix.released.clear()
    s.add_request(r := make_request(rid, prompt_of(8) + [5, 6, 7]))
    s.schedule()
    assert len(r.cached_block_ids) == 2 and s.prefix.pool.num_used == 2
    return r


def settle(s: Scheduler, steps: int = 3) -> None:
    for _ in range(steps):
        s.schedule()


@pytest.mark.parametrize("leave", ["finish", "abort", "fail", "fail_then_abort"])
def test_the_hold_is_released_once(leave):
    s = make()
    r = admitted_with_a_hit(s)
    if leave == "finish":
        run_to_end(s)
    elif leave == "abort":
        assert s.abort("r") is r
        assert s.abort("r") is None  # gone: a second abort finds nothing
    else:
        s.fail("r")
        if leave == "fail_then_abort":
            s.abort("r")
    settle(s)
    assert s.prefix.released == {"r": 1}
    assert s.prefix.pool.num_used == 0 and not s._holds and not len(s.inflight)  # blocks, pin and claim


def test_the_claim_on_blocks_being_computed_is_part_of_the_hold():
    s = make(prefill_step_size=4)
    s.add_request(r := make_request("r", prompt_of(13)))
    s.schedule()
    assert s.inflight.owner(s.prefix.hashes(r.prompt_token_ids)[2]) == "r"  # a block it is still to compute
    s.abort("r")
    settle(s)
    assert not len(s.inflight) and s.prefix.released == {"r": 1}


def test_a_waiting_request_holds_nothing():
    s = make(max_num_seqs=1)
    admitted_with_a_hit(s, "running")
    s.add_request(make_request("queued", prompt_of(8) + [9]))
    s.schedule()
    assert "queued" not in s._holds
    s.abort("queued")
    run_to_end(s)
    assert s.prefix.released == {"running": 1}


def test_a_preempted_request_gives_its_hold_back_once_and_takes_a_new_one():
    s = make(max_num_seqs=1)
    low = admitted_with_a_hit(s, "low")
    first = s._holds["low"]
    s.add_request(Request("high", prompt_of(12, seed=3), SamplingParams(max_tokens=2, ignore_eos=True), priority=-1))
    out = step(s)
    assert out.preempted_request_ids == ["low"] and first.released
    assert s.prefix.released == {"low": 1}
    run_to_end(s)
    assert low.num_preemptions == 1
    assert s.prefix.released == {"low": 2, "high": 1}  # its second admission's hold, released at its end
    assert s.prefix.pool.num_used == 0
