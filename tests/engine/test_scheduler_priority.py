"""Priority classes in the scheduler with fake token ids: admission order, aging, preemption under KV
pressure and the cheap resumption of preempted requests through the prefix cache. No model, no MLX."""

from __future__ import annotations

from collections import deque

from mlxhost.config import EngineConfig
from mlxhost.engine.priority import PriorityOrder
from mlxhost.engine.request import Request, RequestStatus, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.kv.prefix_cache import PrefixCacheManager
from mlxhost.memory.capacity import KVCapacity

BS = 4


def make_scheduler(max_num_seqs=4, kv_tokens=None, prefix=True, aging=0, prefill_step_size=512) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, block_size=BS, priority_aging_steps=aging,
                          prefill_step_size=prefill_step_size)
    return Scheduler(config, max_model_len=1024, prefix=PrefixCacheManager(64, BS, "m") if prefix else None,
                     kv_capacity=KVCapacity(kv_tokens))


def make_request(rid: str, priority: int = 0, num_prompt: int = 8, max_tokens: int = 8, **sampling) -> Request:
    seed = sum(map(ord, rid))
    return Request(rid, [seed * 100 + i for i in range(num_prompt)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling), priority=priority)


def token_of(request: Request) -> int:
    """A fake greedy model: the next token depends only on the sequence so far."""
    return (sum(request.prompt_token_ids) + 7 * request.num_output_tokens) % 1000 + 1


def step(s: Scheduler):
    """One engine step as the runner makes it: every decoding row emits one token; a prompt whose last
    chunk runs samples its first token, emitted (fed) at the next step."""
    out = s.schedule()
    s.update({rid: token_of(s.running[rid]) for rid in out.decode_request_ids})
    return out


def admitted(out) -> list[str]:
    return [c.request_id for c in out.prefill_chunks if c.start == 0 or c.is_last]


def test_admission_goes_by_class_then_arrival():
    s = make_scheduler(max_num_seqs=1, prefix=False)
    for rid, priority in [("batch", 10), ("a", 0), ("b", 0), ("urgent", -1)]:
        s.add_request(make_request(rid, priority, max_tokens=1))
    order = []
    while s.has_work:
        out = step(s)
        order += [c.request_id for c in out.prefill_chunks]
    assert order == ["urgent", "a", "b", "batch"]


def test_a_waiting_request_ages_past_a_stream_of_better_ones():
    # One slot, a new class-0 request every step; the class-3 one gets in after 3 classes' worth of aging.
    s = make_scheduler(max_num_seqs=1, prefix=False, aging=4)
    s.add_request(make_request("low", priority=3, max_tokens=1))
    for i in range(40):
        s.add_request(make_request(f"hi{i}", priority=0, max_tokens=1))
        out = step(s)
        if "low" in admitted(out):
            break
    else:
        raise AssertionError("the low class starved")
    assert 3 * 4 <= i < 40


def test_a_full_kv_of_low_priority_streams_makes_room_within_one_step():
    # KV for 4 rows of 8 + 8 tokens: four batch streams fill it.
    s = make_scheduler(kv_tokens=64)
    low = [make_request(f"low{i}", priority=10) for i in range(4)]
    for r in low:
        s.add_request(r)
    for _ in range(4):
        step(s)
    assert set(s.running) == {r.request_id for r in low} and all(r.num_output_tokens == 3 for r in low)
    s.add_request(make_request("high", priority=0))
    out = step(s)
    # It is admitted in the very next step and its whole prompt is prefilled there.
    assert [(c.request_id, c.start, c.is_last) for c in out.prefill_chunks] == [("high", 0, True)]
    victim = s.waiting[0]
    assert out.preempted_request_ids == [victim.request_id] == ["low3"]  # the latest arrival of the worst class
    assert victim.request_id in out.finished_request_ids and victim.request_id not in out.decode_request_ids
    # Its prompt and output so far are cached (or planned, copied before the runner drops its rows): 8 + 3
    # tokens, 2 full blocks.
    assert victim.status is RequestStatus.WAITING
    assert all(map(s.prefix.is_cached, s.prefix.hashes(victim.prefill_token_ids, victim.block_key_spans)))
    assert victim.num_replayed_tokens == 3 and victim.num_computed_tokens == 0
    assert victim.prefill_token_ids == victim.prompt_token_ids + victim.output_token_ids
    while victim.status is RequestStatus.WAITING:  # until the other low streams end and free their KV
        out = step(s)
    # It resumes from the cache, recomputing only what no full block holds.
    (chunk,) = out.prefill_chunks
    assert (chunk.request_id, chunk.start, chunk.num_tokens, chunk.is_last) == ("low3", 8, 3, True)
    assert victim.num_cached_tokens == 8


def test_preempted_streams_end_with_the_tokens_they_would_have_had():
    def run(with_high: bool) -> dict[str, list[int]]:
        s = make_scheduler(kv_tokens=4 * 19)  # the four low streams at their longest
        requests = [make_request(f"low{i}", priority=10, num_prompt=8 + i) for i in range(4)]
        for r in requests:
            s.add_request(r)
        for n in range(60):
            if with_high and n in (3, 6):
                s.add_request(make_request(f"high{n}", priority=0, num_prompt=5))
            step(s)
        assert not s.has_work
        if with_high:
            assert s.num_preemptions == 2
        return {r.request_id: r.output_token_ids for r in requests}

    assert run(with_high=True) == run(with_high=False)


def test_equal_classes_never_preempt_however_long_one_waited():
    s = make_scheduler(max_num_seqs=1, aging=1)
    s.add_request(make_request("first", max_tokens=30))
    step(s)
    s.add_request(make_request("second"))
    for _ in range(10):
        out = step(s)
        assert not out.preempted_request_ids
    assert list(s.running) == ["first"]


def test_a_batch_request_admitted_after_aging_is_not_preempted_by_its_peers_class():
    s = make_scheduler(max_num_seqs=1, aging=2)
    s.add_request(make_request("a", priority=0, max_tokens=6))
    s.add_request(make_request("batch", priority=2, max_tokens=20))
    while "batch" not in s.running:
        step(s)
    s.add_request(make_request("b", priority=0))
    for _ in range(5):
        assert not step(s).preempted_request_ids
    assert list(s.running) == ["batch"]


def test_requests_whose_recompute_could_differ_are_not_preempted():
    s = make_scheduler(max_num_seqs=2, prefix=False)
    s.add_request(make_request("seeded", priority=5, temperature=0.8, seed=3))
    s.add_request(make_request("penalized", priority=5, presence_penalty=0.5))
    step(s)
    s.add_request(make_request("high", priority=0))
    out = step(s)
    assert not out.preempted_request_ids and list(s.running) == ["seeded", "penalized"]


def test_slots_full_of_low_priority_streams_also_preempt():
    s = make_scheduler(max_num_seqs=2, prefix=False)
    s.add_request(make_request("low0", priority=1))
    s.add_request(make_request("low1", priority=1))
    step(s)
    s.add_request(make_request("high", priority=0))
    out = step(s)
    assert out.preempted_request_ids == ["low1"] and admitted(out) == ["high"]


def test_aborting_a_preempted_request_drops_it_from_the_queue():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("low", priority=1))
    step(s)
    s.add_request(make_request("high", priority=0))
    step(s)
    assert s.abort("low").status is RequestStatus.FINISHED_ABORTED
    while s.has_work:
        step(s)
    assert not s.waiting and not s.running


def test_the_priority_order_alone():
    """PriorityOrder (engine/priority.py) without a scheduler: ranks age with the steps, the queue sorts by rank
    then arrival, and a newcomer's victims are the worst admitted classes, latest arrivals first."""
    order = PriorityOrder(EngineConfig(priority_aging_steps=2))
    low, mid, late_low = make_request("low", 5), make_request("mid", 3), make_request("late", 5)
    for r in (low, mid, late_low):
        order.arrive(r)
    assert [r.request_id for r in order.sorted(deque([low, mid, late_low]))] == ["mid", "low", "late"]
    for _ in range(4):
        order.tick()
    assert (order.rank(low), order.num_waited_steps(low)) == (3, 4)  # two classes better after four steps
    for r in (low, mid, late_low):
        order.admit(r)
    best = make_request("best", 0)
    order.arrive(best)
    assert [r.request_id for r in order.victims([low, mid, late_low], best)] == ["late", "low", "mid"]
    order.preempted("late")
    order.forget("low")
    assert order.admitted_rank("mid") == 1 and order.rank(late_low) == 3  # arrival kept, admitted rank gone
