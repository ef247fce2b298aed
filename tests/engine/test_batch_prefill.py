"""Batched prefill: a burst of prompts of mixed lengths, prefilled several per forward (right-padded, over
prompt caches of different lengths: prefix-cache hits, chunks of earlier steps), gives greedy tokens
identical to one prompt per forward and to mlx-lm's own `generate_step`; families whose caches cannot
take padding keep one prompt per forward and stay identical too."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlxhost.engine.runner.prefill as runner_module
from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.batch_prefill import why_not_batched
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

BS = 16
NEW = 5
BATCHED = ["llama", "qwen3", "qwen3_moe", "phi3", "ministral3", "deepseek_v2"]  # plain KV and MLA
ONE_BY_ONE = ["gemma3_text", "qwen3_next"]  # a sliding window, recurrent state


@pytest.fixture(scope="module", params=BATCHED + ONE_BY_ONE)
def family(request, tmp_path_factory):
    name = request.param
    return name, load_model(str(build_family_folder(tmp_path_factory.mktemp(name), name)))


class Forwards(list):
    """Rows of every batched prefill forward the runner makes; `pad_to`, if set, overrides the runner's
    (1 off CUDA) so the padded first pass MLX-CUDA takes is checked here too."""

    pad_to: int | None = None


@pytest.fixture
def forwards(monkeypatch):
    sizes = Forwards()
    real = runner_module.prefill_rows

    def spy(model, caches, chunks, **kw):
        sizes.append(len(chunks))
        if sizes.pad_to is not None:
            kw["pad_to"] = sizes.pad_to
        return real(model, caches, chunks, **kw)

    monkeypatch.setattr(runner_module, "prefill_rows", spy)
    return sizes


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def reference(model, ids: list[int]) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=NEW, sampler=make_sampler(temp=0.0))]


def serve(loaded, prompts: list[list[int]], rows: int, warm: list[int] | None = None) -> list[list[int]]:
    config = EngineConfig(max_num_seqs=16, block_size=BS, cache_memory_bytes=32 << 20, prefill_step_size=48,
                          max_num_prefill_rows=rows)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="batch-prefill")
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    if warm is not None:  # its blocks are cached: prompts starting with it resume from there
        core.add_request(Request("warm", warm, params))
        while core.has_work:
            core.step()
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    for _ in range(1000):
        if not core.has_work:
            break
        for o in core.step():
            assert o.error is None, o.error
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_a_burst_prefilled_together_matches_one_at_a_time_and_mlx_lm(family, forwards):
    name, loaded = family
    shared = prompt(100, 2 * BS + 3)
    # 1 to 70 tokens: single tokens, chunks split over steps (budget 48), prefix hits of 2 blocks.
    prompts = [prompt(1, 1), prompt(2, 70), prompt(3, 9), shared[:2 * BS] + prompt(4, 30), prompt(5, 2),
               shared + prompt(6, 1), prompt(7, 33), prompt(8, 17)]
    together = serve(loaded, prompts, rows=8, warm=shared)
    batched = list(forwards)
    one_by_one = serve(loaded, prompts, rows=1, warm=shared)
    assert len(forwards) == len(batched)  # rows=1 never batches
    assert together == one_by_one, name
    assert together == [reference(loaded.model, p) for p in prompts], name
    if name in BATCHED:
        assert why_not_batched(loaded.model) is None
        assert max(batched) >= 4, batched
        forwards.pad_to = 13  # every first pass rounded up to a multiple of 13 tokens: more padding only
        assert serve(loaded, prompts, rows=8, warm=shared) == together, name
    else:
        assert why_not_batched(loaded.model) is not None and batched == [], name


@pytest.mark.parametrize("ends, picked", [
    ([10, 20, 30], [0, 1, 2]),
    ([5], []),  # one row: the plain path
    ([4000, 40, 60, 50], [1, 2, 3]),  # the long one alone: the rest would be 98% padding
    ([4000, 40], [0, 1]),  # two rows: never more than twice the real tokens
    ([1000, 1000, 10], [0, 1, 2]),  # one short row among long ones pads little
    ([5000, 5000, 10, 20], [2, 3]),  # long contexts run alone: no second copy of their KV
])
def test_rows_far_longer_than_the_rest_are_prefilled_alone(ends, picked):
    from mlxhost.engine.runner.batch_prefill import pick_rows

    assert pick_rows(ends) == picked
