"""OpenAI chat and text completions (`POST /v1/chat/completions`, `/v1/completions`) and the model list
(`GET /v1/models`, `/v1/models/{id}`). The bodies are the one internal request as they come: opened
through the gateway, rendered by `render.CompletionBuilder`; n > 1 runs in `choices`. Imports no MLX."""

from __future__ import annotations

from fastapi import FastAPI, Request

from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.keys import current_grant, visible_cards
from mlxhost.frontends.openai.choices import complete_choices
from mlxhost.frontends.openai.mcp import chat_with_mcp
from mlxhost.frontends.openai.render import CompletionBuilder, CompletionFrames, echo_text
from mlxhost.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


def add_model_list_route(app: FastAPI, models) -> None:
    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": visible_cards(models.cards())}


def add_openai_routes(app: FastAPI, gateway: Gateway) -> None:
    models = gateway.models

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        # The openai client's models.retrieve; ids may hold a slash (hub ids), hence :path. A model's or a
        # LoRA adapter's entry; unknown: UnknownModelError -> 404, as is one the request's key may not use.
        if (grant := current_grant.get()) is not None:
            grant.check_model(model_id, models.resolve)
        return models.card(model_id)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        if body.mcp_servers:  # MCP tools run here, in the shared tool-call loop (openai/mcp.py)
            return await chat_with_mcp(gateway, body, raw)
        return await _complete(body, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await _complete(body, raw, chat=False)

    async def _complete(body: SamplingFields, raw: Request, chat: bool):
        opened = await gateway.open(body)
        if body.n > 1:
            return await complete_choices(gateway, body, raw, chat, opened)
        builder = CompletionBuilder(opened.prepared.request.request_id, body.model, chat, opened.model.tokenizer,
                                    opened.prepared.output, echo=echo_text(body, opened.model.tokenizer))

        def render(whole):
            last = whole.last
            return builder.full(whole.text, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                                whole.logprobs or None, last.num_cached_tokens, whole.prompt_logprobs)

        return await gateway.reply(opened.outputs, raw, body.stream, CompletionFrames([builder], body.include_usage),
                                   render)
