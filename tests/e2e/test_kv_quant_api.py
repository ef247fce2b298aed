"""--kv-bits through the real server: /v1/status shows the KV capacity in tokens (×1.8 with 8-bit, ×3 with
4-bit KV against the bf16 KV of the same model and budget), the bytes per token and the quantization;
/metrics has gauges for both; completions run on the quantized batch, concurrently. The same with KV
dequantized per layer (what MLX-CUDA gets): the same capacity, and the status says which attention runs.

The fixture is bf16 with head_dim 64 (real models keep bf16/fp16 KV; a float32 fixture would give larger
factors), served in dedicated mode so the three servers get the same budget."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlxhost.testing.demo import DemoModelConfig, build_model_folder


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("qwen3-bf16"), DemoModelConfig(dtype="bfloat16", head_dim=64))


@pytest.mark.parametrize("mode,attention", [("auto", "quantized attention"),
                                            ("dequantized", "dequantized per layer")])
def test_status_and_metrics_show_the_larger_capacity(make_server, bf16_dir, mode, attention):
    statuses, gauges = {}, {}
    for bits in (None, 8, 4):
        # Weights as loaded: served as float32 (the CPU default) the baseline's KV would be float32 too.
        live = make_server(bf16_dir, memory_mode="dedicated", kv_bits=bits, kv_quant_mode=mode, cpu_weights="keep")
        statuses[bits] = httpx.get(live.base_url + "/status", timeout=30).json()
        gauges[bits] = live.metrics()
        if bits == 4:
            body = {"model": "tiny", "prompt": list(range(10, 40)), "max_tokens": 12, "ignore_eos": True,
                    "temperature": 0}

            async def burst():
                async with httpx.AsyncClient(timeout=120) as client:
                    return await asyncio.gather(*(client.post(live.base_url + "/completions", json=body)
                                                  for _ in range(8)))

            replies = asyncio.run(burst())
            assert [r.status_code for r in replies] == [200] * 8
            assert len({r.json()["choices"][0]["text"] for r in replies}) == 1  # same prompt, same greedy text
        live.stop()
    base = statuses[None]["kv_capacity_tokens"]
    assert statuses[8]["kv_capacity_tokens"] >= 1.8 * base and statuses[4]["kv_capacity_tokens"] >= 3 * base
    assert [statuses[b]["kv_bytes_per_token"] for b in (None, 8, 4)] == [1024, 544, 288]
    assert statuses[None]["kv_quantization"] is None
    assert statuses[8]["kv_quantization"]["bits"] == 8 and statuses[8]["kv_quantization"]["group_size"] == 64
    assert statuses[8]["kv_quantization"]["attention"] == statuses[4]["kv_quantization"]["attention"] == attention
    for bits in (None, 8, 4):
        assert gauges[bits]["mlxhost_kv_bytes_per_token"] == statuses[bits]["kv_bytes_per_token"]
        assert gauges[bits]["mlxhost_kv_capacity_tokens"] == statuses[bits]["kv_capacity_tokens"]
