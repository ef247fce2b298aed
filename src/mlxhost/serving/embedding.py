"""Embedding vectors for any front door (`Gateway.embed`): texts tokenized for a served model, pooled on
its engine thread by the engine's own jobs (engine/embeddings.py for decoders, engine/encoder.py for
BERT-style encoders), one short chunk per `engine.call`, so running streams keep their decode steps in
between. Imports no MLX: the engine side is imported when a job runs, and only its numpy result is
touched here.
"""

from __future__ import annotations

from typing import Any, Optional

from mlxhost.serving.errors import APIError

# Padded tokens (rows x longest input) an encoder runs in one call. Encoders have their own engine thread,
# but share the device with the decoders' streams: smaller batches keep a big request from holding it long.
MAX_BATCH_TOKENS = 1024


def tokenize_texts(model: Any, texts: list[str], param: str, truncate: bool = False) -> list[list[int]]:
    """Each text's token ids; 400 for an empty one, or (without `truncate`) one past the context."""
    out = []
    for i, text in enumerate(texts):
        try:
            ids = list(model.tokenizer.encode(text))
        except Exception as exc:  # e.g. a lone surrogate that JSON allows but UTF-8 does not
            raise APIError(400, f"{param}[{i}] cannot be tokenized: {exc}", param) from exc
        if not ids:
            raise APIError(400, f"{param}[{i}] is empty", param)
        if len(ids) > model.max_model_len:
            if not truncate:
                raise APIError(400, f"{param}[{i}] has {len(ids)} tokens; this model's context length is "
                               f"{model.max_model_len}", param, "context_length_exceeded")
            ids = ids[:model.max_model_len]
        out.append(ids)
    return out


async def embed_token_lists(model: Any, engine: Any, token_lists: list[list[int]], dimensions: Optional[int] = None,
                            is_gone=None, max_batch_tokens: Optional[int] = None):
    """[N, D] unit-norm float32 vectors (numpy) of `token_lists` from a leased model; None when
    `is_gone()` (an async check between chunks) says the client left. `max_batch_tokens`: padded tokens
    per batch (default: MAX_BATCH_TOKENS for an encoder, one prefill chunk for a decoder)."""
    # The engine's jobs import MLX: loaded when one runs, so frontends/ and serving/ import none.
    from mlxhost.engine.embeddings import DimensionsTooLargeError, EmbeddingJob, EmbeddingsUnsupportedError

    if model.multimodal is not None:
        raise APIError(400, "embeddings are not supported for vision-language models", "model")
    if model.embedding_only:
        from mlxhost.engine.encoder import EncoderJob  # as above: MLX, loaded when the job runs

        job = EncoderJob(token_lists, dimensions, max_batch_tokens=max_batch_tokens or MAX_BATCH_TOKENS)
    else:
        if max_batch_tokens is None:
            # A decoder's engine thread also runs its streams: each call computes at most one prefill
            # chunk's worth of tokens (rows x positions), so no call stalls them longer than a prefill step.
            max_batch_tokens = await engine.call(lambda core: core.config.prefill_step_size)
        job = EmbeddingJob(token_lists, dimensions, max_batch_tokens=max_batch_tokens)
    # One chunk per call, each job advancing on the engine's own model: decode steps of running streams
    # go on in between.
    advance = job.advance if model.embedding_only else job.advance_on
    try:
        while not await engine.call(advance):
            if is_gone is not None and await is_gone():
                return None
    except DimensionsTooLargeError as exc:
        raise APIError(400, str(exc), "dimensions") from exc
    except EmbeddingsUnsupportedError as exc:
        raise APIError(400, f"embeddings are not supported for this model: {exc}", "model") from exc
    return job.result
