"""Quantized layers that fold a batch of decode rows into one matrix (platform/quantized_rows.py): the same
numbers, the same parameter tree, the same greedy tokens through the engine; applied on MLX-CUDA only."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlxhost.platform.backend as backend
import mlxhost.platform.quantized_rows as quantized_rows
from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.platform.quantized_rows import (
    RowsQuantizedEmbedding,
    RowsQuantizedLinear,
    dequant_in_flight_bytes,
    dequantized_bytes,
    fold_on_cuda,
    fold_quantized_rows,
    set_tiled_rows,
)


@pytest.fixture(autouse=True)
def _plain_loads(monkeypatch):
    # On an MLX-CUDA host load_model folds already; these tests fold by hand.
    monkeypatch.setenv("MLXHOST_FOLD_ROWS", "0")


def _shapes(model):
    return {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())}


def test_folded_layers_give_the_same_logits_and_keep_names_and_arrays(qwen3_4bit_model_dir):
    model = load_model(str(qwen3_4bit_model_dir)).model
    # one stream; 4 decode rows (under the fold's 8); 12 decode rows and 3 prompts' chunks (folded)
    inputs = [mx.array([[5]]), mx.array([[5], [9], [17], [3]]), mx.array([[i + 3] for i in range(12)]),
              mx.array([[1, 2, 3, 4, 5, 6, 7]] * 3)]
    before = [model(x) for x in inputs]
    params = _shapes(model)
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    weight = model.model.layers[0].self_attn.q_proj.weight

    replaced = fold_quantized_rows(model)

    layers = len(model.model.layers)
    assert replaced == 7 * layers + 1  # q k v o gate up down per layer, and the tied embedding
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is RowsQuantizedLinear and isinstance(q_proj, nn.QuantizedLinear)
    assert type(model.model.embed_tokens) is RowsQuantizedEmbedding
    assert q_proj.weight is weight  # the same array, not a copy
    assert (q_proj.group_size, q_proj.bits, q_proj.mode) == (64, 4, "affine")
    assert _shapes(model) == params
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == trainable  # still frozen
    for x, want in zip(inputs, before):
        assert mx.array_equal(model(x), want), x.shape
    assert fold_quantized_rows(model) == 0  # already folded: nothing of the exact types is left


@pytest.mark.parametrize("shape", [(0, 1, 64), (1, 9, 64), (2, 3, 1, 64), (2, 4, 1, 64), (16, 1, 64), (16, 64)])
def test_a_folded_layer_equals_the_plain_one_for_any_shape(shape):
    plain = nn.QuantizedLinear(64, 128, bias=True, group_size=64, bits=4)
    holder = nn.Module()
    holder.proj = plain
    fold_quantized_rows(holder)
    x = mx.random.normal(shape)
    got = holder.proj(x)
    assert got.shape == (*shape[:-1], 128)
    assert mx.allclose(got, plain(x)).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 9, 64), (3, 5, 64), (16, 64), (2, 8, 1, 64)])
def test_from_dequant_rows_on_a_layer_dequantizes_for_one_matmul(shape, bias, monkeypatch):
    """At `dequant_rows` rows or more (here 9) the weight is dequantized for a plain matmul, below it the
    quantized kernel runs: the same numbers either way, the bias added once."""
    plain = nn.QuantizedLinear(64, 128, bias=bias, group_size=64, bits=4)
    holder = nn.Module()
    holder.proj = plain
    fold_quantized_rows(holder, dequant_rows=9)
    assert holder.proj.dequant_rows == 9 and "dequant_rows" not in dict(tree_flatten(holder.parameters()))
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = mx.random.normal(shape)
    got = holder.proj(x)
    assert got.shape == (*shape[:-1], 128)
    assert mx.allclose(got, plain(x), atol=1e-4).item()
    rows = x.size // 64
    assert len(calls) == (1 if rows >= 9 else 0)


def test_the_tied_head_dequantizes_from_dequant_rows_on(monkeypatch):
    embed = nn.QuantizedEmbedding(300, 64, group_size=64, bits=4)
    holder = nn.Module()
    holder.embed = embed
    fold_quantized_rows(holder, dequant_rows=4)
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    for shape, dequantized in [((1, 3, 64), 0), ((2, 6, 64), 1)]:
        x = mx.random.normal(shape)
        assert mx.allclose(holder.embed.as_linear(x), embed.as_linear(x), atol=1e-4).item()
        assert len(calls) == dequantized
    assert mx.array_equal(holder.embed(mx.array([[1, 2, 299]])), embed(mx.array([[1, 2, 299]])))  # lookups unchanged


def test_tensor_parallel_shards_fold_too():
    from mlx.nn.layers.distributed import shard_linear

    group = mx.distributed.init()  # one process: a group of one, enough for the layer types
    holder = nn.Module()
    holder.up = shard_linear(nn.QuantizedLinear(64, 128, bias=False), "all-to-sharded", group=group)
    holder.down = shard_linear(nn.QuantizedLinear(128, 64, bias=False), "sharded-to-all", group=group)
    x = mx.random.normal((10, 1, 64))
    want = holder.down(holder.up(x))
    assert fold_quantized_rows(holder) == 2
    assert type(holder.up).__name__ == "RowsQuantizedAllToShardedLinear"
    assert mx.allclose(holder.down(holder.up(x)), want).item()


@pytest.mark.parametrize("rows", [1, 10, 200])
def test_tensor_parallel_shards_dequantize_like_the_other_layers(monkeypatch, rows):
    """A shard's prompt rows (from dequant_rows on) and the rows above its tiled limit take dequantize + one
    plain matmul, its bias added once (after the sharded-to-all layer's all-reduce); its other rows the
    quantized kernel. Either way the output is the layer's own."""
    from mlx.nn.layers.distributed import shard_linear

    from mlxhost.platform.quantized_rows import row_layers

    group = mx.distributed.init()
    # Two ranks' all-reduce of equal partial products: a bias added before the sum would show twice.
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, group=None, stream=None: 2 * x)
    mx.random.seed(5)
    holder = nn.Module()
    holder.up = shard_linear(nn.QuantizedLinear(64, 128, bias=True), "all-to-sharded", group=group)
    holder.down = shard_linear(nn.QuantizedLinear(128, 64, bias=True), "sharded-to-all", group=group)
    holder.up.bias = mx.random.normal((128,))
    holder.down.bias = mx.random.normal((64,))
    x = mx.random.normal((rows, 1, 64))
    want = holder.down(holder.up(x))  # mlx's own shard layers, on the same doubled all-reduce
    fold_quantized_rows(holder, dequant_rows=128)
    assert len(row_layers(holder)) == 2
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert mx.allclose(holder.down(holder.up(x)), want, atol=1e-4).item()
    assert len(calls) == (2 if rows >= 128 else 0)
    calls.clear()
    set_tiled_rows(holder, 7)  # tiled kernels not compiled yet: from 8 rows on they dequantize too
    assert mx.allclose(holder.down(holder.up(x)), want, atol=1e-4).item()
    assert len(calls) == (2 if rows >= 8 else 0)


@pytest.mark.parametrize("dequant_rows", [0, 12])
def test_a_folded_model_serves_the_same_greedy_tokens(qwen3_4bit_model_dir, dequant_rows):
    plain = load_model(str(qwen3_4bit_model_dir))
    folded = load_model(str(qwen3_4bit_model_dir))
    assert fold_quantized_rows(folded.model, dequant_rows) > 0
    # 10 streams: the decode batch is over the fold's 8 rows (and under 12); prompts of 5-86 tokens, so
    # with dequant_rows 12 most prefill chunks (and prompts prefilled together) take the dequantize path.
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(10)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core = EngineCore(folded.model, folded.tokenizer, EngineConfig(max_num_seqs=16), max_model_len=1024)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while core.has_work:
        for out in core.step():
            assert out.error is None, out.error
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    greedy = make_sampler(temp=0.0)
    for i, p in enumerate(prompts):
        want = [int(t) for t, _ in generate_step(mx.array(p), plain.model, max_tokens=6, sampler=greedy)]
        assert got[f"r{i}"] == want, i


@pytest.mark.parametrize("cuda, env, folds, dequant_rows", [
    (False, {}, False, None), (True, {}, True, 128), (True, {"MLXHOST_FOLD_ROWS": "0"}, False, None),
    (True, {"MLXHOST_DEQUANT_ROWS": "0"}, True, 0), (True, {"MLXHOST_DEQUANT_ROWS": "512"}, True, 512)])
def test_folding_applies_on_cuda_only_unless_turned_off(qwen3_4bit_model_dir, monkeypatch, cuda, env, folds,
                                                        dequant_rows):
    model = load_model(str(qwen3_4bit_model_dir)).model
    monkeypatch.setattr(backend, "is_cuda", lambda: cuda)
    assert (fold_on_cuda(model, environ=env) > 0) == folds
    down = model.model.layers[0].mlp.down_proj
    assert (type(down) is RowsQuantizedLinear) == folds
    if folds:
        assert down.dequant_rows == dequant_rows and model.model.embed_tokens.dequant_rows == dequant_rows


@pytest.mark.parametrize("text", ["-1", "many", "1.5"])
def test_a_bad_dequant_threshold_is_refused(qwen3_4bit_model_dir, monkeypatch, text):
    model = load_model(str(qwen3_4bit_model_dir)).model
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    with pytest.raises(ValueError, match="MLXHOST_DEQUANT_ROWS must be a whole number"):
        fold_on_cuda(model, environ={"MLXHOST_DEQUANT_ROWS": text})


def test_the_loader_folds_on_cuda(qwen3_4bit_model_dir, monkeypatch):
    monkeypatch.delenv("MLXHOST_FOLD_ROWS")
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    model = load_model(str(qwen3_4bit_model_dir)).model
    assert type(model.model.layers[0].self_attn.o_proj) is RowsQuantizedLinear


def test_dequantized_bytes_counts_each_folded_weight_at_the_dtype_it_dequantizes_to():
    holder = nn.Module()
    holder.affine = nn.QuantizedLinear(256, 128, group_size=64, bits=3)  # float32 scales: float32 out
    holder.fp = nn.QuantizedLinear(256, 128, group_size=32, bits=4, mode="mxfp4")  # uint8 scales: bfloat16 out
    holder.embed = nn.QuantizedEmbedding(300, 64, group_size=64, bits=8)
    assert dequantized_bytes(holder) == 0  # nothing folded: no layer dequantizes
    fold_quantized_rows(holder)
    assert dequantized_bytes(holder) == 128 * 256 * 4 + 128 * 256 * 2 + 300 * 64 * 4
    assert holder.affine(mx.random.normal((9, 256))).dtype == mx.float32


def test_the_budget_counts_a_bounded_share_of_the_dequantized_weights_per_forward_in_flight(monkeypatch):
    holder = nn.Module()
    holder.layers = [nn.QuantizedLinear(256, 128, group_size=64, bits=4) for _ in range(4)]  # float32 scales
    assert dequant_in_flight_bytes(holder) == 0  # nothing folded (Metal, the CPU): nothing dequantizes
    fold_quantized_rows(holder)
    layer = 128 * 256 * 4
    # The whole model's copies where they are under the bound, for each forward in flight ...
    assert dequant_in_flight_bytes(holder) == quantized_rows.DEQUANT_IN_FLIGHT * 4 * layer
    # ... otherwise the bound and the layer that crosses it (a cast copy beside it).
    monkeypatch.setattr(quantized_rows, "DEQUANT_EVAL_BYTES", layer)
    assert dequant_in_flight_bytes(holder) == quantized_rows.DEQUANT_IN_FLIGHT * 3 * layer


@pytest.mark.parametrize("bound", [1, 1 << 40])
def test_a_forward_evaluates_its_dequantized_copies_once_they_reach_the_bound(monkeypatch, bound):
    """Left unevaluated, every layer's copy lives until the forward runs (15 GiB for an 8B 4-bit model on MLX-CUDA):
    past the bound the layer evaluates what was built, with the same result either way."""
    layer = nn.QuantizedLinear(256, 128, group_size=64, bits=4)
    x = mx.random.normal((1, 16, 256))
    want = layer(x)
    holder = nn.Module()
    holder.proj = layer
    fold_quantized_rows(holder, dequant_rows=8)
    evaluated = []
    real_eval = mx.eval
    monkeypatch.setattr(quantized_rows, "DEQUANT_EVAL_BYTES", bound)
    monkeypatch.setattr(quantized_rows.mx, "eval", lambda *a: (evaluated.append(a), real_eval(*a))[1])
    monkeypatch.setattr(quantized_rows._unevaluated, "bytes", 0, raising=False)
    got = holder.proj(x)
    assert mx.allclose(got, want, atol=1e-4)
    copy = 128 * 256 * 4  # float32 scales: a float32 copy, the input's dtype
    if bound == 1:
        assert len(evaluated) == 1 and quantized_rows._unevaluated.bytes == 0
    else:
        assert not evaluated and quantized_rows._unevaluated.bytes == copy
        holder.proj(x)  # the count carries over to the next layer (or forward) on this thread
        assert quantized_rows._unevaluated.bytes == 2 * copy
