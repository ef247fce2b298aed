"""Grammars for constrained decoding, built as plain data (llguidance grammar strings; no MLX).

The API turns `response_format` and `tool_choice` into a `Constraint` here, once per request; the engine
compiles it against the served tokenizer (`matcher.py`) and masks each step's logits with it.

Every grammar is a llguidance "grammars" document: grammar 0 is the top level, JSON schemas and Lark
rules reference each other by name (`@args_0`). Tool arguments stay separate sub-grammars so each
schema keeps its own root and its `#/$defs/...` references still resolve.

Tags such as `<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>` and `<think>` are often one added token of
the model's tokenizer (Qwen2.5/Qwen3 `<tool_call>` is 151657). llguidance keeps every added token out of
text matches, so a text literal cannot produce it: with a forced `"<tool_call>"` the mask offered the
token and then refused it. The builders take `tag_ids` (tag text -> its token id, `tag_token_ids`) and
accept such a tag as that token (`<[id]>`) or spelled out in text; without an id a tag is text only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from mlxhost.structured.lark_rules import ConstraintError, first_lines, json_subgrammar, lit
from mlxhost.structured.tool_xml import xml_call_rules, xml_rules

TOOL_CHOICE_MODES = ("auto", "required", "named")
_TOOL_BODIES = ("hermes_json", "llama3_json", "mistral", "qwen3_xml")


@dataclass(frozen=True)
class Constraint:
    """What the engine's request carries: a llguidance grammar (serialized) and a label for logs/metrics."""

    grammar: str
    kind: str


class GrammarFailure(str):
    """The error text of a request whose grammar could not go on (a dead end, or a token it refused).

    A `str`, so it travels as a request's error message unchanged; its type tells the API to answer it as
    the request's own problem (a 400 in the dialect's shape), not as a server fault."""


def tag_token_ids(tokenizer: Any, tags: Iterable[str]) -> dict[str, int]:
    """Tag text -> token id, for each tag that the tokenizer (Hugging Face or mlx-lm's wrapper) has as
    one token spelling exactly that text."""
    found = {}
    for tag in tags:
        if not tag:
            continue
        try:
            token_id = tokenizer.convert_tokens_to_ids(tag)
            ok = isinstance(token_id, int) and token_id != tokenizer.unk_token_id
            ok = ok and tokenizer.convert_ids_to_tokens(token_id) == tag
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            ok = False
        if ok:
            found[tag] = token_id
    return found


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls.

    body "hermes_json": every call is `start {"name": ..., "arguments": ...} end`, calls joined by `separator`.
    body "llama3_json": `start {"name": ..., "parameters": ...}` calls joined by `separator`, then `end`.
    body "mistral": `start [{"name": ..., "arguments": ...}, ...] end`: one JSON array holds every call.
    body "qwen3_xml": like hermes_json, but each call is Qwen3-Coder's `<function=...>` XML (`tool_xml.py`).
    `bare_call`: in auto mode a reply may also be one call object without its tags (what small Qwen2.5
    models often write); a reply that starts with `{` is then held to be that call.
    """

    start: str
    end: str
    body: str = "hermes_json"
    separator: str = "\n"
    bare_call: bool = False

    def __post_init__(self):
        if self.body not in _TOOL_BODIES:
            raise ValueError(f"body must be one of {_TOOL_BODIES}, got {self.body!r}")
        if not self.start and self.tags_per_call:
            raise ValueError("hermes_json needs a start tag: it is what separates calls from text")

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.body == "llama3_json" else "arguments"

    @property
    def tags_per_call(self) -> bool:
        return self.body in ("hermes_json", "qwen3_xml")

    @property
    def tags(self) -> tuple[str, ...]:
        """The texts a tokenizer may hold as single tokens (look them up with `tag_token_ids`)."""
        return tuple(t for t in (self.start.strip(), self.end.strip(), self.opening_token) if t)

    @property
    def opening_token(self) -> str:
        # Llama 3 may open JSON calls with its `<|python_tag|>` token; optional, and only where it exists.
        return "<|python_tag|>" if self.body == "llama3_json" else ""


# The layouts mlx-lm's and vLLM's parsers read back (Qwen2.5/Qwen3/Hermes chat templates, Llama 3.1+
# JSON tool calling, Mistral v0.3 JSON tool calls).
HERMES = ToolFormat(start="<tool_call>\n", end="\n</tool_call>", body="hermes_json", separator="\n", bare_call=True)
LLAMA3_JSON = ToolFormat(start="", end="", body="llama3_json", separator="; ")
MISTRAL = ToolFormat(start="[TOOL_CALLS]", end="", body="mistral", separator=", ")
QWEN3_XML = ToolFormat(start="<tool_call>\n", end="\n</tool_call>", body="qwen3_xml", separator="\n")


def json_schema_constraint(schema: dict, strict: bool = False) -> Constraint:
    """Output must be one JSON value valid against `schema`.

    strict=False ignores keywords llguidance cannot enforce (a warning inside llguidance), strict=True
    refuses them; schema errors (bad types, dangling `$ref`s, look-around patterns) are refused either way.
    """
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be a JSON object")
    sub = json_subgrammar(schema, strict, name="json_schema", what="JSON schema")
    return Constraint(_document([sub]), "json_schema")


def json_object_constraint() -> Constraint:
    """Output must be one JSON object (any keys, any values)."""
    sub = json_subgrammar({"type": "object"}, strict=True, name="json_object", what="JSON object")
    return Constraint(_document([sub]), "json_object")


def tool_call_constraint(
    tools: list[dict],
    mode: str,
    fmt: ToolFormat = HERMES,
    name: str | None = None,
    parallel: bool = True,
    tag_ids: Mapping[str, int] | None = None,
) -> Constraint:
    """Output must call the given OpenAI-style tools in `fmt`'s layout.

    mode "required": at least one call (several with `parallel`), then only EOS.
    mode "named": exactly one call to `name`, then only EOS.
    mode "auto": free text, or (once the model writes the start tag) well-formed calls, then only EOS.
    `tag_ids`: the format's tags that are single tokens of the served tokenizer (`tag_token_ids`).
    """
    tags = _Tags(tag_ids)
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
        if fmt.body == "qwen3_xml":
            rules, xml_subs = xml_call_rules(i, tool, params, strict)
            calls += rules
            subs += xml_subs
            continue
        subs.append(json_subgrammar(params, strict, f"args_{i}", f"parameters schema of tool {tool!r}"))
        calls.append(f'call_{i}: {lit(_call_prefix(tool, fmt))} @args_{i} "}}"')
    if fmt.body == "qwen3_xml":
        calls += xml_rules()
    auto_start = f"{_free_text_rule(fmt)} | tool_calls" + (" | call" if fmt.bare_call else "")
    lines = [
        "start: " + ("tool_calls" if mode != "auto" else auto_start),
        "tool_calls: " + _calls_expr(fmt, parallel, lazy_open=mode == "auto", tags=tags),
        "call: " + " | ".join(f"call_{i}" for i in range(len(specs))),
        *calls,
    ]
    if mode == "auto":
        lines += _auto_rules(fmt, tags)
    return _checked(Constraint(_document([{"lark_grammar": "\n".join(lines) + "\n"}, *subs]), "tool_call"))


def with_reasoning_prefix(
    constraint: Constraint,
    start: str = "<think>",
    end: str = "</think>",
    starts_in_reasoning: bool = False,
    tag_ids: Mapping[str, int] | None = None,
) -> Constraint:
    """Free reasoning text first, closed by `end`; `constraint` applies only after it.

    When the prompt already opened the reasoning (`starts_in_reasoning`), the output starts inside it and
    must close it; otherwise the model may open it with `start` or skip it and answer directly.
    `tag_ids`: which of the two tags are single tokens (Qwen3's `<think>` is 151667).
    """
    tags = _Tags(tag_ids)
    grammars = _grammars(constraint.grammar)
    names = {g.get("name") for g in grammars}
    inner = next(f"constrained_{i}" for i in range(len(names) + 1) if f"constrained_{i}" not in names)
    grammars[0] = {**grammars[0], "name": inner}
    lark = "\n".join([
        f"start: reasoning{'' if starts_in_reasoning else '?'} REASONING_GAP @{inner}",
        "reasoning: " + _join("" if starts_in_reasoning else tags.text(start), "reasoning_body"),
        # Lazy: the reasoning ends at the first `end`, so text after it is held to the constraint.
        f"reasoning_text[lazy]: REASONING_TEXT {lit(end)}",
        "reasoning_body: " + tags.closing("reasoning_text", "REASONING_TEXT", end),
        r"REASONING_TEXT: /(.|\n)*/",
        # Chat templates put a blank line or two between the reasoning and the answer.
        r"REASONING_GAP: /[ \n]{0,4}/",
    ]) + "\n"
    return _checked(Constraint(_document([{"lark_grammar": lark}, *grammars]), constraint.kind))


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


def _calls_expr(fmt: ToolFormat, parallel: bool, lazy_open: bool, tags: "_Tags") -> str:
    """The whole tool-call section; with `lazy_open` its opening comes from the auto-mode trigger rule."""
    trigger = _trigger(fmt)
    if lazy_open and trigger:
        opening = _join("tool_open", tags.text(fmt.start[len(trigger):]))
    else:
        opening = tags.text(fmt.start)
    if fmt.opening_token in tags:
        opening = _join(opening, f"{tags.token(fmt.opening_token)}?")
    start, end = tags.text(fmt.start), tags.text(fmt.end)
    if fmt.tags_per_call:
        more = f" ({lit(fmt.separator)} {start} call {end})*" if parallel else ""
        return _join(opening, "call", end) + more
    more = f"({lit(fmt.separator)} call)*" if parallel else ""
    if fmt.body == "mistral":
        return _join(opening, '"["', "call", more, '"]"', end)
    return _join(opening, "call", more, end)


def _trigger(fmt: ToolFormat) -> str:
    # Trailing whitespace of the start tag ("<tool_call>\n") is forced after the trigger, not part of it.
    return fmt.start.rstrip()


def _free_text_rule(fmt: ToolFormat) -> str:
    # Without a start tag (Llama 3 JSON), the call is recognised by its first character, as in
    # llguidance's own example: plain text may not begin with it.
    return "FREE_TEXT" if _trigger(fmt) else "PLAIN_TEXT"


def _auto_rules(fmt: ToolFormat, tags: "_Tags") -> list[str]:
    if _trigger(fmt):
        # Lazy lexeme: free text ends at the first trigger, after which the call grammar holds. A trigger
        # that is one token ends the text as that token: the model opens a call its own way.
        # With bare calls, text may not start with `{`: that is how a bare call begins.
        text = r"/([^{](.|\n)*)?/" if fmt.bare_call else r"/(.|\n)*/"
        return [f"FREE_TEXT: {text}", f"tool_trigger[lazy]: FREE_TEXT {lit(_trigger(fmt))}",
                "tool_open: " + tags.closing("tool_trigger", "FREE_TEXT", _trigger(fmt))]
    first = "\\[" if fmt.body == "mistral" else "\\{"
    return ["PLAIN_TEXT: /([^" + first + r"](.|\n)*)?/"]


class _Tags:
    """Renders literals that may hold tags: a tag with a token id is that token or its text."""

    def __init__(self, tag_ids: Mapping[str, int] | None):
        self._ids = {tag: int(i) for tag, i in (tag_ids or {}).items() if tag}
        keys = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, keys)) + ")") if keys else None

    def __contains__(self, tag: str) -> bool:
        return tag in self._ids

    def token(self, tag: str) -> str:
        return f"<[{self._ids[tag]}]>"

    def text(self, text: str) -> str:
        """`text` as a grammar expression: literal pieces, and each known tag as `(<[id]> | "tag")`."""
        if self._split is None or not text:
            return lit(text)
        parts = [f"({self.token(p)} | {lit(p)})" if p in self._ids else lit(p) for p in self._split.split(text)]
        return _join(*parts)

    def closing(self, lazy_rule: str, text_terminal: str, tag: str) -> str:
        """Free text closed by `tag`: the lazy rule (text then the tag's text), or the text then its token."""
        return f"{lazy_rule} | {text_terminal} {self.token(tag)}" if tag in self._ids else lazy_rule


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
        raise ConstraintError(f"cannot build the {constraint.kind} grammar: {first_lines(error)}")
    return constraint


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)
