"""/v1/rerank, /rerank and /v1/score against a live server holding a tiny decoder, two tiny random
cross-encoders (BERT and XLM-RoBERTa sequence classifiers) and a tiny BERT embedding model: Cohere's and
Jina's request shapes as raw HTTP, all three scoring methods checked against references computed here
(a numpy forward of the cross-encoders, the decoder's own logits through mlx-lm, cosines of
/v1/embeddings vectors), bad input as 400s, and a 64-document rerank beside a running stream."""

from __future__ import annotations

import math
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.cross_encoder_demo import CrossEncoderDemoConfig, build_cross_encoder_folder
from mlxhost.testing.encoder_demo import EncoderDemoConfig, build_encoder_folder

QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the quick brown fox", "import os and sys",
        "a list of numbers and strings, again and again"]
TOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"bert": build_cross_encoder_folder(tmp_path_factory.mktemp("ce-bert"), CrossEncoderDemoConfig(seed=3)),
            "xlmr": build_cross_encoder_folder(tmp_path_factory.mktemp("ce-xlmr"),
                                               CrossEncoderDemoConfig(kind="xlm_roberta", seed=4)),
            "embed": build_encoder_folder(tmp_path_factory.mktemp("bert-embed"), EncoderDemoConfig())}


@pytest.fixture(scope="module")
def live(qwen3_model_dir, dirs, serve_module_app):
    specs = (ModelSpec("chat", str(qwen3_model_dir), pinned=True, aliases=("tiny-reranker",)),
             ModelSpec("reranker", str(dirs["bert"])), ModelSpec("reranker-xlmr", str(dirs["xlmr"])),
             ModelSpec("embed", str(dirs["embed"])))
    return serve_module_app(build_app(ServerConfig(models=specs, engine=EngineConfig(max_num_seqs=16,
                                                                                      prefill_step_size=64))))


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=300) as c:
        yield c


def rerank(http, path="/v1/rerank", **body) -> dict:
    r = http.post(path, json={"query": QUERY, "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def by_index(out: dict) -> np.ndarray:
    scores = np.zeros(len(out["results"]))
    for res in out["results"]:
        scores[res["index"]] = res["relevance_score"]
    return scores


# -- a reference cross-encoder in numpy -----------------------------------------------------------------


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def numpy_scores(folder, pairs) -> np.ndarray:
    """Hugging Face's BertForSequenceClassification / XLMRobertaForSequenceClassification forward, one
    unpadded pair at a time, in float64 from the folder's files; sigmoid of the one logit."""
    import json

    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    w = {k: np.array(v, dtype=np.float64) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    bert = config["model_type"] == "bert"
    p, eps, heads = ("bert." if bert else "roberta."), config["layer_norm_eps"], config["num_attention_heads"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    out = []
    for query, doc in pairs:
        enc = tok(query, doc)
        ids, n = np.array(enc["input_ids"]), len(enc["input_ids"])
        types = np.array(enc["token_type_ids"]) if bert else np.zeros(n, dtype=int)
        pos = np.arange(n) if bert else np.arange(n) + config["pad_token_id"] + 1
        x = (w[p + "embeddings.word_embeddings.weight"][ids] + w[p + "embeddings.position_embeddings.weight"][pos]
             + w[p + "embeddings.token_type_embeddings.weight"][types])
        x = _ln(x, w[p + "embeddings.LayerNorm.weight"], w[p + "embeddings.LayerNorm.bias"], eps)
        for i in range(config["num_hidden_layers"]):
            L = f"{p}encoder.layer.{i}."

            def lin(name, h):
                return h @ w[L + name + ".weight"].T + w[L + name + ".bias"]

            q, k, v = (lin(f"attention.self.{m}", x).reshape(n, heads, -1).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            att = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
            att = np.exp(att - att.max(-1, keepdims=True))
            ctx = (att / att.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(n, -1)
            x = _ln(lin("attention.output.dense", ctx) + x, w[L + "attention.output.LayerNorm.weight"],
                    w[L + "attention.output.LayerNorm.bias"], eps)
            x = _ln(lin("output.dense", _gelu(lin("intermediate.dense", x))) + x, w[L + "output.LayerNorm.weight"],
                    w[L + "output.LayerNorm.bias"], eps)
        if bert:
            pooled = np.tanh(x[0] @ w["bert.pooler.dense.weight"].T + w["bert.pooler.dense.bias"])
            logit = pooled @ w["classifier.weight"].T + w["classifier.bias"]
        else:
            h = np.tanh(x[0] @ w["classifier.dense.weight"].T + w["classifier.dense.bias"])
            logit = h @ w["classifier.out_proj.weight"].T + w["classifier.out_proj.bias"]
        out.append(1.0 / (1.0 + math.exp(-logit[0])))
    return np.array(out)


# -- the three methods -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model, folder", [("reranker", "bert"), ("reranker-xlmr", "xlmr")])
def test_cross_encoder_matches_a_numpy_reference(http, dirs, model, folder):
    out = rerank(http, model=model)
    assert out["meta"]["method"] == "cross_encoder"
    np.testing.assert_allclose(by_index(out), numpy_scores(dirs[folder], [(QUERY, d) for d in DOCS]), atol=TOL)


def test_cohere_shape_sorted_top_n_and_documents(http):
    out = rerank(http, model="reranker", top_n=2, return_documents=True)
    results = out["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    every = rerank(http, model="reranker")["results"]
    assert [r["index"] for r in results] == [r["index"] for r in every[:2]]
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in results)
    assert [r["relevance_score"] for r in every] == sorted((r["relevance_score"] for r in every), reverse=True)
    assert out["id"].startswith("rerank-") and out["meta"]["billed_units"]["search_units"] == 1
    assert out["usage"]["total_tokens"] > 0


def test_jina_shape_objects_and_no_documents(http):
    docs = [{"text": d} for d in DOCS]
    out = http.post("/rerank", json={"model": "reranker", "query": QUERY, "documents": docs,
                                     "return_documents": False, "top_n": 10}).json()
    assert len(out["results"]) == len(DOCS) and all("document" not in r for r in out["results"])
    np.testing.assert_allclose(by_index(out), by_index(rerank(http, model="reranker")), atol=1e-6)
    assert out["model"] == "reranker" and out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"]


@pytest.mark.parametrize("model", ["embed", "chat"])
def test_embedding_method_is_the_cosine_of_the_embeddings(http, live, model):
    out = rerank(http, model=model, method="embedding" if model == "chat" else None)
    assert out["meta"]["method"] == "embedding"
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as client:
        vectors = np.array([d.embedding for d in client.embeddings.create(model=model, input=[QUERY, *DOCS],
                                                                          encoding_format="float").data])
    np.testing.assert_allclose(by_index(out), vectors[1:] @ vectors[0], atol=TOL)


def test_yes_no_matches_the_decoders_own_logits(http, qwen3_model_dir):
    from mlx_lm import load

    from mlxhost.frontends.rerank.methods import _JUDGE
    from mlxhost.frontends.rerank.protocol import DEFAULT_INSTRUCTION

    out = rerank(http, model="tiny-reranker")  # "rerank" in the name: yes/no by default
    assert out["meta"]["method"] == "yes_no"
    model, tok = load(str(qwen3_model_dir))
    yes, no = (tok.encode(" " + w, add_special_tokens=False)[0] for w in ("yes", "no"))
    expected = []
    for doc in DOCS:
        messages = [{"role": "system", "content": _JUDGE}, {"role": "user", "content":
                    f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32), dtype=np.float64)
        expected.append(1.0 / (1.0 + math.exp(logits[no] - logits[yes])))
    np.testing.assert_allclose(by_index(out), expected, atol=1e-3)


def test_score_endpoint(http):
    r = http.post("/v1/score", json={"model": "reranker", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(DOCS))) and all(d["object"] == "score" for d in data)
    np.testing.assert_allclose([d["score"] for d in data], by_index(rerank(http, model="reranker")), atol=1e-6)
    pairwise = http.post("/v1/score", json={"model": "embed", "text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert len(pairwise["data"]) == 2 and pairwise["meta"]["method"] == "embedding"


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"model": "reranker", "query": QUERY, "documents": []}, "documents"),
    ({"model": "reranker", "query": QUERY, "documents": ["x"] * 1001}, "documents"),
    ({"model": "reranker", "documents": DOCS}, "query"),
    ({"model": "reranker", "query": "  ", "documents": DOCS}, "query"),
    ({"model": "reranker", "query": QUERY, "documents": ["ok", ""]}, "documents"),
    ({"model": "reranker", "query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
    ({"model": "reranker", "query": QUERY, "documents": ["word " * 600]}, "documents"),
    ({"model": "embed", "query": QUERY, "documents": ["word " * 600]}, "documents"),
    ({"model": "reranker", "query": QUERY, "documents": DOCS, "method": "yes_no"}, "method"),
    ({"model": "reranker", "query": QUERY, "documents": DOCS, "rank_fields": ["title"]}, "rank_fields"),
    ({"model": "reranker", "query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
])
def test_bad_input_is_400_in_the_openai_shape(http, body, param):
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or ""), error


def test_long_document_cut_by_max_tokens_per_doc(http):
    out = http.post("/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": ["word " * 600],
                                        "max_tokens_per_doc": 100})
    assert out.status_code == 200 and len(out.json()["results"]) == 1


def test_unknown_model_is_404(http):
    r = http.post("/v1/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# -- beside a running stream -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["embedding", "yes_no"])
def test_64_documents_rerank_while_a_stream_runs(http, live, method):
    """The stream keeps producing tokens while 64 documents are scored on the same model's engine."""
    arrivals: list[float] = []
    first = threading.Event()
    finished = {}

    def stream():
        with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=300) as client:
            for chunk in client.completions.create(model="chat", prompt="Once upon a time", max_tokens=600,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                arrivals.append(time.monotonic())
                first.set()
                finished["reason"] = chunk.choices[0].finish_reason or finished.get("reason")

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(120)
    docs = [f"document number {i} about {'paris' if i % 7 == 0 else 'something else'}" for i in range(64)]
    start = time.monotonic()
    out = rerank(http, model="chat", documents=docs, method=method)
    end = time.monotonic()
    thread.join(300)
    assert len(out["results"]) == 64 and out["meta"]["method"] == method
    assert finished["reason"] == "length" and len(arrivals) >= 100  # the stream ran to its end
    during = [t for t in arrivals if start < t < end]
    assert during, "no token arrived while the rerank ran"
