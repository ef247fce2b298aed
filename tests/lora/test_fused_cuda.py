"""MLX-CUDA only: the fused layout's kernel (lora/fused.py) against its op twin and the gathered layout's ops,
on the input groups of a Qwen3-0.6B block, bfloat16 activations, rows with and without an adapter, one and
several positions per row. Skipped elsewhere (the kernel cannot run there)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxhost.lora.fused import CudaFused, fused_ops
from mlxhost.lora.layers import MultiLoRALinear, RowAdapters

pytestmark = pytest.mark.needs("cuda")  # the fused kernel runs on MLX-CUDA only

# (in, outs of the members) of a Qwen3-0.6B block's input groups: q/k/v, o, gate/up, down.
QWEN3_06B_GROUPS = [(1024, [2048, 1024, 1024]), (2048, [1024]), (1024, [3072, 3072]), (3072, [1024])]


def kernel_errors(rows: int = 16, positions: int = 1, rank: int = 8, num_adapters: int = 4,
                  adapter_dtype=mx.float32, dtype=mx.bfloat16, seed: int = 0, pad: bool = False) -> dict:
    """Largest |kernel - fused_ops| and |kernel - gathered ops| over the groups, the largest |output|, and
    whether rows without an adapter got their base output bit for bit."""
    mx.random.seed(seed)
    kernel = CudaFused()
    index = mx.array([r % (num_adapters + 1) for r in range(rows)], dtype=mx.int32)  # 0: no adapter
    scales = mx.array([0.0 if r % (num_adapters + 1) == 0 else 2.0 + r for r in range(rows)])[:, None, None]
    state = RowAdapters()
    state.set(None, index, scales)
    found = {"vs_ops": 0.0, "vs_gathered": 0.0, "max_abs_out": 0.0, "base_rows_exact": True}
    for in_dims, outs in QWEN3_06B_GROUPS:
        x = mx.random.normal((rows, positions, in_dims)).astype(dtype)
        layers, ys = [], []
        for out_dims in outs:
            layer = MultiLoRALinear(nn.Linear(in_dims, out_dims, bias=False), state, in_dims, out_dims)
            a = (mx.random.uniform(-1, 1, (in_dims, num_adapters * rank)) / in_dims ** 0.5).astype(adapter_dtype)
            b = (mx.random.normal((num_adapters * rank, out_dims)) * 0.02).astype(adapter_dtype)
            layer.attach_stacks(a, b, rank, pad=pad)  # unpadded, as the fused layout keeps them
            layers.append(layer)
            ys.append(mx.random.normal((rows, positions, out_dims)).astype(dtype))
        stacks = [layer._stacks[:2] for layer in layers]
        got = kernel(x, ys, stacks, index, scales, rank)
        want = fused_ops(x, ys, stacks, index, scales, rank)
        gathered = [y + layer._gathered(x).astype(y.dtype) for y, layer in zip(ys, layers)]
        mx.eval(got, want, gathered)
        base = (index == 0)[:, None, None]
        for g, w, o, y in zip(got, want, gathered, ys):
            found["vs_ops"] = max(found["vs_ops"], mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item())
            found["vs_gathered"] = max(found["vs_gathered"],
                                       mx.abs(g.astype(mx.float32) - o.astype(mx.float32)).max().item())
            found["max_abs_out"] = max(found["max_abs_out"], mx.abs(w.astype(mx.float32)).max().item())
            found["base_rows_exact"] &= bool(mx.all(mx.where(base, g == y, True)).item())
    return found


@pytest.mark.parametrize("positions, adapter_dtype, pad", [(1, mx.float32, False), (5, mx.float32, False),
                                                         (1, mx.bfloat16, False), (1, mx.float32, True),
                                                         (165, mx.bfloat16, False)])  # a prefill chunk
def test_the_kernel_computes_its_op_twin(positions, adapter_dtype, pad):
    found = kernel_errors(positions=positions, adapter_dtype=adapter_dtype, pad=pad)
    assert found["base_rows_exact"]
    # Both round the same float32 sum to bfloat16: at most a unit in the last place apart.
    assert found["vs_ops"] <= 2 ** -7 * max(found["max_abs_out"], 1.0)
    # The gathered ops sum in another order (and in the adapters' dtype): within two such units.
    assert found["vs_gathered"] <= 2 ** -6 * max(found["max_abs_out"], 1.0)
