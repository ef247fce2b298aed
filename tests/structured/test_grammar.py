"""Grammars checked without a model: token sequences from the demo tokenizer fed through llguidance."""

import dataclasses
import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from mlxhost.structured.grammar import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Constraint,
    ConstraintError,
    ToolFormat,
    json_object_constraint,
    json_schema_constraint,
    tool_call_constraint,
    with_reasoning_prefix,
)
from mlxhost.testing.demo import build_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "$defs": {"num": {"type": "integer"}},
}}}
TOOLS = [WEATHER, ADD]
CALL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def ll_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(path)))


def feed(ll_tokenizer, constraint: Constraint, text: str) -> llguidance.LLMatcher:
    """A matcher that consumed `text` token by token (check .is_error() for a rejection)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, constraint.grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in ll_tokenizer.tokenize_str(text):
        if not matcher.consume_token(token):
            break
    return matcher


def accepts(ll_tokenizer, constraint, text) -> bool:
    matcher = feed(ll_tokenizer, constraint, text)
    return not matcher.is_error() and matcher.is_accepting()


def rejects(ll_tokenizer, constraint, text) -> bool:
    return feed(ll_tokenizer, constraint, text).is_error()


def test_constraint_is_hashable_plain_data():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first, second = json_schema_constraint(schema), json_schema_constraint(dict(schema))
    assert first == second and hash(first) == hash(second) and first.kind == "json_schema"
    assert isinstance(first.grammar, str)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.kind = "x"


def test_json_schema_accepts_valid_and_rejects_invalid(ll_tokenizer):
    c = json_schema_constraint({
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        },
        "required": ["a"],
        "additionalProperties": False,
    })
    assert accepts(ll_tokenizer, c, '{"a":1,"b":["x","y"]}')
    assert accepts(ll_tokenizer, c, '{"a": -3}')
    assert rejects(ll_tokenizer, c, '{"a":"1"}')
    assert rejects(ll_tokenizer, c, '{"b":["x"]}')  # `a` is required
    assert rejects(ll_tokenizer, c, '{"a":1,"b":["x","y","x"]}')
    assert rejects(ll_tokenizer, c, '{"a":1,"c":2}')
    assert not accepts(ll_tokenizer, c, '{"a":1')  # a prefix, not a match


def test_json_whitespace_is_bounded(ll_tokenizer):
    # An `x-guidance` in the request cannot turn free whitespace back on.
    for schema in ({"type": "object"}, {"type": "object", "x-guidance": {"whitespace_flexible": True}}):
        c = json_schema_constraint(schema)
        assert accepts(ll_tokenizer, c, '{"a": 1, "b": [1, 2]}')
        assert accepts(ll_tokenizer, c, '{"a":1,"b":[1,2]}')
        for text in ('{"a":  1}', '{ "a":1}', '{"a":1 }', '{"a":1,\n"b":2}', ' {"a":1}'):
            assert rejects(ll_tokenizer, c, text), text


def test_complete_json_allows_only_eos(ll_tokenizer):
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    matcher = feed(ll_tokenizer, json_schema_constraint(empty), "{}")
    assert matcher.is_stopped() and matcher.is_accepting()
    assert matcher.consume_token(ll_tokenizer.eos_token)


@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ([{"type": "object"}], "JSON object"),
])
def test_invalid_schemas_raise_constraint_error(schema, words):
    with pytest.raises(ConstraintError, match=words) as info:
        json_schema_constraint(schema)
    assert isinstance(info.value, ValueError)  # the API maps it to a 400


def test_strict_refuses_what_it_cannot_enforce(ll_tokenizer):
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(ConstraintError, match="no-such-format"):
        json_schema_constraint(schema, strict=True)
    assert accepts(ll_tokenizer, json_schema_constraint(schema), '"anything"')


def test_json_object(ll_tokenizer):
    c = json_object_constraint()
    assert c.kind == "json_object"
    assert accepts(ll_tokenizer, c, '{"x": [1, "a", {"y": null}], "z": 2.5}')
    for text in ("[1]", '"s"', "1", "hello"):
        assert rejects(ll_tokenizer, c, text), text


def test_required_tool_calls(ll_tokenizer):
    c = tool_call_constraint(TOOLS, "required", HERMES)
    assert c.kind == "tool_call"
    assert accepts(ll_tokenizer, c, CALL_WEATHER)
    assert accepts(ll_tokenizer, c, CALL_WEATHER + "\n" + CALL_ADD)
    assert not accepts(ll_tokenizer, c, "")  # at least one call
    assert rejects(ll_tokenizer, c, "Sure! " + CALL_WEATHER)
    assert rejects(ll_tokenizer, c, CALL_WEATHER.replace("get_weather", "get_time"))
    assert rejects(ll_tokenizer, c, CALL_ADD.replace('"b": 2', '"b": "2"'))
    assert rejects(ll_tokenizer, c, CALL_WEATHER + " and more")


def test_single_call_then_only_eos(ll_tokenizer):
    c = tool_call_constraint(TOOLS, "required", HERMES, parallel=False)
    matcher = feed(ll_tokenizer, c, CALL_ADD)
    assert matcher.is_stopped() and matcher.consume_token(ll_tokenizer.eos_token)
    assert rejects(ll_tokenizer, c, CALL_ADD + "\n" + CALL_WEATHER)


def test_named_tool_call(ll_tokenizer):
    c = tool_call_constraint(TOOLS, "named", HERMES, name="add")
    matcher = feed(ll_tokenizer, c, CALL_ADD)
    assert matcher.is_stopped() and matcher.is_accepting()
    assert rejects(ll_tokenizer, c, CALL_WEATHER)


def test_auto_is_free_text_until_the_tag(ll_tokenizer):
    c = tool_call_constraint(TOOLS, "auto", HERMES)
    assert accepts(ll_tokenizer, c, "")
    assert accepts(ll_tokenizer, c, "No tool needed: 2 + 2 = 4.\n{not json} <tool or </tool_call>")
    assert accepts(ll_tokenizer, c, "Let me check.\n" + CALL_WEATHER)
    assert accepts(ll_tokenizer, c, "Two at once: " + CALL_WEATHER + "\n" + CALL_ADD)
    # Once the tag is out, the call must be well-formed and valid against that tool's schema.
    assert rejects(ll_tokenizer, c, "ok <tool_call> whatever")
    assert rejects(ll_tokenizer, c, 'ok <tool_call>\n{"name": "nope"')
    assert rejects(ll_tokenizer, c, 'ok <tool_call>\n{"name": "add", "arguments": {"a": "x"')
    assert rejects(ll_tokenizer, c, CALL_ADD + " trailing text")
    matcher = feed(ll_tokenizer, tool_call_constraint(TOOLS, "auto", HERMES, parallel=False), "hi " + CALL_ADD)
    assert matcher.is_stopped() and matcher.consume_token(ll_tokenizer.eos_token)


def test_auto_hermes_takes_a_bare_call_at_the_start(ll_tokenizer):
    # Small Qwen2.5 models often answer with the call object alone: a reply that starts with `{` is that call.
    c = tool_call_constraint(TOOLS, "auto", HERMES)
    assert accepts(ll_tokenizer, c, '{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert rejects(ll_tokenizer, c, '{"name": "add", "arguments": {"a": "x"}}')
    assert rejects(ll_tokenizer, c, '{"answer": 3}')
    assert accepts(ll_tokenizer, c, 'The answer: {"answer": 3}')  # only the start is taken
    assert rejects(ll_tokenizer, tool_call_constraint(TOOLS, "required", HERMES), '{"name": "add"')


def test_llama3_and_mistral_layouts(ll_tokenizer):
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    c = tool_call_constraint(TOOLS, "required", LLAMA3_JSON)
    assert accepts(ll_tokenizer, c, call) and accepts(ll_tokenizer, c, call + "; " + call)
    assert rejects(ll_tokenizer, c, call.replace("parameters", "arguments"))
    auto = tool_call_constraint(TOOLS, "auto", LLAMA3_JSON)
    assert accepts(ll_tokenizer, auto, "The answer is 3.") and accepts(ll_tokenizer, auto, call)
    assert rejects(ll_tokenizer, auto, '{"answer": 3}')  # text may not start with "{"

    calls = (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    assert accepts(ll_tokenizer, tool_call_constraint(TOOLS, "required", MISTRAL), calls)
    auto = tool_call_constraint(TOOLS, "auto", MISTRAL)
    assert accepts(ll_tokenizer, auto, "Sure. " + calls)
    assert rejects(ll_tokenizer, auto, "Sure. [TOOL_CALLS]{")


def test_tool_names_are_escaped(ll_tokenizer):
    tool = {"type": "function", "function": {"name": 'say "hi"\\ünï 😀', "parameters": {"type": "object"}}}
    c = tool_call_constraint([tool], "required", HERMES)
    body = json.dumps({"name": 'say "hi"\\ünï 😀', "arguments": {}}, ensure_ascii=False)
    assert accepts(ll_tokenizer, c, "<tool_call>\n" + body + "\n</tool_call>")


def test_tool_without_parameters_takes_an_empty_object(ll_tokenizer):
    c = tool_call_constraint([{"type": "function", "function": {"name": "now"}}], "required", HERMES)
    assert accepts(ll_tokenizer, c, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert rejects(ll_tokenizer, c, '<tool_call>\n{"name": "now", "arguments": {"x": 1}}\n</tool_call>')


@pytest.mark.parametrize("tools, mode, name, words", [
    (TOOLS, "sometimes", None, "mode"),
    (TOOLS, "named", "missing", "missing"),
    ([], "required", None, "at least one tool"),
    ([WEATHER, WEATHER], "required", None, "two tools"),
    ([{"type": "function", "function": {"description": "x"}}], "required", None, "name"),
    ([{"type": "retrieval"}], "required", None, "tools\\[0\\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto", None, "'f'"),
])
def test_bad_tools_raise_constraint_error(tools, mode, name, words):
    with pytest.raises(ConstraintError, match=words):
        tool_call_constraint(tools, mode, HERMES, name=name)


def test_tool_format_is_checked():
    with pytest.raises(ValueError):
        ToolFormat(start="<x>", end="</x>", body="xml")
    assert HERMES.arguments_key == "arguments" and LLAMA3_JSON.arguments_key == "parameters"


def test_reasoning_prefix(ll_tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inner = json_schema_constraint(schema)
    opened = with_reasoning_prefix(inner, starts_in_reasoning=True)
    assert opened.kind == inner.kind
    assert accepts(ll_tokenizer, opened, 'Think {"a": "no"} </thin> then </think>\n\n{"a": 1}')
    assert rejects(ll_tokenizer, opened, 'Think.</think>\n\n{"a": "x"}')
    assert rejects(ll_tokenizer, opened, "Think.</think> prose")
    assert not accepts(ll_tokenizer, opened, "still thinking")

    closed = with_reasoning_prefix(inner, starts_in_reasoning=False)
    assert accepts(ll_tokenizer, closed, '<think>\nhmm\n</think>\n\n{"a": 1}')
    assert accepts(ll_tokenizer, closed, '{"a": 1}')  # no reasoning at all
    assert rejects(ll_tokenizer, closed, 'Sure: {"a": 1}')
    matcher = feed(ll_tokenizer, closed, '<think>x</think>{"a": 2}')
    assert matcher.is_stopped()


def test_reasoning_prefix_before_tool_calls(ll_tokenizer):
    c = with_reasoning_prefix(tool_call_constraint(TOOLS, "required", HERMES), starts_in_reasoning=True)
    assert accepts(ll_tokenizer, c, "I should call add.</think>\n\n" + CALL_ADD)
    assert rejects(ll_tokenizer, c, "I should call add.</think>\n\nOK")
    # Nested twice still resolves every sub-grammar by name.
    twice = with_reasoning_prefix(with_reasoning_prefix(inner_json := json_object_constraint(), "<a>", "</a>"))
    assert inner_json.kind == twice.kind
    assert accepts(ll_tokenizer, twice, '<think>x</think><a>y</a>{"k": 1}')
