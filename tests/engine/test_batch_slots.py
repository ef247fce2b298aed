"""Joins into filler slots (engine/runner/batch.py `_fill_slots`): with bucketed batch sizes a finished row stays
as a filler and a later prompt is written into its slot in place. Greedy tokens stay identical to each
prompt decoded alone (mlx-lm's `generate_step`), with staggered arrivals of mixed lengths, a slot refilled
several times, rows longer than the batch's width (which take the old extend path) and the trim of
shared left padding."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlxhost.engine.runner.batch as batch_module
from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def reference(model, ids: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(temp=0.0))]


@pytest.fixture
def fills(monkeypatch):
    """How many rows each join wrote into slots (0: the join took the extend path)."""
    counts: list[int] = []
    real = batch_module.DecodeBatch._fill_slots

    def spy(self, request_ids, *args):
        done = real(self, request_ids, *args)
        counts.append(len(request_ids) if done else 0)
        return done

    monkeypatch.setattr(batch_module.DecodeBatch, "_fill_slots", spy)
    return counts


def run_staggered(loaded, arrivals: list[tuple[int, list[int], int]], trim_at: int | None = None,
                  monkeypatch=None, cuts: list[int] | None = None, core: EngineCore | None = None,
                  tag: str = "r", pads_read: bool = True) -> dict[str, list[int]]:
    """arrivals: (step at which it arrives, prompt, max_tokens). With `trim_at`, `cuts` collects how many
    positions each trim cut."""
    if trim_at is not None:
        real_trim = batch_module.DecodeBatch._trim

        def trim(self):
            before = self.cache[0].state[4]
            real_trim(self, trim_at)
            cuts.append(before - self.cache[0].state[4])

        monkeypatch.setattr(batch_module.DecodeBatch, "_trim", trim)
    if core is None:
        config = EngineConfig(max_num_seqs=8, enable_prefix_cache=False)
        core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, buckets=[1, 2, 4, 8])
    out: dict[str, list[int]] = {}
    step = 0
    pads_checked: list[int] = []
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    while pending or core.has_work:
        while pending and pending[0][1][0] <= step:
            i, (_, ids, n) = pending.pop(0)
            core.add_request(Request(f"{tag}{i}", ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                                       ignore_eos=True)))
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        held = core.runner.batch
        if held._pads is not None:  # the host copy of the rows' left padding never goes stale
            assert held._pads == held.cache[0].state[3].tolist()
            pads_checked.append(step)
        step += 1
        assert step < 2000
    assert pads_checked or not pads_read  # blocks were stored or slots trimmed through the host copy
    return out


def test_staggered_joins_fill_slots_and_keep_the_tokens(loaded, fills):
    # Four long-running rows, then short ones arriving while they decode: each short one finishes and
    # leaves a slot that the next arrival takes.
    arrivals = [(0, prompt(i, 30 + 7 * i), 40) for i in range(4)]
    arrivals += [(3 + 4 * k, prompt(100 + k, 5 + 3 * (k % 4)), 3 + k % 3) for k in range(10)]
    out = run_staggered(loaded, arrivals)
    for i, (_, ids, n) in enumerate(arrivals):
        assert out[f"r{i}"] == reference(loaded.model, ids, n), f"r{i}"
    assert sum(fills) >= 5  # most later arrivals went into slots


def test_rows_of_a_batched_prefill_join_as_views_of_it(loaded, fills):
    """Prompts prefilled together join the decode batch as views of the prefill's batch cache (no copy
    per row); a row of the same prefill that goes on keeps a copy of its own. Bursts of mixed lengths
    arrive while rows decode, with 48 prompt tokens a step, so some prefills finish only part of their rows."""
    arrivals = [(0, prompt(31, 40), 45), (0, prompt(32, 12), 45)]
    arrivals += [(4, prompt(500 + k, 3 + 9 * k), 5 if k < 3 else 30) for k in range(5)]
    arrivals += [(14, prompt(600 + k, 25 - 6 * k), 4 + k) for k in range(3)]
    arrivals += [(26, prompt(700 + k, (60, 12, 9)[k]), 3) for k in range(3)]
    config = EngineConfig(max_num_seqs=8, enable_prefix_cache=False, prefill_step_size=48)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, buckets=[1, 2, 4, 8])
    out = run_staggered(loaded, arrivals, core=core)
    for i, (_, ids, n) in enumerate(arrivals):
        assert out[f"r{i}"] == reference(loaded.model, ids, n), f"r{i}"
    assert sum(fills) >= 4 and 0 in fills  # rows went into slots, and some joins took the extend path


def test_a_row_longer_than_the_batch_takes_the_extend_path(loaded, fills):
    arrivals = [(0, prompt(1, 6), 30), (0, prompt(2, 9), 30), (0, prompt(3, 7), 4),
                (6, prompt(4, 80), 5), (12, prompt(5, 4), 5)]
    out = run_staggered(loaded, arrivals)
    for i, (_, ids, n) in enumerate(arrivals):
        assert out[f"r{i}"] == reference(loaded.model, ids, n), f"r{i}"
    assert 0 in fills  # the 80-token prompt: longer than the batch's width


def test_trimmed_left_padding_keeps_the_tokens(loaded, fills, monkeypatch):
    # r1 (no left padding) leaves early; r0 and r2 keep theirs while short rows come and go in the slots.
    arrivals = [(0, prompt(7, 12), 60), (0, prompt(8, 20), 12), (0, prompt(9, 15), 60)]
    arrivals += [(10 + 6 * k, prompt(200 + k, 6 + k), 6) for k in range(6)]
    cuts: list[int] = []
    out = run_staggered(loaded, arrivals, trim_at=4, monkeypatch=monkeypatch, cuts=cuts)
    for i, (_, ids, n) in enumerate(arrivals):
        assert out[f"r{i}"] == reference(loaded.model, ids, n), f"r{i}"
    assert sum(fills) >= 3 and max(cuts) >= 4


@pytest.mark.parametrize("cuda_like", [False, True])
def test_blocks_stored_from_slot_rows_give_the_same_tokens_on_a_hit(loaded, fills, cuda_like):
    """Rows written into slots store their prompt blocks (read back through their left padding); the same
    prompts again resume from those blocks and decode the same tokens. `cuda_like`: with what MLX-CUDA
    changes (batched prefill padded to 32-token shapes) and MLXHOST_STEP_SYNC's waits after each phase."""
    config = EngineConfig(max_num_seqs=8, block_size=16, cache_memory_bytes=64 << 20)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, buckets=[1, 2, 4, 8])
    if cuda_like:
        core.runner.prefiller.pad_to, core.runner.sync_phases = 32, True
    arrivals = [(0, prompt(11, 20), 50), (0, prompt(12, 26), 50)]
    arrivals += [(4 + 5 * k, prompt(300 + k, 34 + 3 * k), 4) for k in range(6)]
    first = run_staggered(loaded, arrivals, core=core, tag="a")
    assert sum(fills) >= 3
    hits_before = core.prefix.num_hit_tokens
    again = run_staggered(loaded, arrivals, core=core, tag="b")
    assert core.prefix.num_hit_tokens - hits_before >= 6 * 32  # every short prompt hit its stored blocks
    for i, (_, ids, n) in enumerate(arrivals):
        expected = reference(loaded.model, ids, n)
        assert first[f"a{i}"] == expected and again[f"b{i}"] == expected, i


def test_speculative_rewinds_keep_slots_and_stored_blocks_right(loaded, fills):
    """n-gram speculation rewinds each row by what it rejected, rolling rows into their left padding: the
    batch's host copy of the padding must follow, or blocks are read from the wrong positions. Echo-like
    prompts (a phrase repeated) make drafts that are partly accepted, so rows rewind by different counts."""
    config = EngineConfig(max_num_seqs=8, block_size=16, cache_memory_bytes=64 << 20, speculative="ngram",
                          spec_max_batch=8)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, buckets=[1, 2, 4, 8])

    def echo(seed: int, n: int) -> list[int]:
        phrase = prompt(seed, 6)
        return (phrase * (n // 6 + 1))[:n]

    arrivals = [(0, echo(21, 40), 40), (0, echo(22, 44), 40)]
    arrivals += [(3 + 4 * k, echo(400 + k, 34 + 3 * k), 6) for k in range(6)]
    first = run_staggered(loaded, arrivals, core=core, tag="a", pads_read=False)
    again = run_staggered(loaded, arrivals, core=core, tag="b", pads_read=False)
    assert core.prefix.num_hit_tokens >= 6 * 32
    assert sum(fills) >= 3 and core.runner.spec.stats.num_accepted > 0  # slots taken, drafts accepted
    for i, (_, ids, n) in enumerate(arrivals):
        expected = reference(loaded.model, ids, n)
        assert first[f"a{i}"] == expected and again[f"b{i}"] == expected, i
