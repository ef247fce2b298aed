"""engine/embeddings.py on tiny random-weight models: the pooled vector is the final norm's output at
the last token (what the LM head reads), right-padded batches and chunked runs equal single inputs,
on a plain-KV, a sliding-window, a hybrid (recurrent state) and an MLA family."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.engine.embeddings import (
    DimensionsTooLargeError,
    EmbeddingBatch,
    EmbeddingsUnsupportedError,
    embed,
    hidden_body,
    hidden_size,
    plan_batches,
)
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

TOL = 1e-5
LENGTHS = (5, 37, 1, 20, 33, 37, 2)


def inputs(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_next", "deepseek_v2"])
def family_model(request, tmp_path_factory):
    path = build_family_folder(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(str(path)).model


def test_batch_and_chunks_equal_singles(family_model):
    rows = inputs()
    singles = mx.concatenate([embed(family_model, [r]) for r in rows])
    batched = embed(family_model, rows)
    # Step 8 over a sliding window of 16: chunks cross the window; 64 tokens a batch: several batches.
    chunked = embed(family_model, rows, step=8, max_batch_tokens=64)
    assert batched.shape == (len(rows), hidden_size(family_model))
    np.testing.assert_allclose(np.array(batched), np.array(singles), atol=TOL)
    np.testing.assert_allclose(np.array(chunked), np.array(singles), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(np.array(batched), axis=1), 1.0, atol=TOL)


def test_pooled_state_is_what_the_lm_head_reads(qwen3_model_dir):
    model = load_model(str(qwen3_model_dir)).model
    rows = inputs(1)
    batch = EmbeddingBatch(model, rows, step=512)
    while not batch.advance():
        pass
    raw = batch.vectors()
    for i, r in enumerate(rows):
        logits = model(mx.array([r]))[0, -1]
        head = model.model.embed_tokens.as_linear(raw[i])  # the fixture ties its embeddings
        np.testing.assert_allclose(np.array(head), np.array(logits), atol=1e-4)


def test_quantized_model(qwen3_4bit_model_dir):
    model = load_model(str(qwen3_4bit_model_dir)).model
    rows = inputs(2)
    np.testing.assert_allclose(np.array(embed(model, rows)),
                               np.array(mx.concatenate([embed(model, [r]) for r in rows])), atol=TOL)


def test_dimensions(qwen3_model_dir):
    model = load_model(str(qwen3_model_dir)).model
    rows = inputs(3)
    full = np.array(embed(model, rows))
    short = np.array(embed(model, rows, dimensions=16))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=TOL)
    with pytest.raises(DimensionsTooLargeError):
        embed(model, rows, dimensions=hidden_size(model) + 1)


def test_refusals():
    with pytest.raises(EmbeddingsUnsupportedError):
        hidden_body(object())
    with pytest.raises(ValueError):
        embed(object(), [])
    with pytest.raises(ValueError):
        embed(object(), [[1], []])


def test_plan_batches():
    assert plan_batches([], 100) == []
    # Longest first; 200 is a batch of its own, and 3 rows padded to 50 would pass 100.
    assert plan_batches([10, 50, 10, 200], 100) == [[3], [1, 0], [2]]
    # Padded size (rows x longest) stays within the budget; every index appears once.
    lengths = [random.Random(4).randrange(1, 300) for _ in range(200)]
    plan = plan_batches(lengths, 1024)
    assert sorted(i for b in plan for i in b) == list(range(200))
    assert all(len(b) == 1 or len(b) * lengths[b[0]] <= 1024 for b in plan)
    assert all(lengths[b[0]] == max(lengths[i] for i in b) for b in plan)
