"""Every model family mlx-lm loads serves through the engine: greedy tokens identical to mlx-lm's own
`generate_step`, alone, among 8 concurrent requests, and joining a running batch; a long generation
with the prefix cache on (every family caches its blocks: plain KV, MLA, sliding windows, recurrent state)
completes and the same prompt again hits.

One tiny random-weight fixture per family (`mlxhost.testing.families`), built once per module.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.families import FAMILIES, build_family_folder

BS = 16
NEW = 6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    path = build_family_folder(tmp_path_factory.mktemp(name), name)
    return name, load_model(str(path))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 32 << 20, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="family-fixture")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def reference(model, ids: list[int], n: int = NEW) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(temp=0.0))
    return [int(t) for t, _ in steps]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def drain(core: EngineCore, limit: int = 5000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(limit):
        if not core.has_work:
            return out
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish")


def test_alone_concurrent_and_joining_match_mlx_lm(family):
    name, loaded = family
    core = make_core(loaded)
    prompts = [prompt(i, 5 + 7 * i) for i in range(8)]
    expected = [reference(loaded.model, p) for p in prompts]

    core.add_request(Request("alone", prompts[0], greedy()))
    assert drain(core)["alone"] == expected[0], name

    for i, p in enumerate(prompts):
        core.add_request(Request(f"c{i}", p, greedy()))
    got = drain(core)
    assert [got[f"c{i}"] for i in range(8)] == expected, name

    # Two requests run a few steps, then two more join the running batch.
    long = greedy(NEW + 6)
    core.add_request(Request("r0", prompts[1], long))
    core.add_request(Request("r1", prompts[2], long))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for o in core.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    core.add_request(Request("j0", prompts[3], greedy()))
    core.add_request(Request("j1", prompts[4], greedy()))
    for rid, ids in drain(core).items():
        got.setdefault(rid, []).extend(ids)
    assert got["r0"] == reference(loaded.model, prompts[1], NEW + 6), name
    assert got["r1"] == reference(loaded.model, prompts[2], NEW + 6), name
    assert [got["j0"], got["j1"]] == expected[3:5], name


def test_many_block_boundaries_with_the_prefix_cache_on(family):
    name, loaded = family
    core = make_core(loaded)
    assert core.prefix is not None, name
    p = prompt(99, 3 * BS + 5)
    n = 5 * BS  # the decode crosses five block boundaries, each cached as it fills
    core.add_request(Request("long", p, greedy(n)))
    first = drain(core)["long"]
    assert first == reference(loaded.model, p, n), name
    core.add_request(Request("again", p, greedy(n)))
    assert drain(core)["again"] == first
    assert core.cache_stats()["num_cached_blocks"] >= 3 + 5
    # The prompt and the whole answer: resumed at the last block boundary of the answer at least.
    follow = p + first + prompt(98, 3)
    core.add_request(Request("follow", follow, greedy()))
    out = core.step()
    assert out and out[0].num_cached_tokens >= len(p + first) // BS * BS - BS, name
    assert out[0].new_token_ids + drain(core)["follow"] == reference(loaded.model, follow), name
