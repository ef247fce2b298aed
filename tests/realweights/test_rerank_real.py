"""Rerank by embedding cosine with the real all-MiniLM-L6-v2 (sentence-transformers folder, mean pooling):
for "What is the capital of France?" the sentence that answers it ranks first, over near misses, in
Cohere's and Jina's request shapes and through /v1/score."""

from __future__ import annotations

import httpx
import pytest

from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.server.app import build_app
from tests.e2e.conftest import start_app

pytestmark = pytest.mark.needs("minilm")

QUERY = "What is the capital of France?"
ANSWER = "Paris is the capital of France."
DOCS = ["The Eiffel Tower was finished in 1889.", "Berlin is the capital of Germany.", ANSWER,
        "France is famous for its cheese and wine.", "The stock market fell sharply today."]


@pytest.fixture(scope="module")
def http(minilm_dir):
    live = start_app(build_app(ServerConfig(model=str(minilm_dir), served_model_name="minilm",
                                            engine=EngineConfig(max_num_seqs=4))))
    with httpx.Client(base_url=live.url, timeout=300) as client:
        yield client
    live.stop()


def test_paris_ranks_first_cohere_shape(http):
    r = http.post("/v1/rerank", json={"model": "minilm", "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta"]["method"] == "embedding"
    best = out["results"][0]
    assert best["index"] == DOCS.index(ANSWER) and best["document"] == {"text": ANSWER}
    assert best["relevance_score"] > out["results"][1]["relevance_score"]


def test_paris_ranks_first_jina_shape_and_score(http):
    out = http.post("/rerank", json={"model": "minilm", "query": QUERY, "documents": [{"text": d} for d in DOCS],
                                     "return_documents": False}).json()
    assert out["results"][0]["index"] == DOCS.index(ANSWER) and "document" not in out["results"][0]
    scores = [d["score"] for d in http.post("/v1/score", json={"model": "minilm", "text_1": QUERY,
                                                                "text_2": DOCS}).json()["data"]]
    assert max(range(len(DOCS)), key=scores.__getitem__) == DOCS.index(ANSWER)
