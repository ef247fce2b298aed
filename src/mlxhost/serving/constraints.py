"""What a request's `tools`, `tool_choice` and `response_format` ask of its output: the grammar the
engine enforces (a `structured.grammar.Constraint`) and how the reply is read back (`OutputSpec`).

Shared by every dialect: Anthropic's `tool_choice: any` and Responses' `text.format` arrive here as
their OpenAI equivalents. Bad schemas and impossible combinations are 400s naming the field.
"""

from __future__ import annotations

from typing import Any

from mlxhost.serving.chat_output import OutputSpec
from mlxhost.serving.errors import APIError
from mlxhost.serving.schemas import ChatCompletionRequest, SamplingFields
from mlxhost.structured.grammar import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN3_XML,
    Constraint,
    ConstraintError,
    json_object_constraint,
    json_schema_constraint,
    tag_token_ids,
    tool_call_constraint,
    with_reasoning_prefix,
)

# Tool-call formats the grammar can write, by tool-parser name. Others (pythonic) are parsed from free
# output: `tool_choice: auto` works, forcing a call does not yet.
GRAMMAR_FORMATS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "mistral": MISTRAL, "qwen3_coder": QWEN3_XML}


def output_constraint(model: Any, body: SamplingFields, prompt_text: str | None) -> tuple[Constraint | None, OutputSpec]:
    chat = isinstance(body, ChatCompletionRequest)
    tags = model.reasoning_tags if chat else None
    prompt_end = prompt_text.rstrip() if prompt_text else ""
    starts_in = bool(tags and prompt_end.endswith(tags[0]))
    constraint, tool_format, tools = _tool_constraint(model, body) if chat else (None, None, None)
    format_constraint = _format_constraint(body)
    if format_constraint is not None:
        if constraint is not None:
            raise APIError(400, "response_format cannot be combined with tools unless tool_choice is none",
                           "response_format")
        constraint = format_constraint
    # Reasoning comes before the constrained part when the prompt opened it, or when a reasoning
    # model (think tokens in its vocabulary) may open it itself and the prompt did not close it.
    if constraint is not None and tags and (starts_in or (model.thinks_by_default and not prompt_end.endswith(tags[1]))):
        constraint = with_reasoning_prefix(constraint, *tags, starts_in_reasoning=starts_in,
                                           tag_ids=tag_token_ids(model.tokenizer, tags))
    spec = OutputSpec(reasoning_tags=tags, starts_in_reasoning=starts_in, tool_format=tool_format, tools=tools)
    return constraint, spec


def _tool_constraint(model: Any, body: ChatCompletionRequest):
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice names or requires a tool, but the request has no tools", "tool_choice")
        return None, None, None
    if choice == "none":
        # The template still shows the tools (the model may refer to them); no call is parsed.
        return None, None, None
    if model.tool_parser is None:
        raise APIError(400, f"`{model.name}`'s chat template shows no tool-call format: start the server with "
                       "--tool-call-parser NAME to use tools", "tools")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice in (None, "auto"):
        mode, name = "auto", None
    elif choice == "required":
        mode, name = "required", None
    else:
        mode, name = "named", choice.function.name
    fmt = GRAMMAR_FORMATS.get(model.tool_parser)
    if fmt is None:
        if mode != "auto":
            raise APIError(400, f"tool_choice {mode!r} is not supported for the {model.tool_parser} tool-call "
                           "format yet (only auto)", "tool_choice")
        return None, model.tool_parser, tools
    try:
        # Tags that are single tokens of this tokenizer (Qwen's `<tool_call>`) are accepted as those tokens.
        constraint = tool_call_constraint(tools, mode, fmt, name, parallel=body.parallel_tool_calls is not False,
                                          tag_ids=tag_token_ids(model.tokenizer, fmt.tags))
    except ConstraintError as exc:
        raise APIError(400, str(exc), "tool_choice" if mode == "named" else "tools") from exc
    return constraint, model.tool_parser, tools


def _format_constraint(body: SamplingFields) -> Constraint | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    try:
        if rf.type == "json_object":
            return json_object_constraint()
        return json_schema_constraint(rf.json_schema.schema_, strict=bool(rf.json_schema.strict))
    except ConstraintError as exc:
        raise APIError(400, str(exc), "response_format") from exc
