"""Priority preemption inside the engine core, on tiny fixture models of the cache families (plain KV,
sliding window, recurrent state, MLA): with the KV budget full of low-priority streams a high-priority
request starts at once, and the preempted streams, resumed from the prefix cache, finish with the greedy
tokens mlx-lm's own `generate_step` gives."""

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
from mlxhost.testing.families import build_family_folder

BS = 16
PROMPT, NEW = 40, 24
NUM_LOW = 4


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_next", "deepseek_v2"])
def loaded(request, tmp_path_factory):
    return load_model(str(build_family_folder(tmp_path_factory.mktemp(request.param), request.param)))


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def reference(model, ids: list[int], n: int = NEW) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=make_sampler(temp=0.0))
    return [int(t) for t, _ in steps]


def add(core: EngineCore, rid: str, ids: list[int], priority: int) -> None:
    core.add_request(Request(rid, ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                             priority=priority))


def test_a_high_priority_request_preempts_and_the_preempted_streams_match_greedy(loaded):
    # The KV budget holds exactly the low streams at their longest: the high one fits only by preempting.
    config = EngineConfig(max_num_seqs=NUM_LOW, block_size=BS, cache_memory_bytes=32 << 20,
                          kv_budget_tokens=NUM_LOW * (PROMPT + NEW), prefill_step_size=256)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="priority-fixture")
    prompts = {f"low{i}": prompt(i) for i in range(NUM_LOW)}
    prompts["high"] = prompt(99, 20)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid in list(prompts)[:NUM_LOW]:
        add(core, rid, prompts[rid], priority=10)
    steps_of_high = None
    for n in range(2000):
        if n == 8:
            add(core, "high", prompts["high"], priority=0)
            steps_of_high = 0
        if not core.has_work:
            break
        if steps_of_high is not None and not got["high"]:
            steps_of_high += 1
        for out in core.step():
            assert out.error is None, out.error
            got[out.request_id] += out.new_token_ids
    else:
        raise AssertionError("the engine did not finish")
    assert core.scheduler.num_preemptions >= 1
    # Admitted, prefilled (one chunk) and its first token out in the first step after it arrived.
    assert steps_of_high == 1
    for rid, ids in prompts.items():
        assert got[rid] == reference(loaded.model, ids), rid
