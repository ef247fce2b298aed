"""Quantized KV on the layer stacks other than plain KV: which layers get quantized, and
that a request alone, among 8 concurrent rows and on a prefix-cache hit gives the same greedy tokens.

* sliding window (gemma3_text): the global layer is quantized, the sliding one stays float;
* hybrid (qwen3_next): the attention layer is quantized, the recurrent state never is;
* MLA (deepseek_v2): no layer can be (DeepSeek's attention multiplies the cached rope part itself): float KV,
  with a note in /v1/status;
* attention sinks (gpt_oss): mlx-lm's quantized attention refuses sinks, so the global layer's quantized KV
  is dequantized per layer for float attention (which takes sinks), with a note;
* head dim 16 (nemotron_h): no supported group size divides it: a clear error.
"""

from __future__ import annotations

import random

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

BS = 16
NEW = 10
# family -> (layers quantized of 2, words the plan's note must contain, how attention reads them)
EXPECTED = {
    "gemma3_text": (1, "RotatingKVCache", "quantized attention"),
    "qwen3_next": (1, "ArraysCache", "quantized attention"),
    "deepseek_v2": (0, "MLA", None),
    "gpt_oss": (1, "sinks", "dequantized per layer"),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def family(request, tmp_path_factory):
    name = request.param
    return name, load_model(str(build_family_folder(tmp_path_factory.mktemp(name), name)))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 32 << 20,
                             "kv_bits": 8, "kv_group_size": 32, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="family-fixture")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def run(core: EngineCore, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    for rid, p in prompts.items():
        core.add_request(Request(rid, p, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)))
    out: dict[str, tuple[list[int], int]] = {}
    for _ in range(5000):
        if not core.has_work:
            return out
        for o in core.step():
            assert o.error is None, o.error
            ids, cached = out.get(o.request_id, ([], 0))
            out[o.request_id] = (ids + o.new_token_ids, max(cached, o.num_cached_tokens))
    raise AssertionError("the engine did not finish")


def test_quantized_layers_alone_among_8_and_on_a_hit(family):
    name, loaded = family
    num_quantized, note, attention = EXPECTED[name]
    prompts = {f"r{i}": prompt(100 + i, 20 + 5 * i) for i in range(8)}
    alone = make_core(loaded, enable_prefix_cache=False)
    plan = alone.kv_quant
    assert len(plan.layers) == num_quantized and note in plan.note, plan
    assert alone.status()["kv_quantization"]["quantized_layers"] == num_quantized
    assert alone.status()["kv_quantization"]["attention"] == attention
    expected = {rid: run(alone, {rid: p})[rid][0] for rid, p in prompts.items()}
    core = make_core(loaded)
    together = run(core, prompts)
    assert {rid: ids for rid, (ids, _) in together.items()} == expected
    # The longest prompt again: served from the prefix cache (as far as the layout allows), same tokens.
    ids, cached = run(core, {"again": prompts["r7"]})["again"]
    assert ids == expected["r7"] and cached > 0


def test_a_group_size_that_divides_no_head_dim_is_a_clear_error(tmp_path):
    loaded = load_model(str(build_family_folder(tmp_path / "nemotron_h", "nemotron_h")))  # head_dim 16
    with pytest.raises(ValueError, match=r"kv_group_size 32 must divide the attention head dim \(16\)$"):
        make_core(loaded)


def test_ssd_restart_gives_the_same_tokens(family, tmp_path):
    """Quantized full-attention blocks next to float sliding-window blocks (or recurrent snapshots) on
    disk: a restarted engine resumes from them with the tokens of a cold run."""
    _, loaded = family
    long_prompt = prompt(200, 3 * BS + 7)
    expected = run(make_core(loaded, enable_prefix_cache=False), {"cold": long_prompt})["cold"][0]
    first = make_core(loaded, ssd_cache_dir=str(tmp_path))
    assert run(first, {"a": long_prompt})["a"] == (expected, 0)
    first.close()
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    ids, cached = run(second, {"b": long_prompt})["b"]
    assert ids == expected and cached > 0 and second.cache_stats()["ssd"]["hits"] > 0
    second.close()
