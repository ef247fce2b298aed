"""Lark pieces the tool-call grammars share (grammar.py, tool_xml.py): literals, JSON-schema sub-grammars and
the error a client gets for a schema that cannot be enforced."""

from __future__ import annotations

import json

from llguidance import LLMatcher


class ConstraintError(ValueError):
    """A schema or tool definition that cannot be enforced; the message is meant for the client (a 400)."""


def json_options(strict: bool) -> dict:
    # Compact JSON, except the ", " and ": " that json.dumps and chat templates write; nowhere else may
    # whitespace go, so a model cannot loop on it. These override any `x-guidance` in the user's schema.
    compact = {"whitespace_flexible": False, "item_separator": ", ?", "key_separator": ": ?"}
    return {**compact, "lenient": not strict}


def json_subgrammar(schema: dict, strict: bool, name: str, what: str) -> dict:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=json_options(strict))
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"invalid {what}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ConstraintError(f"invalid or unsupported {what}: {first_lines(error)}")
    return {**json.loads(grammar)["grammars"][0], "name": name}


def lit(text: str) -> str:
    # Lark string literals take JSON escapes; an empty literal is left out of the rule.
    return json.dumps(text, ensure_ascii=False) if text else ""


def first_lines(message: str, max_lines: int = 4) -> str:
    # llguidance appends parser state dumps to some errors; the client needs the first lines only.
    return "\n".join(message.strip().splitlines()[:max_lines])
