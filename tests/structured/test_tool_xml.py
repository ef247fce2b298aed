"""Qwen3-Coder's XML tool calls under the grammar: forced, named and auto, with `<tool_call>` as a token or
text; every accepted call parses back through the `qwen3_coder` tool parser with the schema's types."""

import json

import llguidance
import llguidance.hf
import pytest

from mlxhost.structured.grammar import QWEN3_XML, ConstraintError, tag_token_ids, tool_call_constraint
from mlxhost.structured.tool_parsers import parse_complete

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "mode": {"enum": ["fast", "deep"]},
        "filters": {"type": "object", "properties": {"lang": {"$ref": "#/$defs/lang"}}, "required": ["lang"]},
        "note": {},
    },
    "required": ["query", "mode"],
    "$defs": {"lang": {"enum": ["en", "fr"]}},
}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [SEARCH, PING]


def xml_call(name: str, **params) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


FULL = xml_call("search", query="mlx <b>servers</b>\non two lines", limit=5, mode="deep",
                filters='{"lang": "fr"}', note="anything")


@pytest.fixture(scope="module")
def ll(tagged_tokenizer):
    return llguidance.hf.from_tokenizer(tagged_tokenizer)


def accepts(ll, tokenizer, constraint, text) -> bool:
    matcher = llguidance.LLMatcher(ll, constraint.grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_calls_follow_the_schema(ll, tagged_tokenizer, mode):
    c = tool_call_constraint(TOOLS, mode, QWEN3_XML, name="search",
                             tag_ids=tag_token_ids(tagged_tokenizer, QWEN3_XML.tags))
    assert accepts(ll, tagged_tokenizer, c, FULL)
    assert accepts(ll, tagged_tokenizer, c, xml_call("search", query="x", mode="fast"))  # optional ones left out
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", query="x", limit="many", mode="fast"))
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", query="x", mode="slow"))
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", query="x"))  # mode is required
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", mode="fast", query="x"))  # schema order
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", query="x", mode="fast", extra="1"))
    assert not accepts(ll, tagged_tokenizer, c, xml_call("search", query="x", mode="fast", filters='{"lang": "de"}'))
    assert accepts(ll, tagged_tokenizer, c, xml_call("ping")) == (mode != "named")


def test_auto_is_text_until_the_tag(ll, tagged_tokenizer):
    c = tool_call_constraint(TOOLS, "auto", QWEN3_XML, tag_ids=tag_token_ids(tagged_tokenizer, QWEN3_XML.tags))
    assert accepts(ll, tagged_tokenizer, c, "Nothing to call. {\"a\": 1}")
    assert accepts(ll, tagged_tokenizer, c, "Searching.\n" + FULL + "\n" + xml_call("ping"))
    assert not accepts(ll, tagged_tokenizer, c, "Searching.\n<tool_call>\n<function=nope>")


def test_what_the_grammar_accepts_parses_with_the_schema_types():
    content, calls = parse_complete("qwen3_coder", FULL, TOOLS)
    assert content == "" and [c.name for c in calls] == ["search"]
    assert json.loads(calls[0].arguments) == {"query": "mlx <b>servers</b>\non two lines", "limit": 5,
                                              "mode": "deep", "filters": {"lang": "fr"}, "note": "anything"}


def test_bad_parameters_are_constraint_errors():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "nope"}}}}}
    with pytest.raises(ConstraintError, match="'n'"):
        tool_call_constraint([bad], "required", QWEN3_XML)
