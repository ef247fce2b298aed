"""Ollama's API (`/api/...`) as a front gateway: chat and generate are translated into the one internal
request and opened through the one `Gateway`; embeddings run as `/v1/embeddings` does; the model routes
read the model manager. Errors on /api/ paths come in Ollama's shape, `{"error": "..."}`.

`keep_alive` sets the model's idle unload time for its current load (0: unload once its requests end,
negative: never for being idle); a request with nothing to generate only loads or unloads, as Ollama's
`ollama run` / `ollama stop` use it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import StreamingResponse

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.keys import visible_cards
from mlxhost.frontends.common.sse import client_gone
from mlxhost.frontends.ollama.errors import install_ollama_errors
from mlxhost.frontends.ollama.listing import ps_entry, show, tag_entry
from mlxhost.frontends.ollama.protocol import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    NamedRequest,
    keep_alive_seconds,
)
from mlxhost.frontends.ollama.pulling import default_pull, hub_id, pull_error, pull_lines
from mlxhost.frontends.ollama.render import NDJSON, Durations, Reply, line, now_iso
from mlxhost.frontends.ollama.translate import to_chat, to_generate
from mlxhost.serving.embedding import tokenize_texts

log = logging.getLogger(__name__)

# The Ollama API level these routes follow (clients gate features such as tools on it).
OLLAMA_VERSION = "0.12.0"
_REFUSED = {
    "/api/delete": "mlxhost does not delete model files over HTTP: remove the folder, or the Hugging Face cache "
                   "entry with `hf cache delete`, on the server",
    "/api/copy": "mlxhost does not copy models: serve the same folder under another name with --served-model-name "
                 "or an alias in --models-config",
    "/api/create": "mlxhost does not build models from Modelfiles: serve a model folder or Hugging Face id",
    "/api/push": "mlxhost does not push models to a registry",
}


# -- helpers ---------------------------------------------------------------------------------------


def _adapter(models, name: str):
    adapters = getattr(models, "adapters", None)  # LoRA adapters served as models (lora/registry.py)
    return adapters.find(name) if adapters is not None else None


def _served_name(models, requested: str) -> str:
    """The served name for an Ollama model name: `name:latest` is `name` (Ollama adds the tag); a LoRA
    adapter's name as it is (the lease routes it to its base model)."""
    try:
        return models.resolve(requested)
    except LookupError:
        if _adapter(models, requested) is not None:
            return requested
        base, _, tag = requested.rpartition(":")
        if base and tag == "latest":
            return _served_name(models, base)
        raise


def _model_of(models, name: str) -> str:
    """The loaded model behind a served name: an adapter's base model, else the model itself."""
    adapter = _adapter(models, name)
    return adapter.base if adapter is not None else models.resolve(name)


def _keep(models, name: str, seconds: float) -> None:
    """A request's keep_alive onto its model; an adapter's is ignored (unloading its base for it would take
    every other user of the base model with it)."""
    if _adapter(models, name) is None:
        models.keep_alive(models.resolve(name), seconds)
    else:
        log.debug("keep_alive %s for the adapter %r: not applied", seconds, name)


def _source(models, card: dict) -> str:
    return card.get("lora_path") or models.source(card["id"])


def _keep_alive(value) -> Optional[float]:
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise APIError(400, str(exc), "keep_alive") from None


async def _marked(outputs: AsyncIterator[RequestOutput], durations: Durations):
    async for out in outputs:
        durations.mark_output()
        yield out


async def _load_only(models, name: str, requested: str, keep: Optional[float], chat: bool) -> dict:
    """A request with nothing to generate: load the model, or unload it when keep_alive is 0."""
    if keep == 0:
        if not await models.unload(name):
            _keep(models, name, 0)  # busy: it goes once its requests end
        reason = "unload"
    else:
        await models.load(name)
        if keep is not None:
            _keep(models, name, keep)
        reason = "load"
    body = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": requested, "created_at": now_iso(), **body, "done": True, "done_reason": reason}


# -- routes ----------------------------------------------------------------------------------------


def add_ollama_routes(app: FastAPI, gateway: Gateway, pull_fn: Callable[[str], Any] = default_pull) -> None:
    """The /api/ routes over `gateway` (and its model manager). `pull_fn(repo_id) -> folder` downloads for
    /api/pull (a worker thread runs it; tests pass a fake)."""
    models = gateway.models
    install_ollama_errors(app)
    # Not in /openapi.json: that document describes the OpenAI-shaped API (its error schema, SSE streams).
    router = APIRouter(include_in_schema=False)

    async def generate_reply(opening, name: str, requested: str, keep: Optional[float], chat: bool, want_logprobs: bool,
                             stream: bool, raw: Request, durations: Durations):
        opened = await opening
        durations.mark_loaded()
        if keep is not None:
            _keep(models, name, keep)
        reply = Reply(requested, opened, chat, durations, want_logprobs)

        def render(whole) -> dict:
            joined = dataclasses.replace(whole.last, new_token_ids=whole.token_ids, text=whole.text,
                                         logprobs=whole.logprobs or None)
            return reply.whole([joined])

        # A streamed reply marks its first output itself; a collected one through `_marked`.
        outputs = opened.outputs if stream else _marked(opened.outputs, durations)
        return await gateway.reply(outputs, raw, stream, reply, render, media_type=NDJSON)

    @router.post("/api/chat")
    async def chat(body: ChatRequest, raw: Request):
        durations = Durations()
        keep, requested = _keep_alive(body.keep_alive), body.model
        body.model = _served_name(models, requested)
        if not body.messages:
            return await _load_only(models, body.model, requested, keep, chat=True)
        return await generate_reply(gateway.open(to_chat(body)), body.model, requested, keep, True, bool(body.logprobs),
                                    body.stream, raw, durations)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, raw: Request):
        durations = Durations()
        keep, requested = _keep_alive(body.keep_alive), body.model
        body.model = _served_name(models, requested)
        if not body.prompt and not body.suffix and not body.images and not body.context:
            return await _load_only(models, body.model, requested, keep, chat=False)
        def build(served):
            if served.embedding_only:
                raise APIError(400, f"`{requested}` is an embedding model: it serves /api/embed only", "model")
            if body.suffix and served.fim is None:  # raw or not: Ollama asks for the "insert" capability either way
                raise APIError(400, f"`{requested}` does not support insert (fill-in-the-middle): its vocabulary has "
                               "no markers, or it is not a code model (--fim on)", "suffix")
            return to_generate(body, served.tokenizer)

        return await generate_reply(gateway.open_built(body.model, build), body.model, requested, keep, False,
                                    bool(body.logprobs), body.stream, raw, durations)

    async def embed_texts(requested: str, texts: list[str], truncate: bool, dimensions, keep, raw: Request):
        name = _served_name(models, requested)
        async with gateway.hold(name) as held:
            token_lists = await held.prepare(tokenize_texts, held.model, texts, "input", truncate)
            vectors = await held.embed(token_lists, dimensions, raw.is_disconnected)
            if keep is not None:
                _keep(models, name, keep)
        return vectors, sum(len(t) for t in token_lists)

    @router.post("/api/embed")
    async def embed(body: EmbedRequest, raw: Request):
        durations = Durations()
        texts = [body.input] if isinstance(body.input, str) else list(body.input)
        if not texts:
            raise APIError(400, "input is empty: send a string or a list of strings", "input")
        vectors, num_tokens = await embed_texts(body.model, texts, body.truncate, body.dimensions,
                                                _keep_alive(body.keep_alive), raw)
        if vectors is None:
            return client_gone()
        stats = durations.stats(None)
        return {"model": body.model, "embeddings": vectors.tolist(), "total_duration": stats["total_duration"],
                "load_duration": 0, "prompt_eval_count": num_tokens}

    @router.post("/api/embeddings")
    async def embeddings(body: EmbeddingsRequest, raw: Request):
        if not body.prompt:  # Ollama answers an empty prompt with an empty vector
            return {"embedding": []}
        vectors, _ = await embed_texts(body.model, [body.prompt], True, None, _keep_alive(body.keep_alive), raw)
        if vectors is None:
            return client_gone()
        return {"embedding": vectors[0].tolist()}

    @router.get("/api/tags")
    async def tags():
        return {"models": [tag_entry(card, _source(models, card)) for card in visible_cards(models.cards())]}

    @router.get("/api/ps")
    async def ps():
        return {"models": [ps_entry(card, _source(models, card), models.expires_in(_model_of(models, card["id"])))
                           for card in visible_cards(models.cards()) if card["status"] == "loaded"]}

    @router.post("/api/show")
    async def show_model(body: NamedRequest):
        name = _served_name(models, body.target)
        card = next(c for c in models.cards() if c["id"] == name)
        served = None
        if card["status"] == "loaded":  # the template and capabilities of the loaded model; nothing loads
            async with gateway.hold(name) as held:
                served = held.model
        return show(card, _source(models, card), served)

    @router.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @router.post("/api/pull")
    async def pull(body: NamedRequest):
        repo_id = hub_id(body.target)
        if body.stream:
            async def lines():
                async for obj in pull_lines(repo_id, pull_fn):
                    yield line(obj)

            return StreamingResponse(lines(), media_type=NDJSON)
        try:
            await asyncio.to_thread(pull_fn, repo_id)
        except Exception as exc:  # noqa: BLE001
            raise pull_error(exc) from exc
        return {"status": "success"}

    for path, reason in _REFUSED.items():
        method = router.delete if path == "/api/delete" else router.post

        def refuse(reason: str = reason):
            async def refused():
                raise APIError(403, reason)

            return refused

        method(path)(refuse())
    app.include_router(router)
