"""The scheduler with fake token ids: admission, chunked prefill, finishing, aborts. No model, no MLX."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, RequestStatus, SamplingParams
from mlxhost.engine.scheduler import PrefillChunk, QueueFullError, Scheduler, split_prefill_budget
from mlxhost.memory.capacity import KVCapacity

EOS = 0


def make_request(rid: str, num_prompt: int = 4, max_tokens: int = 8, **sampling) -> Request:
    return Request(rid, list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=max_tokens, **sampling),
                   eos_token_ids=frozenset({EOS}))


def make_scheduler(max_num_seqs=4, prefill_step_size=512, max_model_len=1024, max_num_waiting=1024,
                   max_num_prefill_rows=8) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, prefill_step_size=prefill_step_size,
                          max_num_waiting=max_num_waiting, max_num_prefill_rows=max_num_prefill_rows)
    return Scheduler(config, max_model_len)


def chunks(out) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start, c.num_tokens, c.is_last) for c in out.prefill_chunks]


def test_scheduler_imports_no_tensor_library():
    code = "import sys, mlxhost.engine.scheduler; bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'numpy')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fifo_admission_up_to_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}"))
    out = s.schedule()
    assert list(s.running) == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3", "r4"]
    assert (s.num_running, s.num_waiting) == (2, 3)
    assert [c.request_id for c in out.prefill_chunks] == ["r0", "r1"]
    assert all(s.running[rid].status is RequestStatus.RUNNING for rid in s.running)
    assert all(r.status is RequestStatus.WAITING for r in s.waiting)


def test_a_finished_request_makes_room_for_the_oldest_waiting():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}", max_tokens=1 if i == 1 else 8))
    out = s.schedule()
    finished = s.update({c.request_id: 5 for c in out.prefill_chunks})
    assert [r.request_id for r in finished] == ["r1"]
    out = s.schedule()
    assert out.finished_request_ids == ["r1"]
    assert list(s.running) == ["r0", "r2"]
    assert [c.request_id for c in out.prefill_chunks] == ["r2"]
    assert out.decode_request_ids == ["r0"]


def test_one_prompt_per_forward_is_chunked_oldest_first():
    # Families whose caches cannot be padded: one prompt after another, the rest of the budget to the next.
    s = make_scheduler(prefill_step_size=4, max_num_prefill_rows=1)
    s.add_request(make_request("a", num_prompt=10))
    s.add_request(make_request("b", num_prompt=3))
    assert chunks(s.schedule()) == [("a", 0, 4, False)]
    assert chunks(s.schedule()) == [("a", 4, 4, False)]
    # a's last 2 tokens, then b gets what is left of the budget.
    assert chunks(s.schedule()) == [("a", 8, 2, True), ("b", 0, 2, False)]
    out = s.schedule()
    assert chunks(out) == [("b", 2, 1, True)]
    # a finished its prompt in the previous step, but has no sampled token yet; still it decodes now.
    assert out.decode_request_ids == ["a"]
    assert s.running["a"].num_computed_tokens == 10 and s.running["b"].num_computed_tokens == 3


def test_chunks_cover_the_prompt_exactly():
    s = make_scheduler(prefill_step_size=5)
    prompts = {"a": 17, "b": 1, "c": 5, "d": 11}
    for rid, n in prompts.items():
        s.add_request(make_request(rid, num_prompt=n))
    seen: dict[str, list[PrefillChunk]] = {rid: [] for rid in prompts}
    for _ in range(20):
        out = s.schedule()
        assert sum(c.num_tokens for c in out.prefill_chunks) <= 5
        for c in out.prefill_chunks:
            seen[c.request_id].append(c)
    for rid, n in prompts.items():
        cs = seen[rid]
        assert [c.start for c in cs] == [sum(x.num_tokens for x in cs[:i]) for i in range(len(cs))]
        assert sum(c.num_tokens for c in cs) == n
        assert [c.is_last for c in cs] == [False] * (len(cs) - 1) + [True]


def test_decode_list_holds_requests_whose_prompt_is_done():
    s = make_scheduler(prefill_step_size=8)
    s.add_request(make_request("short", num_prompt=2))
    s.add_request(make_request("long", num_prompt=20))
    out = s.schedule()
    assert chunks(out) == [("short", 0, 2, True), ("long", 0, 4, False)]
    assert out.decode_request_ids == []
    s.update({"short": 5})
    out = s.schedule()
    assert out.decode_request_ids == ["short"]
    assert chunks(out) == [("long", 4, 8, False)]


def test_a_burst_of_short_prompts_finishes_prefill_in_one_step():
    # Oldest first, the budget of 64 would finish three prompts this step and the rest later; shared,
    # all eight finish now, in one forward of 8 rows x 8 positions.
    s = make_scheduler(max_num_seqs=16, prefill_step_size=64)
    lengths = [8, 3, 8, 5, 1, 7, 8, 2]
    for i, n in enumerate(lengths):
        s.add_request(make_request(f"r{i}", num_prompt=n))
    out = s.schedule()
    assert chunks(out) == [(f"r{i}", 0, n, True) for i, n in enumerate(lengths)]


def test_the_budget_is_shared_fairly_and_bounds_the_padded_forward():
    s = make_scheduler(max_num_seqs=16, prefill_step_size=64)
    for rid, n in [("long", 300), ("mid", 40), ("short", 5), ("tiny", 1)]:
        s.add_request(make_request(rid, num_prompt=n))
    out = s.schedule()
    # 4 rows: 16 each at most, so rows x longest chunk <= 64 however long the prompts are.
    assert chunks(out) == [("long", 0, 16, False), ("mid", 0, 16, False), ("short", 0, 5, True),
                           ("tiny", 0, 1, True)]
    s.update({"short": 9, "tiny": 9})
    assert chunks(s.schedule()) == [("long", 16, 32, False), ("mid", 16, 24, True)]
    s.update({"mid": 9})
    # Alone, a long prompt gets the whole budget again.
    assert chunks(s.schedule()) == [("long", 48, 64, False)]


def test_rows_per_prefill_forward_are_capped_oldest_first():
    s = make_scheduler(max_num_seqs=16, prefill_step_size=120, max_num_prefill_rows=3)
    for i in range(5):
        s.add_request(make_request(f"r{i}", num_prompt=50))
    assert chunks(s.schedule()) == [("r0", 0, 40, False), ("r1", 0, 40, False), ("r2", 0, 40, False)]
    assert chunks(s.schedule()) == [("r0", 40, 10, True), ("r1", 40, 10, True), ("r2", 40, 10, True)]
    assert chunks(s.schedule()) == [("r3", 0, 50, True), ("r4", 0, 50, True)]


def hold_back_scheduler(wait: int, rows: int = 3) -> Scheduler:
    config = EngineConfig(max_num_seqs=16, prefill_step_size=512, max_num_prefill_rows=rows, prefill_wait_steps=wait)
    return Scheduler(config, 1024)


def test_new_prompts_wait_for_others_while_rows_decode():
    s = hold_back_scheduler(wait=2)
    s.add_request(make_request("a"))
    assert chunks(s.schedule()) == [("a", 0, 4, True)]  # nothing decodes: admitted at once
    s.update({"a": 5})
    s.add_request(make_request("b"))
    assert chunks(s.schedule()) == []  # a decodes: b waits (1 step)
    s.update({"a": 5})
    s.add_request(make_request("c"))
    assert chunks(s.schedule()) == []  # b: 2 steps
    s.update({"a": 5})
    out = s.schedule()  # b has waited its 2 steps: b and c prefill together
    assert chunks(out) == [("b", 0, 4, True), ("c", 0, 4, True)] and out.decode_request_ids == ["a"]


def test_enough_waiting_prompts_fill_a_prefill_at_once():
    s = hold_back_scheduler(wait=10, rows=3)
    s.add_request(make_request("a"))
    s.schedule()
    s.update({"a": 5})
    s.add_request(make_request("b"))
    s.add_request(make_request("c"))
    assert chunks(s.schedule()) == []
    s.update({"a": 5})
    for rid in "def":
        s.add_request(make_request(rid))
    # 5 wait, at least the 3 rows of one batched prefill: no more waiting; all five are admitted and
    # the prefill takes the oldest three.
    assert [c[0] for c in chunks(s.schedule())] == ["b", "c", "d"]
    assert list(s.running) == ["a", "b", "c", "d", "e", "f"]


def test_a_prompt_mid_prefill_lets_new_ones_join_its_forward():
    s = hold_back_scheduler(wait=5)
    s.config = EngineConfig(max_num_seqs=16, prefill_step_size=8, max_num_prefill_rows=3, prefill_wait_steps=5)
    s.add_request(make_request("a"))
    s.schedule()
    s.update({"a": 5})
    s.add_request(make_request("long", num_prompt=30))
    for _ in range(5):
        assert chunks(s.schedule()) == []
        s.update({"a": 5})
    assert chunks(s.schedule()) == [("long", 0, 8, False)]
    s.update({"a": 5})
    s.add_request(make_request("b"))
    assert chunks(s.schedule()) == [("long", 8, 4, False), ("b", 0, 4, True)]  # no wait: long is mid-prefill


def test_an_aborted_waiting_prompt_leaves_no_hold_behind():
    s = hold_back_scheduler(wait=3)
    s.add_request(make_request("a"))
    s.schedule()
    s.update({"a": 5})
    s.add_request(make_request("b"))
    assert chunks(s.schedule()) == []
    assert s.abort("b") is not None and s.num_waiting == 0
    s.update({"a": 5})
    s.add_request(make_request("c"))
    assert chunks(s.schedule()) == []  # c waits from its own arrival, not b's
    assert s.abort("a") is not None
    out = s.schedule()  # nothing decodes any more: c goes at once
    assert chunks(out) == [("c", 0, 4, True)]


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_split_prefill_budget_never_exceeds_the_budget(rows):
    rng = __import__("random").Random(rows)
    for _ in range(500):
        left = [rng.randint(1, 300) for _ in range(rng.randint(0, 12))]
        budget = rng.randint(1, 256)
        sizes = split_prefill_budget(left, budget, rows)
        assert all(0 <= n <= need for n, need in zip(sizes, left))
        busy = [n for n in sizes if n]
        assert sum(sizes) <= budget
        if rows > 1:  # one forward: rows x its longest chunk stay within the budget
            assert len(busy) <= rows and len(busy) * max(busy, default=0) <= budget
        assert left == [] or sizes[0] > 0  # the oldest always moves


def run_one(s: Scheduler, r: Request, tokens: list[int]) -> list[str | None]:
    """Feeds `tokens` to the only request, one step each; its finish reason after each step."""
    reasons = []
    for t in tokens:
        s.schedule()
        s.update({r.request_id: t})
        reasons.append(r.finish_reason)
    return reasons


def single(s: Scheduler, **kw) -> Request:
    r = make_request("x", **kw)
    s.add_request(r)
    return r


def test_finish_on_eos():
    s = make_scheduler()
    r = single(s)
    assert run_one(s, r, [5, 6, EOS]) == [None, None, "stop"]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [5, 6, EOS]
    assert "x" not in s.running
    assert s.schedule().finished_request_ids == ["x"]
    assert s.schedule().finished_request_ids == []  # reported once


def test_ignore_eos_keeps_going_until_max_tokens():
    s = make_scheduler()
    r = single(s, max_tokens=3, ignore_eos=True)
    assert run_one(s, r, [EOS, EOS, EOS]) == [None, None, "length"]
    assert r.num_output_tokens == 3


def test_finish_on_stop_token_id_even_with_ignore_eos():
    s = make_scheduler()
    r = single(s, stop_token_ids=(42,), ignore_eos=True)
    assert run_one(s, r, [5, 42]) == [None, "stop"]


def test_finish_on_max_tokens():
    s = make_scheduler()
    r = single(s, max_tokens=2)
    assert run_one(s, r, [5, 6]) == [None, "length"]
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_finish_on_max_model_len():
    s = make_scheduler(max_model_len=6)
    r = single(s, num_prompt=4, max_tokens=100)
    assert run_one(s, r, [5, 6]) == [None, "length"]
    assert r.num_prompt_tokens + r.num_output_tokens == 6


def test_update_ignores_unknown_and_finished_requests():
    s = make_scheduler()
    r = single(s, max_tokens=1)
    s.schedule()
    assert [f.request_id for f in s.update({"x": 5, "ghost": 9})] == ["x"]
    # A token still in flight for a request that already finished (pipelined decode) is dropped.
    assert s.update({"x": 6}) == []
    assert r.output_token_ids == [5]


def test_finish_from_outside_the_scheduler():
    """A stop string, found in the text outside the scheduler, ends the request through `update` too."""
    s = make_scheduler()
    r = single(s, max_tokens=3)
    s.schedule()
    # What the request keeps of a speculative run: up to EOS, or to max_tokens; nothing changes yet.
    assert s.num_kept(r, [5, EOS, 7]) == 2 and s.num_kept(r, [5, 6, 7, 8]) == 3 and r.output_token_ids == []
    assert [f.request_id for f in s.update({"x": [5, 6]}, stopped={"x"})] == ["x"]
    assert r.finish_reason == "stop" and r.output_token_ids == [5, 6]
    assert s.schedule().finished_request_ids == ["x"]
    assert s.update({"x": [9]}, stopped={"x"}) == []  # already gone: no-op
    assert s.schedule().finished_request_ids == [] and r.output_token_ids == [5, 6]


def test_abort_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a"))
    s.add_request(make_request("b"))
    s.schedule()
    aborted = s.abort("b")
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert aborted.finish_reason == "abort"
    assert s.num_waiting == 0
    # It never reached the runner, so there is nothing for the runner to free.
    assert s.schedule().finished_request_ids == []


def test_abort_running_request_is_reported_next_step():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a"))
    s.add_request(make_request("b"))
    s.schedule()
    assert s.abort("a").status is RequestStatus.FINISHED_ABORTED
    assert s.num_running == 0
    out = s.schedule()
    assert out.finished_request_ids == ["a"]
    assert list(s.running) == ["b"]  # the freed slot is used in the same step
    assert s.abort("a") is None
    assert s.abort("nobody") is None


def test_abort_while_prefilling_stops_its_chunks():
    s = make_scheduler(prefill_step_size=4, max_num_prefill_rows=1)
    s.add_request(make_request("a", num_prompt=12))
    s.add_request(make_request("b", num_prompt=4))
    assert chunks(s.schedule()) == [("a", 0, 4, False)]
    s.abort("a")
    out = s.schedule()
    assert out.finished_request_ids == ["a"]
    assert chunks(out) == [("b", 0, 4, True)]


def test_queue_full_past_max_num_waiting():
    s = make_scheduler(max_num_seqs=1, max_num_waiting=2)
    s.add_request(make_request("a"))
    s.add_request(make_request("b"))
    with pytest.raises(QueueFullError):
        s.add_request(make_request("c"))
    s.schedule()  # a is admitted: one waiting place frees up
    s.add_request(make_request("c"))
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_has_work_and_is_empty():
    s = make_scheduler()
    assert not s.has_work and s.schedule().is_empty
    r = single(s, max_tokens=1)
    assert s.has_work
    out = s.schedule()
    assert not out.is_empty
    s.update({"x": 5})
    assert r.finish_reason == "length"
    assert s.has_work  # the finished id must still reach the runner
    assert s.schedule().finished_request_ids == ["x"]
    assert not s.has_work


def test_full_lifecycle_many_requests():
    s = make_scheduler(max_num_seqs=3, prefill_step_size=6)
    for i in range(7):
        s.add_request(make_request(f"r{i}", num_prompt=2 + i, max_tokens=2 + i % 3))
    finished: list[str] = []
    for _ in range(200):
        out = s.schedule()
        assert len(s.running) <= 3
        new = {c.request_id: 9 for c in out.prefill_chunks if c.is_last} | {rid: 9 for rid in out.decode_request_ids}
        finished += [r.request_id for r in s.update(new)]
        if not s.has_work:
            break
    assert sorted(finished) == [f"r{i}" for i in range(7)]
    assert s.num_running == s.num_waiting == 0


def test_kv_budget_admits_while_rows_times_longest_fit():
    sched = Scheduler(EngineConfig(max_num_seqs=8), max_model_len=1024, kv_capacity=KVCapacity(100))
    for i in range(4):
        sched.add_request(make_request(f"r{i}", num_prompt=10, max_tokens=20))  # 30 tokens each
    sched.schedule()
    assert list(sched.running) == ["r0", "r1", "r2"] and sched.num_waiting == 1  # 3 x 30 <= 100 < 4 x 30
    # A longer request raises the rectangle for everyone: it waits behind until rows leave.
    sched.abort("r2")
    sched.add_request(make_request("long", num_prompt=10, max_tokens=40))
    sched.schedule()
    assert "r3" in sched.running and "long" not in sched.running  # r3 fits (3 x 30); then 4 x 50 > 100
    sched.abort("r0")
    sched.abort("r1")
    sched.schedule()
    assert "long" in sched.running  # 2 x 50 <= 100


def test_kv_budget_never_stalls_an_empty_engine():
    sched = Scheduler(EngineConfig(), max_model_len=1024, kv_capacity=KVCapacity(10))
    sched.add_request(make_request("big", num_prompt=10, max_tokens=20))
    sched.schedule()
    assert "big" in sched.running
