"""`POST /v1/embeddings` (OpenAI): inputs tokenized here, vectors pooled on the model's engine thread through
the gateway (`Gateway.embed`), floats or base64 back. Imports no MLX: only the numpy result is touched here."""

from __future__ import annotations

import base64

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.sse import client_gone
from mlxhost.frontends.embeddings.protocol import MAX_INPUTS, EmbeddingRequest

# Padded tokens (rows x longest input) run together in one batch.
_MAX_BATCH_TOKENS = 4096


def tokenize_inputs(model, body: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids; 400 for an empty one, an unknown id, or one past the context length."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input is empty: send a string, a list of strings or token ids", "input")
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"input has {len(inputs)} items; at most {MAX_INPUTS} per request", "input")
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            try:
                ids = list(model.tokenizer.encode(item))
            except Exception as exc:  # e.g. a lone surrogate that JSON allows but UTF-8 does not
                raise APIError(400, f"input[{i}] cannot be tokenized: {exc}", "input") from exc
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise APIError(400, f"input[{i}]: token id {bad[0]} is outside the vocabulary "
                               f"(0..{model.vocab_size - 1})", "input")
        if not ids:
            raise APIError(400, f"input[{i}] is empty", "input")
        if len(ids) > model.max_model_len:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; this model's context length is "
                           f"{model.max_model_len}", "input", "context_length_exceeded")
        out.append(ids)
    return out


def _encode(vector, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_embeddings_route(app: FastAPI, gateway: Gateway) -> None:
    """Registers the route over the gateway's models: every served text model and encoder answers it."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        async with gateway.hold(body.model) as held:
            model = held.model
            if model.audio is not None:
                raise APIError(400, f"`{model.name}` is an audio model: it serves /v1/audio/* only", "model")
            if model.multimodal is not None:
                raise APIError(400, "embeddings are not supported for vision-language models", "model")
            token_lists = tokenize_inputs(model, body)
            vectors = await held.embed(token_lists, body.dimensions, raw.is_disconnected, _MAX_BATCH_TOKENS)
        if vectors is None:
            return client_gone()
        num_tokens = sum(len(t) for t in token_lists)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "model": body.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        })
