"""The CPU weight layout (platform/cpu_weights.py): which layout each case gets, and that the float32 copy of a
quantized model computes what the quantized one does."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlxhost.platform import cpu_weights

GIB = 1 << 30


def tiny_llama(dtype=mx.float32, bits: int | None = None):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.apply(lambda a: (a * 5).astype(dtype))  # std 0.1-ish: varied logits
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("bits", [3, 4, 6, 8])
def test_float32_bytes_counts_quantized_matrices_at_full_size(bits):
    plain = tiny_llama()
    # 3- and 6-bit values straddle the packing words: a floor of 32 / bits would undercount them
    assert cpu_weights.float32_bytes(tiny_llama(bits=bits)) == cpu_weights.float32_bytes(plain)
    assert cpu_weights.float32_bytes(tiny_llama(mx.float16)) == cpu_weights.float32_bytes(plain)


@pytest.mark.parametrize("choice, on_cpu, ram, layout", [
    ("auto", True, 16 * GIB, "float32"),
    ("auto", False, 16 * GIB, "keep"),          # Metal and CUDA: quantized kernels are the fast path
    ("keep", True, 16 * GIB, "keep"),
    ("auto", True, 1024, "float32-scales"),    # float32 would not fit: floats up, packed weights kept
    ("float32", True, 1024, "float32"),        # asked for: no fit check
])
def test_plan(choice, on_cpu, ram, layout):
    assert cpu_weights.plan(tiny_llama(mx.float16, bits=4), choice, on_cpu, ram).layout == layout


def test_a_float32_model_is_kept():
    assert cpu_weights.plan(tiny_llama(), "auto", True, 16 * GIB).layout == "keep"


@pytest.mark.parametrize("layout", ["float32", "float32-scales"])
def test_the_float32_copy_computes_what_the_quantized_model_does(layout):
    model = tiny_llama(bits=4)  # float32 scales: dequantizing changes the summation order only
    tokens = mx.array([[1, 5, 9, 77, 3, 200]])
    before = model(tokens)
    cpu_weights.apply(model, cpu_weights.WeightPlan(layout, "test"))
    after = model(tokens)
    quantized_left = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert quantized_left == (layout == "float32-scales")
    assert all(v.dtype in (mx.float32, mx.uint32) for _, v in tree_flatten(model.parameters()))
    assert mx.allclose(before, after, atol=1e-4, rtol=1e-4).item()


def test_a_float16_model_is_served_as_float32_with_its_greedy_tokens():
    model = tiny_llama(mx.float16, bits=4)
    tokens = mx.array([[1, 5, 9, 77, 3, 200]])
    before = model(tokens).argmax(-1)
    cpu_weights.apply(model, cpu_weights.plan(model, "auto", True, 16 * GIB))
    assert model(tokens).dtype == mx.float32
    # float16 scales read exactly as float32: the same greedy choices (not bit-identical logits)
    assert (model(tokens).argmax(-1) == before).all().item()
