"""Encoder embedding models (tiny random BERT folders) served beside the tiny chat model, through the
official openai client: loaded on first use, listed in /v1/models, pooled as the folder says (mean /
cls), unit norm, deterministic, batch = singles, and a 400 naming `model` for generation on them."""

from __future__ import annotations

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.encoder_demo import EncoderDemoConfig, build_encoder_folder

TEXTS = ["The quick brown fox", "jumps", "over the lazy dog, again and again and again and again", "a"]
HIDDEN = EncoderDemoConfig().hidden_size
TOL = 1e-5


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory):
    return {pooling: build_encoder_folder(tmp_path_factory.mktemp(f"bert-{pooling}"),
                                          EncoderDemoConfig(pooling=pooling, seed=i))
            for i, pooling in enumerate(("mean", "cls"))}


@pytest.fixture(scope="module")
def live(qwen3_model_dir, bert_dirs, serve_module_app):
    specs = (ModelSpec("chat", str(qwen3_model_dir), pinned=True),
             ModelSpec("embed", str(bert_dirs["mean"]), aliases=("bert",)),
             ModelSpec("embed-cls", str(bert_dirs["cls"])))
    return serve_module_app(build_app(ServerConfig(models=specs, engine=EngineConfig(max_num_seqs=4))))


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def embed(client, input, model="embed", **kw) -> np.ndarray:
    out = client.embeddings.create(model=model, input=input, **kw)
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return np.array([d.embedding for d in out.data], dtype=np.float64)


def reference(folder, texts: list[str], pooling: str) -> np.ndarray:
    """The same vectors straight from mlx-embeddings, one text at a time (no padding, no server)."""
    from mlx_embeddings.utils import load

    module, tokenizer = load(str(folder))
    out = []
    for text in texts:
        hidden = np.array(module(mx.array([tokenizer.encode(text)])).last_hidden_state[0])
        v = hidden.mean(axis=0) if pooling == "mean" else hidden[0]
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def test_loaded_on_first_use_and_listed(live, client):
    def states():
        cards = httpx.get(live.base_url + "/models", timeout=30).json()["data"]
        return {c["id"]: c["status"] for c in cards}

    assert states() == {"chat": "loaded", "embed": "not_loaded", "embed-cls": "not_loaded"}
    embed(client, "hi")
    assert states()["embed"] == "loaded"


def test_unit_norm_shape_and_usage(client, bert_dirs):
    from tokenizers import Tokenizer

    out = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    assert out.model == "embed" and len(out.data) == len(TEXTS)
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (len(TEXTS), HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=TOL)
    tok = Tokenizer.from_file(str(bert_dirs["mean"] / "tokenizer.json"))
    assert out.usage.prompt_tokens == sum(len(tok.encode(t).ids) for t in TEXTS)  # [CLS] and [SEP] counted


@pytest.mark.parametrize("model,pooling", [("embed", "mean"), ("embed-cls", "cls")])
def test_pooling_as_the_folder_says(client, bert_dirs, model, pooling):
    served = embed(client, TEXTS, model=model, encoding_format="float")
    np.testing.assert_allclose(served, reference(bert_dirs[pooling], TEXTS, pooling), atol=TOL)


def test_deterministic_and_alias(client):
    first = embed(client, TEXTS, encoding_format="float")
    assert np.array_equal(first, embed(client, TEXTS, encoding_format="float"))
    assert np.array_equal(first, embed(client, TEXTS, model="bert", encoding_format="float"))


def test_batch_equals_singles(client):
    batch = embed(client, TEXTS, encoding_format="float")
    singles = np.concatenate([embed(client, t, encoding_format="float") for t in TEXTS])
    np.testing.assert_allclose(batch, singles, atol=TOL)


def test_base64_dimensions_and_token_ids(client, bert_dirs):
    from tokenizers import Tokenizer

    floats = embed(client, TEXTS, encoding_format="float")
    assert np.array_equal(embed(client, TEXTS), floats)  # the SDK's default: base64, decoded by it
    short = embed(client, TEXTS, encoding_format="float", dimensions=16)
    np.testing.assert_allclose(short, floats[:, :16] / np.linalg.norm(floats[:, :16], axis=1, keepdims=True),
                               atol=TOL)
    ids = [Tokenizer.from_file(str(bert_dirs["mean"] / "tokenizer.json")).encode(t).ids for t in TEXTS]
    np.testing.assert_allclose(embed(client, ids, encoding_format="float"), floats, atol=TOL)


@pytest.mark.parametrize("kw,param", [
    ({"input": "hi", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": [5] * 600}, "input"),  # past BERT's 512 positions
    ({"input": [10**6]}, "input"),  # outside the vocabulary
])
def test_bad_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embed", **kw)
    assert info.value.param == param, info.value


def test_generation_on_the_encoder_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert info.value.param == "model" and "is an embedding model" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="embed", prompt="hi", max_tokens=4)
    assert info.value.param == "model"


def test_chat_model_beside_it_still_generates(client):
    out = client.completions.create(model="chat", prompt="Once upon a time", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert embed(client, "hi", model="chat", encoding_format="float").shape == (1, 128)  # last-token pooling
