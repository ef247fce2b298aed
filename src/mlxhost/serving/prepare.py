"""From an OpenAI request body to an engine `Request`: tokenization, limits and sampling settings."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

from mlxhost.engine.request import Request, SamplingParams
from mlxhost.serving.chat_output import OutputSpec
from mlxhost.serving.constraints import output_constraint
from mlxhost.serving.errors import APIError
from mlxhost.serving.model import ServedModel
from mlxhost.serving.prompt_bound import check_text_fits
from mlxhost.serving.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    SamplingFields,
    TextPart,
    system_merged,
)


def _render_multimodal(model: ServedModel, body: ChatCompletionRequest) -> tuple[list[int], tuple]:
    """Fetches and decodes the media (blocking: the caller runs this off the event loop)."""
    # Media fetching and decoding (images, video): loaded only for a request that carries media.
    from mlxhost.multimodal.media import MediaError
    from mlxhost.multimodal.prompt import MediaPart, PromptError

    if model.multimodal is None:
        raise APIError(400, f"`{model.name}` is a text-only model: image and video parts need a "
                       "vision-language model", "messages")
    messages, parts = [], []
    for m in body.messages:
        message = _message_dict(m)  # its tool calls and tool results too: an agent's screenshot turn keeps them
        messages.append(message)
        if not isinstance(m.content, list):
            continue
        content = []
        for p in m.content:
            if isinstance(p, TextPart):
                content.append({"type": "text", "text": p.text})
            elif isinstance(p, ImagePart):
                content.append({"type": "image"})
                parts.append(MediaPart("image", p.url))
            else:
                content.append({"type": "video"})
                parts.append(MediaPart("video", *p.source()))
        message["content"] = content
    try:
        return model.multimodal.build(messages, parts, _listed_tools(body), **_template_kwargs(body))
    except MediaError as exc:
        raise APIError(400, str(exc), exc.param or "messages", "invalid_media") from exc
    except PromptError as exc:
        raise APIError(400, str(exc), "messages") from exc


def _message_dict(m: ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _arguments(raw: str | dict) -> dict:
    """Templates render arguments as objects (Qwen's `tojson`), so a JSON string is parsed first."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        raise APIError(400, f"tool call arguments are not valid JSON: {raw[:200]!r}", "messages") from None
    if not isinstance(value, dict):
        raise APIError(400, "tool call arguments must be a JSON object", "messages")
    return value


def _listed_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools the chat template lists (not every callable one: schemas.ChatCompletionRequest.listed_tools)."""
    return [t.model_dump(exclude_none=True) for t in body.listed_tools] or None


def _template_kwargs(body: ChatCompletionRequest) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def _render_chat(model: ServedModel, body: ChatCompletionRequest) -> str | list[int]:
    """The prompt as text (a chat template's rendering) or token ids (no template)."""
    messages = [_message_dict(m) for m in body.messages]
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        kwargs = _template_kwargs(body)
        tools = _listed_tools(body)
        try:
            return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # a template may reject a role order, e.g. two system messages
            merged = system_merged(messages)
            if merged != messages:  # system messages mid-conversation: where this template takes them
                try:
                    return tok.apply_chat_template(merged, tools=tools, add_generation_prompt=True, tokenize=False,
                                                   **kwargs)
                except Exception:
                    pass
            raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from exc
    if body.tools:
        raise APIError(400, f"`{model.name}` has no chat template, so it cannot be given tools", "tools")
    # Base models without a template: a plain transcript, like a user would type it.
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    _check_fits(model, body, text, "messages")
    return list(tok.encode(text))


def _check_fits(model: ServedModel, body: SamplingFields, text: str, param: str) -> None:
    """Before tokenizing: refuses a text too long for the context at any tokenization (prompt_bound.py)."""
    check_text_fits(text, model.max_token_chars, model.max_model_len, body.requested_max_tokens, param)


def _completion_prompt(model: ServedModel, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if body.suffix:  # an empty suffix asks for nothing after the text: a plain completion (as Ollama reads it)
        if model.fim is None:
            raise APIError(400, f"`{model.name}` does not complete between a prompt and a suffix: its vocabulary has "
                           "no fill-in-the-middle markers, or it is not named as a code model (--fim on serves it; "
                           "code models such as Qwen2.5-Coder, StarCoder2, CodeGemma and DeepSeek-Coder can)",
                           "suffix")
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs the prompt as text, not token ids", "suffix")
        prompt = model.fim.prompt(prompt, body.suffix)
    if isinstance(prompt, str):
        _check_fits(model, body, prompt, "prompt")
        try:
            return list(model.tokenizer.encode(prompt))
        except Exception as exc:  # e.g. a lone surrogate ("\ud800") that JSON allows but UTF-8 does not
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from exc
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{model.vocab_size - 1})", "prompt")
    return list(prompt)


def _max_tokens(model: ServedModel, body: SamplingFields, num_prompt: int) -> int:
    room = model.max_model_len - num_prompt
    requested = body.requested_max_tokens
    if requested is None:
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {num_prompt} tokens; this model's context length is {model.max_model_len}",
                "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                "context_length_exceeded",
            )
        return min(model.default_max_tokens, room, model.max_tokens_cap or room)
    if model.max_tokens_cap is not None and requested > model.max_tokens_cap:
        raise APIError(400, f"max_tokens is {requested}; this server allows at most {model.max_tokens_cap} per "
                       "request", "max_tokens", "max_tokens_exceeded")
    if num_prompt + requested > model.max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {model.max_model_len} tokens, but the request asks for "
            f"{num_prompt} prompt tokens + {requested} completion tokens = {num_prompt + requested}",
            "max_tokens",
            "context_length_exceeded",
        )
    return requested


def _logit_bias(model: ServedModel, body: SamplingFields) -> tuple[tuple[int, float], ...]:
    if not body.logit_bias:
        return ()
    out = []
    for key, value in body.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < model.vocab_size:
            raise APIError(400, f"logit_bias token id {token} is outside the vocabulary (0..{model.vocab_size - 1})", "logit_bias")
        out.append((token, value))
    return tuple(out)


def choice_request_id(request_id: str, i: int) -> str:
    """The engine request id of choice `i` of an n > 1 request (choice 0 keeps the request's own)."""
    return f"{request_id}-{i}" if i else request_id


@dataclass
class Prepared:
    request: Request
    output: OutputSpec  # how to read the reply (reasoning, tool calls)

    def copy(self, i: int) -> Request:
        """Choice `i` of an n > 1 request: the same prompt, its own id and (if seeded) its own seed, so
        the choices differ as OpenAI's do; the prompt's KV comes from the prefix cache. An echoed prompt's
        logprobs are choice 0's: a copy scoring it again would prefill it whole again."""
        r, sp = self.request, self.request.sampling
        seed = (sp.seed + i) % 2**64 if sp.seed is not None else None
        return Request(choice_request_id(r.request_id, i), list(r.prompt_token_ids),
                       replace(sp, seed=seed, prompt_logprobs=None), r.eos_token_ids, media=r.media,
                       adapter=r.adapter, priority=r.priority, cache_group=r.cache_group,
                       num_shared_prefix_tokens=r.num_shared_prefix_tokens)


def make_request(model: ServedModel, body: SamplingFields) -> Request:
    return prepare(model, body).request


def prepare(model: ServedModel, body: SamplingFields) -> Prepared:
    """Validates what pydantic cannot (model name, n, context limits, token ids, schemas) and builds the
    engine request plus how its output is read."""
    model.check_name(body.model)
    if isinstance(body, CompletionRequest) and body.echo and body.suffix:
        raise APIError(400, "echo cannot be combined with suffix: the reply would not start with the prompt", "echo")
    media, prompt_text = (), None
    if isinstance(body, ChatCompletionRequest) and body.has_media:
        (prompt_ids, media), prefix = _render_multimodal(model, body), "chatcmpl"
    elif isinstance(body, ChatCompletionRequest):
        rendered, prefix = _render_chat(model, body), "chatcmpl"
        if isinstance(rendered, str):
            prompt_text = rendered
            _check_fits(model, body, rendered, "messages")
            try:
                prompt_ids = list(model.tokenizer.encode(rendered, add_special_tokens=False))
            except Exception as exc:  # e.g. a lone surrogate that JSON allows but UTF-8 does not
                raise APIError(400, f"the messages cannot be tokenized: {exc}", "messages") from exc
        else:
            prompt_ids = rendered
    else:
        prompt_ids, prefix = _completion_prompt(model, body), "cmpl"
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    constraint, output = output_constraint(model, body, prompt_text)
    if constraint is not None and body.ignore_eos:
        raise APIError(400, "ignore_eos cannot be combined with tools or response_format: the grammar ends "
                       "the output with end-of-sequence", "ignore_eos")
    params = SamplingParams(
        max_tokens=_max_tokens(model, body, len(prompt_ids)),
        temperature=body.temperature,
        top_p=body.top_p,
        # mlx-lm's top-k sampler raises for k >= vocab (inside a compiled function, which also breaks
        # mx.random's global state for every later request): such a k filters nothing, so it means "off".
        top_k=body.top_k if 0 < body.top_k < model.vocab_size else 0,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(model, body),
        # mx.random.key takes 0..2**64-1; a negative int64 seed maps onto that range (two's complement).
        seed=body.seed % 2**64 if body.seed is not None else None,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs is not None if isinstance(body, CompletionRequest) else body.logprobs,
        top_logprobs=body.num_top_logprobs,
        # echo with logprobs: the prompt's own too, each with as many alternatives as the output's.
        prompt_logprobs=body.logprobs if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None
        else None,
        constraint=constraint,
        speculative=body.speculative not in (False, "off"),
    )
    eos = model.eos_token_ids
    if isinstance(body, CompletionRequest) and body.suffix:
        eos = eos | model.fim.stop_ids  # an instruct model's end of turn is not how a middle ends
    request = Request(f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, eos, media=media, adapter=model.adapter,
                      priority=body.priority or 0, cache_ttl_s=body.cache_ttl_s)
    return Prepared(request, output)
