"""`POST /v1/embeddings` through the official openai client against the real server (qwen3 fixture):
last-token pooled, unit-norm, deterministic, batch = singles, base64 = floats, token ids = text,
Matryoshka truncation, and 400s for bad input."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

TEXTS = ["The quick brown fox", "jumps", "over the lazy dog, again and again and again and again", "a"]
HIDDEN = 128  # DemoModelConfig.hidden_size
TOL = 1e-5


def embed(client, input, **kw) -> np.ndarray:
    out = client.embeddings.create(model="tiny", input=input, **kw)
    assert [d.index for d in out.data] == list(range(len(out.data)))
    return np.array([d.embedding for d in out.data], dtype=np.float64)


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_model_dir):
    return Tokenizer.from_file(str(qwen3_model_dir / "tokenizer.json"))


def test_shape_usage_and_unit_norm(client, hf_tokenizer):
    out = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == "tiny" and len(out.data) == len(TEXTS)
    assert all(d.object == "embedding" and len(d.embedding) == HIDDEN for d in out.data)
    n = sum(len(hf_tokenizer.encode(t).ids) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == n
    vectors = np.array([d.embedding for d in out.data])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=TOL)
    assert len({tuple(v) for v in vectors}) == len(TEXTS)  # different texts, different vectors


def test_deterministic(client):
    first = embed(client, TEXTS[0], encoding_format="float")
    assert np.array_equal(first, embed(client, TEXTS[0], encoding_format="float"))


def test_batch_equals_singles(client):
    batch = embed(client, TEXTS, encoding_format="float")
    singles = np.concatenate([embed(client, t, encoding_format="float") for t in TEXTS])
    np.testing.assert_allclose(batch, singles, atol=TOL)


def test_base64_decodes_to_the_same_floats(client):
    floats = embed(client, TEXTS, encoding_format="float")
    out = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in out.data])
    assert np.array_equal(decoded.astype(np.float64), floats)  # the same float32 values, exactly
    # Without encoding_format the SDK asks for base64 itself and decodes it.
    assert np.array_equal(embed(client, TEXTS), floats)


def test_token_ids_equal_text(client, hf_tokenizer):
    ids = [hf_tokenizer.encode(t).ids for t in TEXTS]
    text = embed(client, TEXTS, encoding_format="float")
    np.testing.assert_allclose(embed(client, ids, encoding_format="float"), text, atol=TOL)
    np.testing.assert_allclose(embed(client, ids[0], encoding_format="float"), text[:1], atol=TOL)


def test_dimensions_truncate_then_renormalize(client):
    full = embed(client, TEXTS, encoding_format="float")
    short = embed(client, TEXTS, encoding_format="float", dimensions=32)
    assert short.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=TOL)
    expected = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=TOL)
    assert embed(client, TEXTS[:1], encoding_format="float", dimensions=HIDDEN).shape == (1, HIDDEN)


@pytest.mark.parametrize("kw,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),  # outside the vocabulary
    ({"input": [5] * 5000}, "input"),  # past the context length (4096)
    ({"input": "hi", "dimensions": HIDDEN + 1}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "extra_body": {"pooling": "mean"}}, "pooling"),  # unknown fields are named
])
def test_bad_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="tiny", **kw)
    assert info.value.param == param, info.value


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


def test_user_field_accepted(client):
    assert len(client.embeddings.create(model="tiny", input="hi", user="u-1").data) == 1


@pytest.mark.anyio
async def test_embeddings_while_streams_run(async_client):
    """An embedding request shares the engine thread with running generations: both complete, and
    the vectors equal the ones computed on an idle engine."""
    idle = await async_client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")

    async def generate():
        stream = await async_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=64,
                                                      stream=True, extra_body={"ignore_eos": True})
        return sum([1 async for chunk in stream if chunk.choices and chunk.choices[0].text is not None])

    gen_tasks = [asyncio.ensure_future(generate()) for _ in range(3)]
    busy = await asyncio.gather(*[async_client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
                                  for _ in range(3)])
    assert all(n > 0 for n in await asyncio.gather(*gen_tasks))
    for out in busy:
        np.testing.assert_allclose([d.embedding for d in out.data], [d.embedding for d in idle.data], atol=TOL)


def test_vision_language_models_say_so(qwen25vl_dir, make_server):
    live = make_server(qwen25vl_dir, max_num_seqs=2)
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="tiny", input="hi")
    assert "vision-language" in info.value.message
