"""Tool-call formats: one registry of how each model family writes its calls, and which format a model uses.

Formats (registry name -> what the model writes):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated for parallel calls; or one bare
               `{"name": ..., "arguments": {...}}` as the whole reply (small Qwen2.5 models often drop the tags)
  qwen3_coder  `<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>`
  llama3_json  optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`, several joined by `;`
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}`
  pythonic     `[get_weather(city="Paris"), other(x=1)]`, bare or inside `<|tool_call_start|>...<|tool_call_end|>`

The text between the tags is parsed by mlx-lm's own parsers (`mlx_lm.tool_parsers.<module>.parse_tool_call`)
where one exists; llama3_json is written here. They are imported on first use, because importing any
mlx_lm module runs its package `__init__`, which loads MLX, and this module must stay importable without it.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable


@dataclass(frozen=True)
class ToolParserSpec:
    """One format. `end == ""`: a call runs to the next `start` or to the end of output.
    `implicit_start`: a character that opens a call when it begins the output (no tag), running to its end."""

    name: str
    start: str
    end: str
    parse: Callable[[str, list | None], list]  # text between the tags -> [{"name", "arguments"}]; raises if bad
    implicit_start: str = ""
    viable: Callable[[str], bool] | None = None  # can this implicit-call prefix still be a call?
    parse_implicit: Callable[[str, list | None], list] | None = None  # an implicit call's parser (else `parse`)
    mlx_lm_module: str | None = None  # the mlx_lm.tool_parsers module doing the parsing, if any



def _mlx_lm(module: str):
    return importlib.import_module(f"mlx_lm.tool_parsers.{module}")


def _as_list(parsed) -> list:
    return parsed if isinstance(parsed, list) else [parsed]


def _parse_hermes(text: str, tools) -> list:
    return [_mlx_lm("json_tools").parse_tool_call(text, tools)]


def _parse_hermes_bare(text: str, tools) -> list:
    """A whole reply that is one call object without its tags: stricter than inside tags, since any JSON
    answer starts like this. Exactly the keys name and arguments, and (given tools) a known name."""
    obj = json.loads(text.strip())
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or not isinstance(obj["arguments"], dict):
        raise ValueError("not a bare tool call")
    names = {(t.get("function") or {}).get("name") for t in tools or () if isinstance(t, dict)}
    if tools and obj["name"] not in names:
        raise ValueError("a bare tool call must name one of the tools")
    return [obj]


def _parse_qwen3_coder(text: str, tools) -> list:
    # Its `</function>$` anchor wants the function block last; the newline before `</tool_call>` is ours to drop.
    return [_mlx_lm("qwen3_coder").parse_tool_call(text.strip(), tools)]


def _parse_mistral(text: str, tools) -> list:
    return _as_list(_mlx_lm("mistral").parse_tool_call(text.strip(), tools))


def _parse_pythonic(text: str, tools) -> list:
    text = text.strip()
    # mlx-lm's parser looks for the first `[` and last `]` anywhere; a call is the whole payload.
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError("pythonic tool calls are one [...] list")
    return _as_list(_mlx_lm("pythonic").parse_tool_call(text, tools))


def _parse_llama3_json(text: str, tools) -> list:
    """`{...}` objects separated by `;`. mlx-lm has no parser for it."""
    decoder = json.JSONDecoder()
    text = text.strip()
    calls, pos = [], 0
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        if not isinstance(obj, dict) or not ("parameters" in obj or "arguments" in obj):
            # A JSON answer with a "name" key is not a call: llama3 always writes the arguments key.
            raise ValueError("not a llama3 tool call")
        calls.append(obj)
        rest = text[pos:].lstrip()
        if rest and rest[0] != ";":
            raise ValueError("llama3 tool calls are separated by ';'")
        pos = len(text) - len(rest[1:].lstrip())
    if not calls:
        raise ValueError("no tool call")
    return calls


def _viable_by(head: str, prefix: str) -> Callable[[str], bool]:
    """True while the text matches `head` or is still a prefix of it (`prefix` fully matches the
    incomplete forms). Monotone: once false it stays false, whatever comes next."""
    head_re, prefix_re = re.compile(head), re.compile(prefix)
    return lambda text: bool(head_re.match(text) or prefix_re.fullmatch(text))


_SPECS = MappingProxyType(
    {
        "hermes": ToolParserSpec(
            "hermes",
            "<tool_call>",
            "</tool_call>",
            _parse_hermes,
            implicit_start="{",
            viable=_viable_by(r'\{\s*"name"\s*:', r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?'),
            parse_implicit=_parse_hermes_bare,
            mlx_lm_module="json_tools",
        ),
        "qwen3_coder": ToolParserSpec(
            "qwen3_coder", "<tool_call>", "</tool_call>", _parse_qwen3_coder, mlx_lm_module="qwen3_coder"
        ),
        "llama3_json": ToolParserSpec(
            "llama3_json",
            "<|python_tag|>",
            "",
            _parse_llama3_json,
            implicit_start="{",
            viable=_viable_by(r'\{\s*"(?:name|type|parameters|arguments)"', r'\{\s*(?:"[a-z]*)?'),
        ),
        "mistral": ToolParserSpec("mistral", "[TOOL_CALLS]", "", _parse_mistral, mlx_lm_module="mistral"),
        "pythonic": ToolParserSpec(
            "pythonic",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            _parse_pythonic,
            implicit_start="[",
            viable=_viable_by(r"\[\s*[A-Za-z_][\w.]*\s*\(", r"\[\s*(?:[A-Za-z_][\w.]*\s*)?"),
            mlx_lm_module="pythonic",
        ),
    }
)
TOOL_PARSER_NAMES: tuple[str, ...] = tuple(_SPECS)
# Tags the parsers read; where a tokenizer makes one a *special* token (Mistral's `[TOOL_CALLS]` and `[ARGS]`,
# Llama 3's `<|python_tag|>`) the detokenizer still writes it out, or no call could be found.
TOOL_TAGS = frozenset({t for spec in _SPECS.values() for t in (spec.start, spec.end) if t} | {"[ARGS]"})


def get_tool_parser(name: str) -> ToolParserSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {', '.join(TOOL_PARSER_NAMES)}") from None


# Template text -> format, most specific first (qwen3_coder's template also holds `<tool_call>`).
_TEMPLATE_MARKERS = (
    (("<tool_call>\\n<function=", "<tool_call>\n<function="), "qwen3_coder"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|tool_call_start|>", "<|tool_list_start|>", "[func_name1("), "pythonic"),
    (("<tool_call>",), "hermes"),
    (("<|python_tag|>", '"parameters": dictionary of argument name'), "llama3_json"),
)
_MODEL_TYPE_PARSERS = MappingProxyType(
    {
        "qwen2": "hermes",
        "qwen2_moe": "hermes",
        "qwen3": "hermes",
        "qwen3_moe": "hermes",
        "qwen3_next": "hermes",
        "llama": "llama3_json",
        "llama4": "pythonic",
        "lfm2": "pythonic",
        "mistral": "mistral",
        "mistral3": "mistral",
        "ministral": "mistral",
    }
)


def choose_tool_parser(chat_template: str | None, model_type: str | None, override: str | None) -> str | None:
    """The format name for a model: `override` if given (unknown -> ValueError), else what the chat
    template's text shows, else the model_type's usual format, else None (no tool-call parsing)."""
    if override is not None:
        return get_tool_parser(override).name
    if chat_template:
        for markers, name in _TEMPLATE_MARKERS:
            if any(m in chat_template for m in markers):
                return name
    return _MODEL_TYPE_PARSERS.get(model_type or "")
