"""Quantized layers that fold a batch of decode rows into one matrix (models/quantized_rows.py): the same
numbers, the same parameter tree, the same greedy tokens through the engine; applied on MLX-CUDA only."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import mlxserve.models.backend as backend
from mlxserve.config import EngineConfig
from mlxserve.engine.engine_core import EngineCore
from mlxserve.engine.request import Request, SamplingParams
from mlxserve.models.loader import load_model
from mlxserve.models.quantized_rows import (RowsQuantizedEmbedding, RowsQuantizedLinear, fold_on_cuda,
                                            fold_quantized_rows)


def _shapes(model):
    return {k: (v.shape, v.dtype) for k, v in tree_flatten(model.parameters())}


def test_folded_layers_give_the_same_logits_and_keep_names_and_arrays(qwen3_4bit_model_dir):
    model = load_model(str(qwen3_4bit_model_dir)).model
    inputs = [mx.array([[5]]), mx.array([[5], [9], [17], [3]]), mx.array([[1, 2, 3, 4, 5, 6, 7]] * 3)]
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


def test_a_folded_model_serves_the_same_greedy_tokens(qwen3_4bit_model_dir):
    plain = load_model(str(qwen3_4bit_model_dir))
    folded = load_model(str(qwen3_4bit_model_dir))
    assert fold_quantized_rows(folded.model) > 0
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core = EngineCore(folded.model, folded.tokenizer, EngineConfig(max_num_seqs=8), max_model_len=1024)
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


@pytest.mark.parametrize("cuda, env, folds", [(False, {}, False), (True, {}, True),
                                              (True, {"MLXSERVE_FOLD_ROWS": "0"}, False)])
def test_folding_applies_on_cuda_only_unless_turned_off(qwen3_4bit_model_dir, monkeypatch, cuda, env, folds):
    model = load_model(str(qwen3_4bit_model_dir)).model
    monkeypatch.setattr(backend, "is_cuda", lambda: cuda)
    assert (fold_on_cuda(model, environ=env) > 0) == folds
    assert (type(model.model.layers[0].mlp.down_proj) is RowsQuantizedLinear) == folds
