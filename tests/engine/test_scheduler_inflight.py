"""Prefill blocks stored chunk by chunk, and requests that wait for another's in-flight blocks instead of
computing them again. The scheduler with a PrefixCacheManager and fake token ids; no MLX."""

from __future__ import annotations

from mlxhost.engine.request import RequestStatus
from mlxhost.kv.inflight import InflightBlocks
from tests.engine.test_scheduler_prefix import BS, make_request, make_scheduler, prompt_of, run_to_end, step


def stored(out) -> dict[str, list[int]]:
    return {rid: [op.start for op in ops] for rid, ops in out.store_ops.items()}


def test_each_prefill_chunk_stores_its_full_blocks_in_the_next_step():
    s = make_scheduler(prefill_step_size=6)
    r = make_request("r", prompt_of(17), max_tokens=2)
    s.add_request(r)
    plans = [(step(s), r.num_computed_tokens) for _ in range(4)]
    # Chunks end at 6, 12, 17 (the last); each step stores what the chunks before it completed.
    assert [(stored(o), n) for o, n in plans] == [({}, 6), ({"r": [0]}, 12), ({"r": [4, 8]}, 17), ({"r": [12]}, 17)]
    assert s.prefix.pool.num_cached == 4


def test_blocks_stored_mid_prefill_are_not_stored_again_at_the_end():
    s = make_scheduler(prefill_step_size=8)
    r = make_request("r", prompt_of(20), max_tokens=5)
    s.add_request(r)
    starts = [start for out in run_to_end(s) for ops in out.store_ops.values() for start in (op.start for op in ops)]
    s.schedule()
    assert sorted(starts) == starts and len(set(starts)) == len(starts) == (20 + 5) // BS
    assert s.prefix.pool.num_used == 0


def test_an_identical_prompt_waits_for_the_owner_then_takes_the_hit():
    s = make_scheduler(prefill_step_size=4)
    a, b = make_request("a", prompt_of(17)), make_request("b", prompt_of(17))
    s.add_request(a)
    s.add_request(b)
    other = make_request("c", prompt_of(6, seed=9))
    s.add_request(other)  # behind b, sharing nothing: it runs while b waits
    first = step(s)
    assert sorted(c.request_id for c in first.prefill_chunks) == ["a", "c"]
    assert "b" not in s.running and b.status is RequestStatus.WAITING and "c" in s.running
    for _ in range(20):
        out = step(s)
        if "b" in s.running:
            break
    # a's last blocks were planned in the step after its first token and copied in the one after that,
    # when b is admitted with all of the prompt cached but its last token.
    assert a.num_output_tokens >= 1 and b.num_cached_tokens == 16
    assert [(c.request_id, c.start, c.num_tokens, c.is_last) for c in out.prefill_chunks] == [("b", 16, 1, True)]
    run_to_end(s)
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH


def test_the_waiter_computes_itself_when_the_owner_aborts():
    s = make_scheduler(prefill_step_size=4)
    a, b = make_request("a", prompt_of(17)), make_request("b", prompt_of(17))
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert stored(step(s)) == {"a": [0]}  # a computed [0, 8): its first chunk's block is stored
    assert "b" not in s.running
    s.abort("a")
    out = step(s)  # the second chunk's block is planned from a's prefill cache...
    assert stored(out) == {"a": [4]} and "b" not in s.running  # ...and b waits for its copy
    out = step(s)
    assert b.num_cached_tokens == 8 and [(c.start, c.num_tokens) for c in out.prefill_chunks] == [(8, 4)]
    run_to_end(s)
    assert b.status is RequestStatus.FINISHED_LENGTH and not len(s.inflight)


def test_the_waiter_computes_everything_when_the_owner_fails():
    s = make_scheduler(prefill_step_size=4)
    s.add_request(make_request("a", prompt_of(17)))
    s.add_request(b := make_request("b", prompt_of(17)))
    step(s)
    s.fail("a")  # its prefill raised: none of its KV is trusted
    out = step(s)
    assert out.store_ops == {} and b.num_cached_tokens == 0
    assert [(c.request_id, c.start) for c in out.prefill_chunks] == [("b", 0)]


def test_a_shared_head_is_waited_for_only_until_it_is_stored():
    s = make_scheduler(prefill_step_size=4)
    a = make_request("a", prompt_of(8) + prompt_of(20, seed=2))
    b = make_request("b", prompt_of(8) + prompt_of(6, seed=3))
    s.add_request(a)
    s.add_request(b)
    while "b" not in s.running:
        step(s)
    # b was let in once a's first two blocks were copied, long before a's prompt ended.
    assert b.num_cached_tokens == 8 and not a.is_prefill_done


def test_without_waiting_both_compute_the_prompt():
    s = make_scheduler(prefill_step_size=4)
    s.wait_for_inflight = False
    s.add_request(a := make_request("a", prompt_of(17)))
    s.add_request(b := make_request("b", prompt_of(17)))
    step(s)
    assert "b" in s.running and a.num_cached_tokens == b.num_cached_tokens == 0


def test_aligned_chunks_end_on_block_boundaries():
    s = make_scheduler(prefill_step_size=6)
    s.align_chunks = True
    s.add_request(r := make_request("r", prompt_of(23)))
    ends = []
    while not r.is_prefill_done:
        ends += [c.start + c.num_tokens for c in step(s).prefill_chunks]
    assert ends == [4, 8, 12, 16, 20, 23]


def test_inflight_table_owner_release_and_copy():
    t = InflightBlocks()
    t.claim("a", [b"1", b"2", b"3"])
    t.claim("b", [b"2", b"4"])  # b2 is a's already
    assert t.owner(b"2") == "a" and t.owner(b"4") == "b"
    cached = {b"0"}
    assert t.waits_for([b"0", b"1"], cached.__contains__) == "a"
    assert t.waits_for([b"9", b"1"], cached.__contains__) is None  # its own miss comes first
    t.planned([b"1"])
    t.release("a")  # a ends: its unplanned blocks are no one's; the planned one lands at the copy
    assert t.owner(b"1") == "a" and t.owner(b"2") is None and t.owner(b"3") is None
    t.copied()
    assert t.owner(b"1") is None and len(t) == 1
