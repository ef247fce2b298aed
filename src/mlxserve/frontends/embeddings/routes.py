"""`POST /v1/embeddings` (OpenAI): inputs tokenized here, pooled hidden states computed on the engine
thread (engine/embeddings.py), floats or base64 back. Imports no MLX: the engine side is imported
inside the handler and only its numpy result is touched here."""

from __future__ import annotations

import base64
from typing import Annotated, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from mlxserve.frontends.common.errors import APIError
from mlxserve.frontends.common.schemas import StrictModel
from mlxserve.frontends.common.sse import client_gone

# OpenAI's own limit on inputs per request.
MAX_INPUTS = 2048
# Padded tokens (rows x longest input) run together in one batch.
_MAX_BATCH_TOKENS = 4096


class EmbeddingRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled field is a 400, not silently ignored

    input: Union[str, list[str], list[int], list[list[int]]]
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    user: Optional[str] = None


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


def add_embeddings_route(app: FastAPI, models) -> None:
    """Registers the route over `models` (a ModelManager): every served text model and encoder answers it."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        from mlxserve.engine.embeddings import DimensionsTooLargeError, EmbeddingJob, EmbeddingsUnsupportedError

        async with models.lease(body.model) as (model, engine):
            if model.audio is not None:
                raise APIError(400, f"`{model.name}` is an audio model: it serves /v1/audio/* only", "model")
            if model.multimodal is not None:
                raise APIError(400, "embeddings are not supported for vision-language models", "model")
            token_lists = tokenize_inputs(model, body)
            if model.embedding_only:
                # An encoder (BERT-style): its own engine thread, one batch per call (engine/encoder.py).
                from mlxserve.engine.encoder import EncoderJob

                job = EncoderJob(token_lists, body.dimensions, max_batch_tokens=_MAX_BATCH_TOKENS)
                advance = job.advance
            else:
                job = EmbeddingJob(token_lists, body.dimensions, max_batch_tokens=_MAX_BATCH_TOKENS)

                def advance(core) -> bool:
                    # Chunks as long as the engine's prefill chunks: no call stalls streams longer than a step.
                    return job.advance(core.runner.model, core.config.prefill_step_size)

            try:
                # One chunk per call: decode steps of running streams go on in between.
                while not await engine.call(advance):
                    if await raw.is_disconnected():
                        return client_gone()
            except DimensionsTooLargeError as exc:
                raise APIError(400, str(exc), "dimensions") from exc
            except EmbeddingsUnsupportedError as exc:
                raise APIError(400, f"embeddings are not supported for this model: {exc}", "model") from exc
        num_tokens = sum(len(t) for t in token_lists)
        return JSONResponse({
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                     for i, v in enumerate(job.result)],
            "model": body.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        })
