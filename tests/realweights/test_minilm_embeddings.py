"""all-MiniLM-L6-v2 through /v1/embeddings: within 1e-3 of sentence-transformers' recipe (BERT, mean over
the attention mask, L2 normalize) computed here in numpy straight from the safetensors, and a paraphrase
ranked above an unrelated sentence."""

from __future__ import annotations

import json
import math

import numpy as np
import openai
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server.app import build_app

pytestmark = pytest.mark.needs("minilm")

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today.",
         "Ein Mann isst Brot. 男は食べる 🍞"]
TOL = 1e-3


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


_erf = np.vectorize(math.erf)


def reference(folder, texts: list[str]) -> np.ndarray:
    """BERT in float64 numpy, one text at a time (no padding), then sentence-transformers' pooling."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads every text to 128 tokens; the recipe pools real tokens only
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
    out = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:len(ids)]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def lin(name, h):
                return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            n, d = len(ids), x.shape[-1] // heads
            q, k, v = (lin(f"attention.self.{m}", x).reshape(n, heads, d).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = (probs @ v).transpose(1, 0, 2).reshape(n, -1)
            x = _layer_norm(x + lin("attention.output.dense", attn), w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], eps)
            h = lin("intermediate.dense", x)
            h = 0.5 * h * (1 + _erf(h / math.sqrt(2)))  # exact GELU
            x = _layer_norm(x + lin("output.dense", h), w[p + "output.LayerNorm.weight"],
                            w[p + "output.LayerNorm.bias"], eps)
        v = x.mean(axis=0)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


@pytest.fixture(scope="module")
def client(minilm_dir, tmp_path_factory):
    pytest.importorskip("mlx_embeddings")
    from tests.e2e.conftest import start_app

    app = build_app(ServerConfig(models=(ModelSpec("minilm", str(minilm_dir)),), engine=EngineConfig(max_num_seqs=4)))
    live = start_app(app)
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=300) as c:
        yield c
    live.stop()


def test_embeddings_match_the_sentence_transformers_recipe(client, minilm_dir):
    got = client.embeddings.create(model="minilm", input=TEXTS)
    vectors = np.array([d.embedding for d in got.data])
    assert vectors.shape == (len(TEXTS), 384)
    want = reference(minilm_dir, TEXTS)
    assert np.abs(vectors - want).max() < TOL
    sims = vectors @ vectors.T
    # The paraphrase ranks above the unrelated sentence (reference values: 0.755 and ~0.01).
    assert sims[0, 1] > 0.6 and sims[0, 2] < 0.2
    assert sims[0, 1] > sims[0, 2] + 0.4
