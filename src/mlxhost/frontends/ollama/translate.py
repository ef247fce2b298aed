"""Ollama bodies as the one internal request: OpenAI chat (or completion) fields, checked by their schema.

`options` follow the project's rule (docs/compat.md): sampling options are mapped; options that would
change the output if ignored and that this server cannot honour are a 400 naming them; load-time and
bookkeeping options (num_ctx, num_gpu, num_thread, ...) are accepted and logged.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, Optional

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import chat_request, completion_request
from mlxhost.frontends.ollama.protocol import ChatRequest, GenerateRequest, Message
from mlxhost.serving.schemas import CompletionRequest

log = logging.getLogger(__name__)

# Ollama option -> OpenAI field, for options whose meaning is the same.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
             "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
             "repeat_penalty": "repetition_penalty"}
# Options that change how the model is loaded or run, never what it says: accepted, logged.
_LOAD_TIME = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "use_mmap",
              "use_mlock", "vocab_only", "f16_kv", "logits_all", "num_keep", "embedding_only", "rope_frequency_base",
              "rope_frequency_scale", "num_gqa", "penalize_newline")
# Options that change the output unless they hold their "off" value: a 400 otherwise.
_OFF_VALUES = {"typical_p": (1, 1.0), "tfs_z": (1, 1.0), "mirostat": (0,)}
# mlx-lm's repetition penalty looks back this many tokens (the engine's window; Ollama's repeat_last_n).
REPEAT_WINDOW = 20
_THINK_EFFORTS = ("low", "medium", "high")


def _options(options: Optional[dict[str, Any]], where: str) -> dict:
    """OpenAI sampling fields for Ollama `options`."""
    options = dict(options or {})
    fields, refused = {}, []
    for name, field in _SAMPLING.items():
        if options.get(name) is not None:
            fields[field] = options.pop(name)
    if fields.get("top_k") is not None and fields["top_k"] <= 0:
        fields["top_k"] = 0  # Ollama: 0 or less turns top-k off
    num_predict = options.pop("num_predict", None)
    if num_predict is not None and num_predict > 0:  # -1 (until done) and -2 (fill the context): no cap
        fields["max_tokens"] = num_predict
    stop = options.pop("stop", None)
    if stop:
        fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    window = options.pop("repeat_last_n", None)
    if window == 0:
        fields.pop("repetition_penalty", None)  # Ollama: 0 turns the penalty off
    elif window is not None and fields.get("repetition_penalty", 1.0) != 1.0 and window != REPEAT_WINDOW:
        refused.append(f"repeat_last_n ({window}: the repetition penalty looks back {REPEAT_WINDOW} tokens here)")
    for name, off in _OFF_VALUES.items():
        value = options.pop(name, None)
        if value is not None and value not in off:
            refused.append(f"{name} ({value}: not supported)")
    options.pop("mirostat_tau", None), options.pop("mirostat_eta", None)  # used only with mirostat on
    if refused:
        raise APIError(400, f"{where}: options this server cannot honour: " + "; ".join(refused), "options")
    used = [n for n in options if n in _LOAD_TIME]
    unknown = sorted(n for n in options if n not in _LOAD_TIME)
    if used or unknown:
        log.debug("%s: options accepted, not used: %s", where, ", ".join(used + unknown))
    return fields


def _format(fmt: Any) -> Optional[dict]:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt, "strict": True}}
    raise APIError(400, f"format must be \"json\" or a JSON schema object, not {str(fmt)[:80]!r}", "format")


def _think(fields: dict, think: Any) -> None:
    if isinstance(think, bool):
        fields["chat_template_kwargs"] = {"enable_thinking": think}
    elif think in _THINK_EFFORTS:
        fields["chat_template_kwargs"] = {"enable_thinking": True}
        fields["reasoning_effort"] = think
    elif think is not None:
        raise APIError(400, "think must be true, false, \"low\", \"medium\" or \"high\"", "think")


def image_url(data: str, where: str) -> str:
    """An Ollama image (base64, no prefix) as a data: URI; the media type from the bytes' signature."""
    if data.startswith("data:"):
        return data
    try:
        head = base64.b64decode(data[:64] + "=" * (-len(data[:64]) % 4), validate=False)
    except ValueError:
        raise APIError(400, "an image is not valid base64", where) from None
    mime = ("image/png" if head.startswith(b"\x89PNG") else "image/jpeg" if head.startswith(b"\xff\xd8")
            else "image/gif" if head.startswith(b"GIF8") else "image/webp" if head[8:12] == b"WEBP" else "image/png")
    return f"data:{mime};base64,{data}"


def _content(text: str, images: Optional[list[str]], where: str):
    if not images:
        return text
    parts = [{"type": "image_url", "image_url": {"url": image_url(img, f"{where}.images")}} for img in images]
    return parts + ([{"type": "text", "text": text}] if text else [])


def _arguments(raw: Any) -> str:
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def _messages(messages: list[Message]) -> list[dict]:
    """Ollama messages as OpenAI ones. Ollama's tool calls carry no ids: each gets one here, and each
    tool result answers the earliest call still open (by `tool_name` when given)."""
    out, open_calls, n = [], [], 0
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if m.role == "tool":
            match = next((c for c in open_calls if m.tool_name in (None, c[1])), open_calls[0] if open_calls else None)
            call_id = match[0] if match else f"call_{n}"
            if match:
                open_calls.remove(match)
            out.append({"role": "tool", "tool_call_id": call_id, "content": m.content or ""})
            continue
        message: dict = {"role": m.role, "content": _content(m.content or "", m.images, where)}
        if m.role == "assistant" and m.thinking:
            message["reasoning_content"] = m.thinking
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                call_id, n = f"call_{n}", n + 1
                open_calls.append((call_id, c.function.name))
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}})
            message["tool_calls"] = calls
        out.append(message)
    return out


def _common(body, where: str) -> dict:
    fields = {"model": body.model, "stream": body.stream, **_options(body.options, where)}
    fields["response_format"] = _format(body.format)
    if body.logprobs:
        fields["logprobs"] = True
        fields["top_logprobs"] = body.top_logprobs or 0
    return fields


def chat_fields(body: ChatRequest) -> dict:
    fields = _common(body, "/api/chat")
    fields["messages"] = _messages(body.messages)
    if body.tools:
        fields["tools"] = body.tools
    _think(fields, body.think)
    return fields


def to_chat(body: ChatRequest):
    return chat_request(chat_fields(body))


def to_generate(body: GenerateRequest, tokenizer: Any):
    """A generate body as a chat request (the model's template around `system` and `prompt`), a completion
    of token ids when `raw` or `context` asks for the prompt as it is, or with `suffix` a fill-in-the-middle
    completion (serving/fim.py builds its prompt, as for OpenAI's `suffix`)."""
    if body.template:
        raise APIError(400, "a per-request template is not supported: the model's chat template is used", "template")
    fields = _common(body, "/api/generate")
    prompt = body.prompt or ""
    if body.suffix and body.raw:  # as Ollama does: a raw prompt is sent as it is (the client marked it up)
        log.debug("/api/generate: suffix not used with raw")
    elif body.suffix:
        for name, value in (("context", body.context), ("images", body.images)):
            if value:
                raise APIError(400, f"suffix (fill-in-the-middle) cannot be combined with {name}", name)
        if body.system:  # a fill-in-the-middle prompt has no place for it (Ollama's insert templates drop it too)
            log.debug("/api/generate: system ignored with suffix")
        return _completion({**fields, "prompt": prompt, "suffix": body.suffix})
    if body.raw or body.context:
        if body.images:
            raise APIError(400, "images need the chat template: send them without raw or context", "images")
        if body.raw:
            text = prompt
        else:  # the new turn in the template, after the conversation's tokens
            messages = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 **_template_kwargs(body))
        try:
            ids = list(tokenizer.encode(text, add_special_tokens=not body.context))
        except Exception as exc:  # e.g. a lone surrogate
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", "prompt") from exc
        return _completion({**fields, "prompt": list(body.context or ()) + ids})
    messages = ([{"role": "system", "content": body.system}] if body.system else [])
    messages.append({"role": "user", "content": _content(prompt, body.images, "images")})
    fields["messages"] = messages
    _think(fields, body.think)
    return chat_request(fields)


def _template_kwargs(body: GenerateRequest) -> dict:
    return {"enable_thinking": body.think} if isinstance(body.think, bool) else {}


def _completion(fields: dict) -> CompletionRequest:
    top = fields.pop("top_logprobs", None)
    if fields.pop("logprobs", None):
        fields["logprobs"] = top or 0  # a completion's logprobs field is the number of alternatives
    if not fields["prompt"] and not fields.get("suffix"):  # fill-in-the-middle at a file's start has no prefix
        raise APIError(400, "the prompt is empty", "prompt")
    return completion_request(fields)
