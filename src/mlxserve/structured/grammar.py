"""Grammars for constrained decoding, built as plain data (llguidance grammar strings; no MLX).

The API turns `response_format` and `tool_choice` into a `Constraint` here, once per request; the engine
compiles it against the served tokenizer (`matcher.py`) and masks each step's logits with it.

Every grammar is a llguidance "grammars" document: grammar 0 is the top level, JSON schemas and Lark
rules reference each other by name (`@args_0`). Tool arguments stay separate sub-grammars so each
schema keeps its own root and its `#/$defs/...` references still resolve.

Tags such as `<tool_call>` and `<think>` are matched as text. That covers tokenizers where they are plain
words or added tokens that are not "special" (Qwen, Hermes, DeepSeek-R1); a tag that is a *special*
token in the tokenizer (Mistral's `[TOOL_CALLS]` in v3+ tokenizers) cannot be produced through a text
literal, because llguidance keeps special tokens out of text matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

TOOL_CHOICE_MODES = ("auto", "required", "named")
_TOOL_BODIES = ("hermes_json", "llama3_json", "mistral")


@dataclass(frozen=True)
class Constraint:
    """What the engine's request carries: a llguidance grammar (serialized) and a label for logs/metrics."""

    grammar: str
    kind: str


class ConstraintError(ValueError):
    """A schema or tool definition that cannot be enforced; the message is meant for the client (a 400)."""


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls.

    body "hermes_json": every call is `start {"name": ..., "arguments": ...} end`, calls joined by `separator`.
    body "llama3_json": `start {"name": ..., "parameters": ...}` calls joined by `separator`, then `end`.
    body "mistral": `start [{"name": ..., "arguments": ...}, ...] end`: one JSON array holds every call.
    """

    start: str
    end: str
    body: str = "hermes_json"
    separator: str = "\n"

    def __post_init__(self):
        if self.body not in _TOOL_BODIES:
            raise ValueError(f"body must be one of {_TOOL_BODIES}, got {self.body!r}")
        if not self.start and self.body == "hermes_json":
            raise ValueError("hermes_json needs a start tag: it is what separates calls from text")

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.body == "llama3_json" else "arguments"

    @property
    def tags_per_call(self) -> bool:
        return self.body == "hermes_json"


# The layouts mlx-lm's and vLLM's parsers read back (Qwen2.5/Qwen3/Hermes chat templates, Llama 3.1+
# JSON tool calling, Mistral v0.3 JSON tool calls).
HERMES = ToolFormat(start="<tool_call>\n", end="\n</tool_call>", body="hermes_json", separator="\n")
LLAMA3_JSON = ToolFormat(start="", end="", body="llama3_json", separator="; ")
MISTRAL = ToolFormat(start="[TOOL_CALLS]", end="", body="mistral", separator=", ")


def json_schema_constraint(schema: dict, strict: bool = False) -> Constraint:
    """Output must be one JSON value valid against `schema`.

    strict=False ignores keywords llguidance cannot enforce (a warning inside llguidance), strict=True
    refuses them; schema errors (bad types, dangling `$ref`s, look-around patterns) are refused either way.
    """
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be a JSON object")
    sub = _json_subgrammar(schema, strict, name="json_schema", what="JSON schema")
    return Constraint(_document([sub]), "json_schema")


def json_object_constraint() -> Constraint:
    """Output must be one JSON object (any keys, any values)."""
    sub = _json_subgrammar({"type": "object"}, strict=True, name="json_object", what="JSON object")
    return Constraint(_document([sub]), "json_object")


def tool_call_constraint(
    tools: list[dict], mode: str, fmt: ToolFormat = HERMES, name: str | None = None, parallel: bool = True
) -> Constraint:
    """Output must call the given OpenAI-style tools in `fmt`'s layout.

    mode "required": at least one call (several with `parallel`), then only EOS.
    mode "named": exactly one call to `name`, then only EOS.
    mode "auto": free text, or (once the model writes the start tag) well-formed calls, then only EOS.
    """
    if mode not in TOOL_CHOICE_MODES:
        raise ConstraintError(f"tool_choice mode must be one of {TOOL_CHOICE_MODES}, got {mode!r}")
    specs = _tool_specs(tools)
    if mode == "named":
        specs = [spec for spec in specs if spec[0] == name]
        if not specs:
            raise ConstraintError(f"tool_choice names the function {name!r}, which is not among the tools")
        parallel = False
    subs, calls = [], []
    for i, (tool, params, strict) in enumerate(specs):
        subs.append(_json_subgrammar(params, strict, f"args_{i}", f"parameters schema of tool {tool!r}"))
        calls.append(f'call_{i}: {_lit(_call_prefix(tool, fmt))} @args_{i} "}}"')
    lines = [
        "start: " + ("tool_calls" if mode != "auto" else f"{_free_text_rule(fmt)} | tool_calls"),
        "tool_calls: " + _calls_expr(fmt, parallel, lazy_open=mode == "auto"),
        "call: " + " | ".join(f"call_{i}" for i in range(len(specs))),
        *calls,
    ]
    if mode == "auto":
        lines += _auto_rules(fmt)
    return _checked(Constraint(_document([{"lark_grammar": "\n".join(lines) + "\n"}, *subs]), "tool_call"))


def with_reasoning_prefix(
    constraint: Constraint, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False
) -> Constraint:
    """Free reasoning text first, closed by `end`; `constraint` applies only after it.

    When the prompt already opened the reasoning (`starts_in_reasoning`), the output starts inside it and
    must close it; otherwise the model may open it with `start` or skip it and answer directly.
    """
    grammars = _grammars(constraint.grammar)
    names = {g.get("name") for g in grammars}
    inner = next(f"constrained_{i}" for i in range(len(names) + 1) if f"constrained_{i}" not in names)
    grammars[0] = {**grammars[0], "name": inner}
    opened = "" if starts_in_reasoning else _lit(start) + " "
    lark = "\n".join([
        f"start: reasoning{'' if starts_in_reasoning else '?'} REASONING_GAP @{inner}",
        # Lazy: the reasoning ends at the first `end`, so text after it is held to the constraint.
        f"reasoning[lazy]: {opened}REASONING_TEXT {_lit(end)}",
        r"REASONING_TEXT: /(.|\n)*/",
        # Chat templates put a blank line or two between the reasoning and the answer.
        r"REASONING_GAP: /[ \n]{0,4}/",
    ]) + "\n"
    return _checked(Constraint(_document([{"lark_grammar": lark}, *grammars]), constraint.kind))


def _json_options(strict: bool) -> dict:
    # Compact JSON, except the ", " and ": " that json.dumps and chat templates write; nowhere else may
    # whitespace go, so a model cannot loop on it. These override any `x-guidance` in the user's schema.
    compact = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
    return {**compact, "lenient": not strict}


def _json_subgrammar(schema: dict, strict: bool, name: str, what: str) -> dict:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(strict))
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"invalid {what}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"invalid or unsupported {what}: {_first_lines(error)}")
    return {**json.loads(grammar)["grammars"][0], "name": name}


def _tool_specs(tools: list[dict]) -> list[tuple[str, dict, bool]]:
    if not tools:
        raise ConstraintError("tool_choice needs at least one tool")
    specs, seen = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ConstraintError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ConstraintError(f"tools[{i}].function.name must be a non-empty string")
        if name in seen:
            raise ConstraintError(f"two tools are named {name!r}")
        seen.add(name)
        # OpenAI: no parameters means a function that takes none.
        params = function.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ConstraintError(f"tools[{i}].function.parameters must be a JSON object")
        specs.append((name, params, function.get("strict") is True))
    return specs


def _call_prefix(tool: str, fmt: ToolFormat) -> str:
    # The spacing chat templates render calls with (Python's json.dumps defaults).
    return f'{{"name": {json.dumps(tool, ensure_ascii=False)}, "{fmt.arguments_key}": '


def _calls_expr(fmt: ToolFormat, parallel: bool, lazy_open: bool) -> str:
    """The whole tool-call section; with `lazy_open` its opening comes from the auto-mode trigger rule."""
    trigger = _trigger(fmt)
    if lazy_open and trigger:
        opening = _join("tool_trigger", _lit(fmt.start[len(trigger):]))
    else:
        opening = _lit(fmt.start)
    if fmt.tags_per_call:
        more = f" ({_lit(fmt.separator)} {_lit(fmt.start)} call {_lit(fmt.end)})*" if parallel else ""
        return _join(opening, "call", _lit(fmt.end)) + more
    more = f"({_lit(fmt.separator)} call)*" if parallel else ""
    if fmt.body == "mistral":
        return _join(opening, '"["', "call", more, '"]"', _lit(fmt.end))
    return _join(opening, "call", more, _lit(fmt.end))


def _trigger(fmt: ToolFormat) -> str:
    # Trailing whitespace of the start tag ("<tool_call>\n") is forced after the trigger, not part of it.
    return fmt.start.rstrip()


def _free_text_rule(fmt: ToolFormat) -> str:
    # Without a start tag (Llama 3 JSON), the call is recognised by its first character, as in
    # llguidance's own example: plain text may not begin with it.
    return "FREE_TEXT" if _trigger(fmt) else "PLAIN_TEXT"


def _auto_rules(fmt: ToolFormat) -> list[str]:
    if _trigger(fmt):
        # Lazy lexeme: free text ends at the first trigger, after which the call grammar holds.
        return [r"FREE_TEXT: /(.|\n)*/", f"tool_trigger[lazy]: FREE_TEXT {_lit(_trigger(fmt))}"]
    first = "\\[" if fmt.body == "mistral" else "\\{"
    return ["PLAIN_TEXT: /([^" + first + r"](.|\n)*)?/"]


def _grammars(grammar: str) -> list[dict]:
    try:
        doc = json.loads(grammar)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("grammars"), list):
        return [dict(g) for g in doc["grammars"]]
    return [{"lark_grammar": grammar}]  # bare Lark text


def _document(grammars: list[dict]) -> str:
    return json.dumps({"grammars": grammars}, separators=(",", ":"))


def _checked(constraint: Constraint) -> Constraint:
    error = LLMatcher.validate_grammar(constraint.grammar)
    if error:
        raise ConstraintError(f"cannot build the {constraint.kind} grammar: {_first_lines(error)}")
    return constraint


def _lit(text: str) -> str:
    # Lark string literals take JSON escapes; an empty literal is left out of the rule.
    return json.dumps(text, ensure_ascii=False) if text else ""


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _first_lines(message: str, max_lines: int = 4) -> str:
    # llguidance appends parser state dumps to some errors; the client needs the first lines only.
    return "\n".join(message.strip().splitlines()[:max_lines])
