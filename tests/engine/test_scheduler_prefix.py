"""The scheduler with a PrefixCacheManager and fake token ids: admission hits, store plans, aborts. No MLX."""

from __future__ import annotations

from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, RequestStatus, SamplingParams
from mlxhost.engine.scheduler import Scheduler
from mlxhost.kv.prefix_cache import PrefixCacheManager

BS = 4
TOKEN = 7  # every fake sampled token


def make_scheduler(max_num_seqs=4, prefill_step_size=512, num_blocks=32) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_num_seqs, prefill_step_size=prefill_step_size, block_size=BS)
    return Scheduler(config, max_model_len=1024, prefix=PrefixCacheManager(num_blocks, BS, "m"))


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def step(s: Scheduler):
    """One engine step without a model: every row that decodes or ends its prompt emits TOKEN."""
    out = s.schedule()
    emitting = out.decode_request_ids + [c.request_id for c in out.prefill_chunks if c.is_last]
    s.update({rid: TOKEN for rid in emitting})
    return out


def run_to_end(s: Scheduler, max_steps: int = 100) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.has_work:
            return outs
        outs.append(step(s))
    raise AssertionError("the scheduler did not finish")


def warm(s: Scheduler, prompt: list[int], max_tokens: int = 1) -> list[int]:
    """Runs one request to the end so its blocks are stored; returns its full token list."""
    s.add_request(r := make_request("warm", prompt, max_tokens))
    run_to_end(s)
    return r.prompt_token_ids + r.output_token_ids


def test_admission_takes_the_hit_and_prefill_starts_after_it():
    s = make_scheduler(prefill_step_size=2)
    warm(s, prompt_of(9))  # 9 prompt + 1 output token: blocks [0, 8) are stored
    assert s.prefix.pool.num_cached == 2
    r = make_request("r", prompt_of(8) + [5, 6, 7])
    s.add_request(r)
    out = s.schedule()
    assert len(r.cached_block_ids) == 2
    assert r.num_cached_tokens == 8 and r.num_computed_tokens == 10
    assert [(c.start, c.num_tokens, c.is_last) for c in out.prefill_chunks] == [(8, 2, False)]
    assert [(c.start, c.num_tokens, c.is_last) for c in s.schedule().prefill_chunks] == [(10, 1, True)]
    assert s.prefix.pool.num_used == 2  # held by r while it runs


def test_a_miss_computes_the_whole_prompt():
    s = make_scheduler()
    r = make_request("r", prompt_of(10))
    s.add_request(r)
    out = s.schedule()
    assert (r.cached_block_ids, r.num_cached_tokens) == ([], 0)
    assert [(c.start, c.num_tokens) for c in out.prefill_chunks] == [(0, 10)]


def test_prompt_of_whole_blocks_leaves_its_last_block_to_compute():
    s = make_scheduler()
    warm(s, prompt_of(12), max_tokens=2)
    r = make_request("r", prompt_of(12))
    s.add_request(r)
    out = s.schedule()
    assert r.num_cached_tokens == 8  # not 12: the last token must run for the first logits
    assert [(c.start, c.num_tokens, c.is_last) for c in out.prefill_chunks] == [(8, 4, True)]


def test_finish_plans_stores_in_the_next_schedule():
    s = make_scheduler()
    r = make_request("r", prompt_of(9), max_tokens=3)
    s.add_request(r)
    # The prompt's blocks are cached in the step after its first token (9 + 1 tokens: two blocks)...
    assert [{rid: [op.start for op in ops] for rid, ops in step(s).store_ops.items()} for _ in range(3)] == [
        {}, {"r": [0, 4]}, {}]
    assert r.status is RequestStatus.FINISHED_LENGTH
    out = s.schedule()
    assert out.finished_request_ids == ["r"]
    # ...and the third (prompt token 8 + three outputs) when it ends.
    ops = out.store_ops["r"]
    assert [op.start for op in ops] == [8]
    seq = r.prompt_token_ids + r.output_token_ids
    assert [op.token_ids for op in ops] == [tuple(seq[8:12])]
    assert s.prefix.pool.num_cached == 3
    assert s.prefix.pool.num_used == 1  # held until the runner copied it...
    s.schedule()
    assert s.prefix.pool.num_used == 0  # ...which the next step assumes
    # The output tokens' block serves a follow-up that continues the conversation.
    follow = make_request("f", r.prompt_token_ids + r.output_token_ids + [1, 2])
    s.add_request(follow)
    s.schedule()
    assert follow.num_cached_tokens == 12
    assert follow.cached_block_ids[-1:] == [op.block_id for op in ops]


def test_blocks_filled_while_decoding_are_stored_while_running():
    s = make_scheduler()
    r = make_request("r", prompt_of(9), max_tokens=10)
    s.add_request(r)
    stores = []
    while s.has_work:
        out = step(s)
        stores.append((r.num_tokens, {rid: [op.start for op in ops] for rid, ops in out.store_ops.items()}))
    # Planned in the step after the first token (the prompt's blocks) and after each token that filled a
    # block (12 and 16 tokens), while r still decodes; its end (19 tokens) fills no block.
    assert [(n, ops) for n, ops in stores if ops] == [(11, {"r": [0, 4]}), (13, {"r": [8]}), (17, {"r": [12]})]
    assert s.prefix.pool.num_cached == 4


def test_request_aborted_at_a_block_boundary_stores_it_once():
    s = make_scheduler()
    r = make_request("r", prompt_of(9), max_tokens=10)
    s.add_request(r)
    for _ in range(3):
        step(s)
    assert r.num_tokens == 12  # a block just filled: planned next schedule...
    s.abort("r")  # ...but the request ends first
    out = s.schedule()
    # The prompt's two blocks were stored after its first token: only the third is new.
    assert {rid: [op.start for op in ops] for rid, ops in out.store_ops.items()} == {"r": [8]}
    assert out.finished_request_ids == ["r"]


def test_stores_skip_the_requests_own_hit():
    s = make_scheduler()
    warm(s, prompt_of(9))
    r = make_request("r", prompt_of(9), max_tokens=3)
    s.add_request(r)
    for _ in range(3):
        step(s)
    assert r.num_cached_tokens == 8 and r.status is RequestStatus.FINISHED_LENGTH
    out = s.schedule()
    # Two blocks were hits; only the third (prompt token 8 + three outputs) is new.
    assert [op.start for op in out.store_ops.get("r", [])] == [8]


def test_two_requests_finishing_together_store_a_shared_block_once():
    s = make_scheduler()
    s.wait_for_inflight = False  # both compute the prompt side by side
    for rid in ("a", "b"):
        s.add_request(make_request(rid, prompt_of(9), max_tokens=1))
    step(s)
    out = s.schedule()
    assert out.finished_request_ids == ["a", "b"]
    assert [op.start for op in out.store_ops["a"]] == [0, 4]
    assert "b" not in out.store_ops
    assert s.prefix.pool.num_cached == 2


def test_request_aborted_while_waiting_plans_nothing_and_holds_nothing():
    s = make_scheduler(max_num_seqs=1)
    warm(s, prompt_of(9))
    queried = s.prefix.num_queried_tokens
    s.add_request(make_request("a", prompt_of(5, seed=2), max_tokens=8))
    s.add_request(make_request("b", prompt_of(9), max_tokens=8))
    step(s)
    assert s.abort("b").status is RequestStatus.FINISHED_ABORTED
    assert s.prefix.num_queried_tokens == queried + 5  # b was never looked up
    outs = run_to_end(s)
    assert all("b" not in o.store_ops and "b" not in o.finished_request_ids for o in outs)
    s.schedule()  # the step after the last stores: they count as copied
    assert s.prefix.pool.num_used == 0


def test_request_aborted_before_its_first_token_stores_the_chunks_it_prefilled():
    s = make_scheduler(prefill_step_size=4)
    warm(s, prompt_of(9))
    cached = s.prefix.pool.num_cached
    r = make_request("r", prompt_of(8) + prompt_of(10, seed=3))
    s.add_request(r)
    out = step(s)
    assert r.num_cached_tokens == 8 and not out.prefill_chunks[0].is_last
    assert s.prefix.pool.num_used == 2
    s.abort("r")
    out = s.schedule()
    # The chunk [8, 12) was computed before the abort: its block is copied from the prefill cache.
    assert out.finished_request_ids == ["r"]
    assert {rid: [op.start for op in ops] for rid, ops in out.store_ops.items()} == {"r": [8]}
    s.schedule()
    assert s.prefix.pool.num_used == 0 and s.prefix.pool.num_cached == cached + 1


def test_request_aborted_before_any_chunk_ran_plans_nothing():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", prompt_of(9, seed=2), max_tokens=8))
    s.add_request(r := make_request("r", prompt_of(9)))
    step(s)
    s.abort("r")  # still waiting
    out = s.schedule()
    assert "r" not in out.store_ops and r.num_computed_tokens == 0


def test_request_aborted_after_its_first_token_stores_what_it_computed():
    s = make_scheduler()
    r = make_request("r", prompt_of(9), max_tokens=100)
    s.add_request(r)
    step(s)
    # 9 + 1 tokens: the prompt's two full blocks are stored right after the first token.
    assert {rid: [op.start for op in ops] for rid, ops in step(s).store_ops.items()} == {"r": [0, 4]}
    assert r.num_output_tokens == 2
    s.abort("r")
    out = s.schedule()
    assert out.store_ops == {} and s.prefix.pool.num_cached == 2  # 11 tokens: nothing more to store


def test_reset_after_failure_leaves_no_held_blocks():
    s = make_scheduler(prefill_step_size=24)
    warm(s, prompt_of(9))
    # One request that just finished, one decoding with a hit, one mid-prefill with a hit.
    s.add_request(make_request("done", prompt_of(5, seed=5), max_tokens=1))
    s.add_request(make_request("dec", prompt_of(9), max_tokens=100))
    s.add_request(make_request("pre", prompt_of(8) + prompt_of(20, seed=4), max_tokens=100))
    step(s)
    assert s.running["dec"].num_output_tokens == 1 and not s.running["pre"].is_prefill_done
    assert s.prefix.pool.num_used == 2  # the two warm blocks, held by dec and pre
    # The failed step had store ops planned; the engine then aborts every request and resets.
    out = s.schedule()
    assert "done" in out.store_ops
    for rid in list(s.running):
        s.abort(rid)
    s.reset_after_failure()
    assert s.prefix.pool.num_used == 0 and s.prefix.pool.num_cached == 0
    assert not s.has_work
    out = s.schedule()
    assert out.store_ops == {} and out.finished_request_ids == []
    # And the cache works again afterwards.
    s.add_request(r := make_request("again", prompt_of(9), max_tokens=1))
    run_to_end(s)
    assert r.num_cached_tokens == 0 and s.prefix.pool.num_cached == 2


def test_a_prefill_only_request_stores_its_prompt_and_outputs_nothing():
    s = make_scheduler(prefill_step_size=4)
    s.add_request(r := make_request("p", prompt_of(10), max_tokens=0))
    run_to_end(s)
    assert r.output_token_ids == [] and r.status is RequestStatus.FINISHED_LENGTH
    assert s.prefix.pool.num_cached == 2  # the prompt's full blocks, nothing generated after them
    s.add_request(q := make_request("q", prompt_of(10)))
    s.schedule()
    assert q.num_cached_tokens == 8


def test_a_requests_keep_hint_marks_its_prompt_blocks_and_a_hit_renews_them():
    now = [0.0]
    config = EngineConfig(max_num_seqs=4, prefill_step_size=512, block_size=BS)
    s = Scheduler(config, max_model_len=1024, prefix=PrefixCacheManager(32, BS, "m", clock=lambda: now[0]))
    r = make_request("r", prompt_of(9), max_tokens=4)
    r.cache_ttl_s = 300.0
    s.add_request(r)
    run_to_end(s)
    pool = s.prefix.pool
    kept = [b for b in pool.blocks if b.keep_until]
    assert len(kept) == 2 and all(b.keep_until == 300.0 for b in kept)  # the prompt's blocks, not the output's
    now[0] = 100.0
    q = make_request("q", prompt_of(9), max_tokens=1)
    q.cache_ttl_s = 300.0
    s.add_request(q)
    run_to_end(s)
    assert q.num_cached_tokens == 8 and all(b.keep_until == 400.0 for b in kept)
