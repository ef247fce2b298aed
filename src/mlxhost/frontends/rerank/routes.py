"""`POST /v1/rerank` and `/rerank` (Cohere's and Jina's shape) and `POST /v1/score` (vLLM's).

A rerank answers the union of Cohere's and Jina's responses: `results` sorted by `relevance_score`
(best first; ties keep input order), each with the document's `index` and, unless `return_documents`
is false, the `document` as `{"text": ...}` (an object document comes back as sent); `usage` (Jina's
token counts) and `meta` (Cohere's, plus `method`: which of the three scoring methods ran). Errors come
in the server's OpenAI shape, as vLLM's and llama.cpp's rerank endpoints answer them.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.sse import client_gone
from mlxhost.frontends.rerank.methods import score
from mlxhost.frontends.rerank.protocol import RerankRequest, ScoreRequest


def _meta(method: str) -> dict:
    return {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}, "method": method}


def _usage(num_tokens: int) -> dict:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def add_rerank_routes(app: FastAPI, gateway: Gateway) -> None:
    async def rerank(body: RerankRequest, raw: Request):
        try:
            texts = body.texts()
        except ValueError as exc:
            raise APIError(400, str(exc), "documents") from None
        scored = await score(gateway, raw, body.model, [(body.query, t) for t in texts], body.method,
                             body.instruction, body.max_tokens_per_doc)
        if scored is None:
            return client_gone()
        order = sorted(range(len(texts)), key=lambda i: -scored.scores[i])[:body.top_n or len(texts)]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": scored.scores[i]}
            if body.return_documents:
                doc = body.documents[i]
                result["document"] = {"text": doc} if isinstance(doc, str) else doc
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model, "results": results,
                "usage": _usage(scored.num_tokens), "meta": _meta(scored.method)}

    app.post("/v1/rerank")(rerank)
    app.post("/rerank")(rerank)

    @app.post("/v1/score")
    async def score_pairs(body: ScoreRequest, raw: Request):
        try:
            pairs = body.pairs()
        except ValueError as exc:
            raise APIError(400, str(exc), "text_2") from None
        scored = await score(gateway, raw, body.model, pairs, body.method, body.instruction,
                             params=("text_1", "text_2"))
        if scored is None:
            return client_gone()
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)],
                "usage": _usage(scored.num_tokens), "meta": {"method": scored.method}}
