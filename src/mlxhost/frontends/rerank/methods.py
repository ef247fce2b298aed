"""Three ways to score (query, document) pairs, each through the served model's own engine:

- `cross_encoder`: a sequence-classification reranker (models/cross_encoder.py) reads each pair in one
  forward, batched on its engine thread (engine/scoring.py).
- `yes_no`: a decoder reranker (Qwen3-Reranker style) is asked whether the document answers the query;
  each pair is an ordinary one-token chat request through the Gateway, so the engine batches them
  with running streams. Both answer tokens get a +100 logit bias, which leaves their difference alone
  and puts them first: the two returned logprobs are then log-softmax over just (no, yes), and the score
  is P(yes) = 1 / (1 + exp(lp_no - lp_yes)).
- `embedding`: any embedding model (an encoder, or a decoder's pooled hidden states) embeds both sides;
  the score is their cosine similarity (the vectors are unit length).

Without `method`, the model decides: a cross-encoder scores pairs, an encoder embeds, a decoder whose name
says "rerank" answers yes/no, any other decoder embeds.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Optional

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway, Held, chat_request
from mlxhost.frontends.rerank.protocol import DEFAULT_INSTRUCTION
from mlxhost.serving.embedding import MAX_BATCH_TOKENS, tokenize_texts
from mlxhost.serving.schemas import CompletionRequest

# One-token requests in flight at once for yes/no scoring: the scheduler batches them; more would only
# wait in its queue (and could fill it).
MAX_IN_FLIGHT = 8
_BIAS = 100.0
_JUDGE = ("Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
          "Note that the answer can only be \"yes\" or \"no\".")


@dataclass
class Scored:
    scores: list[float]
    num_tokens: int
    method: str


def _answer_token(tokenizer: Any, word: str) -> Optional[int]:
    """The id of `word` as one token (as it is, or with a leading space); None if it takes several."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        found = convert(word)
        if isinstance(found, int) and found != getattr(tokenizer, "unk_token_id", None):
            return found
    for text in (word, " " + word):
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) == 1:
            return ids[0]
    return None


async def _method(held: Held, name: str, wanted: Optional[str]) -> str:
    served = held.model
    if served.embedding_only:
        from mlxhost.engine.scoring import is_cross_encoder  # imports MLX: loaded only when an encoder scores

        found = "cross_encoder" if await held.run_job(is_cross_encoder) else "embedding"
    else:
        found = "yes_no" if "rerank" in name.lower() else "embedding"
    if wanted is None or wanted == found or (wanted == "yes_no" and not served.embedding_only):
        return wanted or found
    if wanted == "embedding" and not served.embedding_only:
        return wanted
    raise APIError(400, f"method {wanted!r} does not fit `{served.name}`: it scores by {found!r}", "method")


async def score(gateway: Gateway, raw: Any, model: str, pairs: list[tuple[str, str]], wanted: Optional[str],
                instruction: Optional[str], max_doc_tokens: Optional[int] = None,
                params: tuple[str, str] = ("query", "documents")):
    """Scores for `pairs` in order, with the method used; None when the client left. `params` name the
    pairs' two sides in errors."""
    param = params[1]
    async with gateway.hold(model) as held:
        served = held.model
        method = await _method(held, model, wanted)
        if max_doc_tokens is not None:
            pairs = await held.prepare(_cut_documents, served.tokenizer, pairs, max_doc_tokens)
        if method == "cross_encoder":
            return await _cross_encoder(held, pairs, raw, param)
        if method == "embedding":
            return await _embedding(held, pairs, raw, params)
    return await _yes_no(gateway, served, model, pairs, instruction or DEFAULT_INSTRUCTION, raw, param)


def _cut_documents(tokenizer: Any, pairs: list[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    out = []
    for query, doc in pairs:
        ids = list(tokenizer.encode(doc, add_special_tokens=False))
        out.append((query, tokenizer.decode(ids[:limit]) if len(ids) > limit else doc))
    return out


def _pair_ids(tokenizer: Any, pairs: list[tuple[str, str]], max_len: int, param: str) -> list[tuple[list, list]]:
    out = []
    for i, (query, doc) in enumerate(pairs):
        try:
            enc = tokenizer(query, doc)
        except Exception as exc:  # e.g. a lone surrogate that JSON allows but UTF-8 does not
            raise APIError(400, f"{param}[{i}] cannot be tokenized: {exc}", param) from exc
        ids = list(enc["input_ids"])
        if len(ids) > max_len:
            raise APIError(400, f"{param}[{i}]: the query and document take {len(ids)} tokens; this model reads "
                           f"at most {max_len} (shorten it, or send max_tokens_per_doc)", param,
                           "context_length_exceeded")
        out.append((ids, list(enc.get("token_type_ids") or [0] * len(ids))))
    return out


async def _cross_encoder(held: Held, pairs, raw, param: str) -> Optional[Scored]:
    from mlxhost.engine.scoring import CrossEncoderJob  # imports MLX: loaded only when an encoder scores

    served = held.model
    tokenized = await held.prepare(_pair_ids, served.tokenizer, pairs, served.max_model_len, param)
    job = CrossEncoderJob(tokenized, MAX_BATCH_TOKENS)
    while not await held.run_job(job.advance):  # one batch per call
        if await raw.is_disconnected():
            return None
    return Scored([float(s) for s in job.result], sum(len(ids) for ids, _ in tokenized), "cross_encoder")


async def _embedding(held: Held, pairs, raw, params: tuple[str, str]):
    firsts = list(dict.fromkeys(a for a, _ in pairs))  # a query shared by every pair: embedded once
    first_ids = await held.prepare(tokenize_texts, held.model, firsts, params[0])
    second_ids = await held.prepare(tokenize_texts, held.model, [b for _, b in pairs], params[1])
    vectors = await held.embed(first_ids + second_ids, None, raw.is_disconnected)
    if vectors is None:
        return None
    row = {t: i for i, t in enumerate(firsts)}
    scores = [float(vectors[row[a]] @ vectors[len(firsts) + j]) for j, (a, _) in enumerate(pairs)]
    return Scored(scores, sum(len(t) for t in first_ids + second_ids), "embedding")


def _yes_no_request(served: Any, model: str, query: str, doc: str, instruction: str, bias: dict):
    user = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    fields = {"model": model, "max_tokens": 1, "temperature": 0.0, "logit_bias": bias}
    if getattr(served.tokenizer, "chat_template", None):
        return chat_request({**fields, "logprobs": True, "top_logprobs": 2,
                             "messages": [{"role": "system", "content": _JUDGE}, {"role": "user", "content": user}],
                             "chat_template_kwargs": {"enable_thinking": False}})
    return CompletionRequest.model_validate({**fields, "logprobs": 2,
                                             "prompt": f"{_JUDGE}\n{user}\nAnswer (yes or no):"})


async def _yes_no(gateway: Gateway, served: Any, model: str, pairs, instruction: str, raw, param: str):
    yes, no = _answer_token(served.tokenizer, "yes"), _answer_token(served.tokenizer, "no")
    if yes is None or no is None:
        raise APIError(400, f"`{served.name}` has no single-token \"yes\" and \"no\": it cannot score by yes/no; "
                       "send method \"embedding\"", "method")
    bias = {str(yes): _BIAS, str(no): _BIAS}
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(i: int, query: str, doc: str) -> tuple[float, int]:
        async with gate:
            try:
                opened = await gateway.open(_yes_no_request(served, model, query, doc, instruction, bias))
            except APIError as exc:
                raise APIError(exc.status, f"{param}[{i}]: {exc.message}", param, exc.code, exc.headers) from None
            whole = await gateway.collect(opened.outputs, gateway.timer(), raw)
        if whole is None:
            raise asyncio.CancelledError
        top = dict(whole.logprobs[0].top) if whole.logprobs else {}
        lp_yes, lp_no = top.get(yes, -math.inf), top.get(no, -math.inf)
        p_yes = 0.0 if lp_yes == -math.inf else 1.0 / (1.0 + math.exp(min(lp_no - lp_yes, 700.0)))
        return p_yes, whole.last.num_prompt_tokens

    tasks = [asyncio.ensure_future(one(i, q, d)) for i, (q, d) in enumerate(pairs)]
    try:
        results = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        return None
    finally:
        for t in tasks:
            t.cancel()
    return Scored([s for s, _ in results], sum(n for _, n in results), "yes_no")
