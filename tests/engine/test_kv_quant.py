"""Quantized KV (`--kv-bits`) in the engine, on the tiny qwen3 fixture (float32, head_dim 32, so group 32):

* logits stay within a stated tolerance of float KV over a prompt and a decode;
* greedy tokens are identical to a plain loop over mlx-lm's QuantizedKVCache (our per-request subclass),
  for a request alone, among 8 concurrent rows and joining a running batch;
* prefix-cache hits (memory and SSD tier after a restart) give the same tokens as no cache; blocks
  written under other KV settings are a miss, never served;
* the flags are validated, and the budget counts the smaller bytes per token (capacity ×1.8 / ×3 against
  bf16 KV, on a bf16 fixture with head_dim 64 and the default group 64).

Each runs in both attention modes: "quantized" (MLX's quantized matmuls, what Metal and the CPU run) and
"dequantized" (float copies of each layer's KV, what the plan picks where those kernels reject the shapes,
as MLX-CUDA's do); the KV kept is the same. The plan's choice between them is tested with a probe that
raises as MLX-CUDA's quantized matmul does.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.kv.kinds.kv_quant import DEQUANTIZED, QUANTIZED_ATTENTION, plan_kv_quant, probe_attention
from mlxhost.kv.kinds.quantized import BatchQuantizedKVCache
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import DemoModelConfig, build_model_folder

BS = 16
GS = 32  # the fixture's head_dim is 32
NEW = 8
MODES = ["quantized", "dequantized"]


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 32 << 20,
                             "kv_group_size": GS, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="qwen3-fixture")


def drain(core: EngineCore) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for _ in range(10_000):
        if not core.has_work:
            return out
        for o in core.step():
            assert o.error is None, o.error
            entry = out.setdefault(o.request_id, {"ids": [], "cached": 0})
            entry["ids"] += o.new_token_ids
            entry["cached"] = max(entry["cached"], o.num_cached_tokens)
    raise AssertionError("the engine did not finish")


def one(core: EngineCore, prompt: list[int], rid: str = "r") -> dict:
    core.add_request(Request(rid, prompt, greedy()))
    return drain(core)[rid]


def reference(model, prompt: list[int], bits: int, n: int = NEW, mode: str = "quantized") -> list[int]:
    """Greedy decoding through per-request quantized caches alone (mlx-lm's QuantizedKVCache from
    the first token): prompt but the last token in one forward, then one token at a time."""
    cache = plan_kv_quant(model, bits, GS, mode).make_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    token, out = prompt[-1], []
    for _ in range(n):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]))
        out.append(token)
    return out


# -- accuracy --------------------------------------------------------------------------------------------


def _logits(model, make_cache, prompt: list[int], fed: list[int]) -> mx.array:
    cache = make_cache(model)
    rows = [model(mx.array([prompt]), cache=cache)[0]]
    rows += [model(mx.array([[t]]), cache=cache)[0] for t in fed]
    return mx.concatenate(rows).astype(mx.float32)


@pytest.mark.parametrize("mode", MODES)
def test_logits_stay_within_tolerance_of_float_kv(loaded, mode):
    """Max abs logit difference over a 64-token prompt and 32 decode steps (fed the float run's greedy
    tokens, so both see the same inputs). Measured on this fixture (logit std ~1.1, range ~10):
    8-bit 0.07 max / 0.009 mean, 4-bit 1.04 / 0.15, in both modes. Bounds: 8-bit 0.15 / 0.02, 4-bit 1.5 / 0.25."""
    model = loaded.model
    prompt = tokens(0, 64)
    fed, cache = [], make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    for _ in range(32):
        fed.append(int(mx.argmax(logits)))
        logits = model(mx.array([[fed[-1]]]), cache=cache)[0, -1]
    base = _logits(model, make_prompt_cache, prompt, fed)
    diffs = {}
    for bits, max_bound, mean_bound in ((8, 0.15, 0.02), (4, 1.5, 0.25)):
        d = mx.abs(_logits(model, plan_kv_quant(model, bits, GS, mode).make_cache, prompt, fed) - base)
        diffs[bits] = d.max().item()
        assert diffs[bits] < max_bound and d.mean().item() < mean_bound, (bits, diffs[bits], d.mean().item())
    assert 0 < diffs[8] < diffs[4]  # really quantized, and 8 bits closer than 4


@pytest.mark.parametrize("bits", [8, 4])
def test_both_modes_attend_over_the_same_kv(loaded, bits):
    """Dequantized attention reads exactly the values quantized attention reads: float32 logits agree to
    rounding (identical on the CPU backend), far inside the gap to float KV."""
    model, prompt = loaded.model, tokens(1, 40)
    fed = tokens(2, 8)
    quant, dequant = (_logits(model, plan_kv_quant(model, bits, GS, mode).make_cache, prompt, fed) for mode in MODES)
    assert mx.abs(quant - dequant).max().item() < 1e-3


# -- batching --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_tokens_alone_among_8_and_joining(loaded, bits, mode):
    prompts = [tokens(10 + i, 5 + 7 * i) for i in range(8)]
    expected = [reference(loaded.model, p, bits, mode=mode) for p in prompts]
    alone = make_core(loaded, kv_bits=bits, kv_quant_mode=mode, enable_prefix_cache=False)
    assert one(alone, prompts[3]) == {"ids": expected[3], "cached": 0}
    together = make_core(loaded, kv_bits=bits, kv_quant_mode=mode, enable_prefix_cache=False)
    for i, p in enumerate(prompts[:5]):
        together.add_request(Request(f"r{i}", p, greedy()))
    early: dict[str, list[int]] = {}
    for _ in range(3):  # the rest join a running batch
        for o in together.step():
            early.setdefault(o.request_id, []).extend(o.new_token_ids)
    held = together.runner.batch.cache  # the decode batch holds quantized KV
    assert all(isinstance(c, BatchQuantizedKVCache) and c.kv_bits == bits for c in held) and len(held) == 2
    # Only with quantized attention does the cache have `bits`, which sends mlx-lm's attention there.
    assert all(hasattr(c, "bits") == (mode == "quantized") for c in held)
    for i, p in enumerate(prompts[5:], start=5):
        together.add_request(Request(f"r{i}", p, greedy()))
    out = drain(together)
    assert [early.get(f"r{i}", []) + out[f"r{i}"]["ids"] for i in range(8)] == expected
    batch = make_core(loaded, kv_bits=bits, kv_quant_mode=mode, enable_prefix_cache=False)
    for i, p in enumerate(prompts):
        batch.add_request(Request(f"r{i}", p, greedy()))
    out = drain(batch)
    assert [out[f"r{i}"]["ids"] for i in range(8)] == expected


@pytest.mark.parametrize("mode", MODES)
def test_buckets_and_kv_prealloc_keep_the_tokens(loaded, mode):
    """Filler rows (bucketed batch sizes) and KV reserved up front: the same tokens, written in place."""
    prompts = [tokens(40 + i, 6 + 5 * i) for i in range(5)]
    expected = [reference(loaded.model, p, 8, mode=mode) for p in prompts]
    config = EngineConfig(max_num_seqs=8, kv_bits=8, kv_group_size=GS, kv_prealloc_tokens=300,
                          enable_prefix_cache=False, kv_quant_mode=mode)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, buckets=[1, 2, 4, 8])
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, greedy()))
    out: dict[str, list[int]] = {}
    full_steps = 0
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        held = core.runner.batch
        if held.num_live == 5:
            full_steps += 1
            assert len(held) == 8 and all(c.keys[0].shape[2] >= 300 for c in held.cache)  # 3 fillers, reserved
    assert full_steps > 0 and [out[f"r{i}"] for i in range(5)] == expected


# -- prefix cache and SSD tier ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", [8, 4])
def test_prefix_hits_give_the_same_tokens(loaded, bits, mode):
    prompt = tokens(21, 3 * BS + 5)
    expected = reference(loaded.model, prompt, bits, mode=mode)
    core = make_core(loaded, kv_bits=bits, kv_quant_mode=mode)
    assert one(core, prompt, "a") == {"ids": expected, "cached": 0}
    assert one(core, prompt, "b") == {"ids": expected, "cached": 3 * BS}
    # A prompt sharing two blocks, then going elsewhere: resumes from the quantized blocks.
    other = prompt[: 2 * BS] + tokens(22, 9)
    assert one(core, other, "c") == {"ids": reference(loaded.model, other, bits, mode=mode), "cached": 2 * BS}
    stats = core.cache_stats()
    assert stats["memory"]["block_bytes"] == stats["num_cached_blocks"] * BS * core.probe.bytes_per_token


@pytest.mark.parametrize("modes", [("quantized", "quantized"), ("dequantized", "dequantized"),
                                   ("quantized", "dequantized")])
def test_ssd_restart_gives_the_same_tokens_and_other_settings_miss(loaded, tmp_path, modes):
    """The last case: blocks written with quantized attention serve an engine that dequantizes (a Mac's
    SSD files on a CUDA box): the same bytes, so a hit."""
    prompt = tokens(31, 2 * BS + 1)
    first = make_core(loaded, kv_bits=8, kv_quant_mode=modes[0], ssd_cache_dir=str(tmp_path))
    assert one(first, prompt) == {"ids": reference(loaded.model, prompt, 8, mode=modes[0]), "cached": 0}
    first.close()
    expected = reference(loaded.model, prompt, 8, mode=modes[1])
    second = make_core(loaded, kv_bits=8, kv_quant_mode=modes[1], ssd_cache_dir=str(tmp_path))
    assert one(second, prompt) == {"ids": expected, "cached": 2 * BS}
    assert second.cache_stats()["ssd"]["hits"] == 2
    second.close()
    # Blocks quantized otherwise (or float) are foreign files: a miss, and the output is that setting's own.
    for kw, ids in (({"kv_bits": 4}, reference(loaded.model, prompt, 4, mode=modes[1])), ({}, None)):
        core = make_core(loaded, ssd_cache_dir=str(tmp_path), kv_quant_mode=modes[1], **kw)
        out = one(core, prompt)
        assert out["cached"] == 0 and core.cache_stats()["ssd"]["hits"] == 0
        if ids is not None:
            assert out["ids"] == ids
        core.close()


# -- flags and the budget --------------------------------------------------------------------------------


def test_flags_are_validated(loaded):
    with pytest.raises(ValueError, match="kv_bits must be 4 or 8"):
        EngineConfig(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size must be 32, 64 or 128"):
        EngineConfig(kv_bits=8, kv_group_size=48)
    with pytest.raises(ValueError, match="kv_quant_mode must be auto, quantized or dequantized"):
        EngineConfig(kv_bits=8, kv_quant_mode="float")
    with pytest.raises(ValueError, match=r"kv_group_size 64 must divide the attention head dim \(32\); "
                                         r"try --kv-group-size 32"):
        make_core(loaded, kv_bits=8, kv_group_size=64)
    from mlxhost.server.cli import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--kv-bits", "3"])


@pytest.fixture(scope="module")
def bf16_loaded(tmp_path_factory):
    """Real models' KV is bf16/fp16: a bf16 fixture with head_dim 64, so the default group 64 applies."""
    path = build_model_folder(tmp_path_factory.mktemp("qwen3-bf16"), DemoModelConfig(dtype="bfloat16", head_dim=64))
    return load_model(str(path))


@pytest.mark.parametrize("mode,attention", [("quantized", QUANTIZED_ATTENTION), ("dequantized", DEQUANTIZED)])
def test_capacity_in_tokens_grows_with_fewer_bits(bf16_loaded, mode, attention):
    def core(**kw):
        config = EngineConfig(max_num_seqs=4, memory_mode="dedicated", enable_prefix_cache=False,
                              kv_quant_mode=mode, **kw)
        return EngineCore(bf16_loaded.model, bf16_loaded.tokenizer, config, max_model_len=4096)

    float_kv, q8, q4 = core(), core(kv_bits=8), core(kv_bits=4)
    # 2 layers x 2 kv heads x 64 dims x (keys, values): 512 values a token.
    assert [c.status()["kv_bytes_per_token"] for c in (float_kv, q8, q4)] == [512 * 2, 512 * 17 // 16, 512 * 9 // 16]
    assert float_kv.status()["kv_dtype"] == q8.status()["kv_dtype"] == "bfloat16"
    base = float_kv.status()["kv_capacity_tokens"]
    assert q8.status()["kv_capacity_tokens"] >= 1.8 * base
    assert q4.status()["kv_capacity_tokens"] >= 3.0 * base
    assert q4.status()["kv_quantization"] == {"bits": 4, "group_size": 64, "quantized_layers": 2,
                                              "num_layers": 2, "attention": attention, "note": None}


# -- choosing the attention mode -------------------------------------------------------------------------


def cuda_like(model, plan) -> None:
    """The probe as on MLX-CUDA 0.32: its quantized matmul rejects mlx-lm's GQA-broadcast shapes."""
    if not plan.dequantize:
        raise ValueError('[quantized_matmul] No implementation for problem shape: 2x2x32x4, transpose: true')
    probe_attention(model, plan)


def test_plan_dequantizes_where_quantized_attention_raises(loaded):
    model = loaded.model
    native = plan_kv_quant(model, 8, GS)  # the CPU backend runs quantized attention
    assert native.attention == QUANTIZED_ATTENTION and not native.note
    plan = plan_kv_quant(model, 8, GS, probe=cuda_like)
    assert plan.dequantize and plan.layers == (0, 1) and plan.label == native.label
    assert plan.status()["attention"] == DEQUANTIZED and "No implementation for problem shape" in plan.note
    assert not any(hasattr(c, "bits") for c in plan.make_cache(model))

    def broken(model, plan):
        raise RuntimeError(f"no kernel ({plan.attention})")

    fallback = plan_kv_quant(model, 8, GS, probe=broken)  # neither runs: float KV, both reasons said
    assert fallback.layers == () and fallback.attention is None and fallback.label == ""
    assert "no kernel (quantized attention)" in fallback.note and "no kernel (dequantized per layer)" in fallback.note
    # A mode asked for is the only one tried.
    assert plan_kv_quant(model, 8, GS, "quantized", probe=cuda_like).layers == ()
    assert plan_kv_quant(model, 8, GS, "dequantized", probe=cuda_like).attention == DEQUANTIZED

