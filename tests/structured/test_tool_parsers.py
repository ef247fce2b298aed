"""Tool-call parsers: every format, streamed over many splits of the text == parsed whole == expected."""

import json
import random
import re
import subprocess
import sys

import pytest

from mlxhost.structured.tool_formats import TOOL_PARSER_NAMES, choose_tool_parser, get_tool_parser
from mlxhost.structured.tool_parsers import (
    ContentDelta,
    StreamingToolParser,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect_tool_events,
    parse_complete,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                    "ratio": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                },
            },
        },
    }
]

HERMES_TWO = (
    "Let me check both.\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}\n</tool_call>\n'
)
QWEN3_CODER_TYPED = (
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n"
    "<parameter=zip>\n007\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=opts>\n{"unit": "C", "hourly": false}\n</parameter>\n'
    "<parameter=tags>\n[1, \"a\"]\n</parameter>\n"
    "</function>\n</tool_call>"
)

# (format, text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", HERMES_TWO, "Let me check both.", [
        ("get_weather", '{"city":"Paris","days":3}'), ("get_weather", '{"city":"Zürich"}')]),
    ("hermes", 'a < b <tool_call>{"name": "unknown_tool"}</tool_call> c', "a < b c", [("unknown_tool", "{}")]),
    ("hermes", "x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
    ("hermes", 'x <tool_call>{"arguments": {}}</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>', []),
    # The output ends inside a call: a call if what was written parses, else dropped (cut by max_tokens).
    ("hermes", 'x\n<tool_call>{"name": "f", "arguments": {}}', "x", [("f", "{}")]),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', "Sure.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_w', "",
     [("f", "{}")]),
    ("hermes", "x <tool_call>", "x", []),
    # A bare call object as the whole reply (no tags) is a call if it names a tool, with exactly these keys.
    ("hermes", '  {"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [("get_weather", '{"city":"Paris"}')]),
    ("hermes", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("hermes", '{"name": "other_tool", "arguments": {}}', '{"name": "other_tool", "arguments": {}}', []),
    ("hermes", '{"answer": 1} and <tool_call>{"name": "f", "arguments": {}}</tool_call>', '{"answer": 1} and',
     [("f", "{}")]),
    ("hermes", 'See {"name": "get_weather", "arguments": {}}', 'See {"name": "get_weather", "arguments": {}}', []),
    ("hermes", "plain <tool_callx> text <tool_cal", "plain <tool_callx> text <tool_cal", []),
    ("qwen3_coder", "Sure.\n" + QWEN3_CODER_TYPED, "Sure.", [("get_weather", json.dumps(
        {"city": "New York", "days": 5, "zip": "007", "ratio": 0.5, "metric": True,
         "opts": {"unit": "C", "hourly": False}, "tags": [1, "a"]}, separators=(",", ":")))]),
    ("qwen3_coder", QWEN3_CODER_TYPED.replace("</function>", ""), QWEN3_CODER_TYPED.replace("</function>", ""),
     []),
    ("qwen3_coder", "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
     "<tool_call>\n<function=get_weather>\n<parameter=days>\n2.5\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_weather>\n<parameter=days>\n2.5\n</parameter>\n</function>\n</tool_call>",
     [("ping", "{}")]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "ping", "parameters": {}}', "", [("get_weather", '{"city":"Paris"}'), ("ping", "{}")]),
    ("llama3_json", '  {"type": "function", "name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", '{"city":"Oslo"}')]),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", '{"answer": 42} is the JSON', '{"answer": 42} is the JSON', []),
    ("llama3_json", 'I would call {"name": "f", "parameters": {}}', 'I would call {"name": "f", "parameters": {}}',
     []),
    ("mistral", 'On it. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
     '{"name": "ping", "arguments": {}}]', "On it.", [("get_weather", '{"city":"Paris"}'), ("ping", "{}")]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]ping[ARGS]{}', "",
     [("get_weather", '{"city":"Lyon"}'), ("ping", "{}")]),
    ("mistral", "[TOOL_CALLS]oops[TOOL_CALLS]ping[ARGS]{}", "[TOOL_CALLS]oops", [("ping", "{}")]),
    ("mistral", 'On it. [TOOL_CALLS][{"name": "get_weather", "argu', "On it.", []),
    ("llama3_json", 'Hm. <|python_tag|>{"name": "get_weather", "parameters": {"ci', "Hm.", []),
    ("pythonic", '[get_weather(city="Paris", days=2), ping()]', "",
     [("get_weather", '{"city":"Paris","days":2}'), ("ping", "{}")]),
    ("pythonic", 'Hi <|tool_call_start|>[get_weather(city="Rome", opts={"a": null})]<|tool_call_end|> bye',
     "Hi bye", [("get_weather", '{"city":"Rome","opts":{"a":null}}')]),
    ("pythonic", "[Docs](https://example.com) say [1, 2]", "[Docs](https://example.com) say [1, 2]", []),
    ("pythonic", "[f(x=1)] trailing", "[f(x=1)] trailing", []),
]


def random_splits(text, rng, n):
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def all_splits(text, rng):
    """Every single cut (so every position inside every tag), one char at a time, and random splits."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield from random_splits(text, rng, 40)


def stream(fmt, pieces, tools=TOOLS):
    parser = StreamingToolParser(fmt, tools)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def check_event_order(events):
    """Start, one or more args fragments, End per call, indices 0, 1, 2, ... with nothing interleaved."""
    open_index, next_index = None, 0
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_index is None and event.index == next_index
            assert re.fullmatch(r"call_[A-Za-z0-9]{24}", event.id) or event.id == "a1b2c3d4e"
            open_index = event.index
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == open_index
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_index
            open_index, next_index = None, next_index + 1
        else:
            assert isinstance(event, ContentDelta) and event.text and open_index is None
    assert open_index is None


def summary(content, calls):
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streaming_equals_complete_over_splits(fmt, text, content, calls):
    expected = (content, calls)
    assert summary(*parse_complete(fmt, text, TOOLS)) == expected
    rng = random.Random(text)
    for pieces in all_splits(text, rng):
        events = stream(fmt, pieces)
        check_event_order(events)
        assert summary(*collect_tool_events(events)) == expected, pieces


def test_every_format_has_cases():
    assert {case[0] for case in CASES} == set(TOOL_PARSER_NAMES)


def test_events_of_a_call_come_together_when_it_closes():
    parser = StreamingToolParser("hermes", TOOLS)
    assert parser.feed("Hi <tool") == [ContentDelta("Hi")]
    assert parser.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == []
    events = parser.feed("</tool_call>")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
    assert events[0].name == "get_weather" and events[1].fragment == '{"city":"Paris"}'
    assert parser.feed(" done") == [ContentDelta(" done")]
    assert parser.finish() == []


def test_held_text_is_released_when_it_is_not_a_tag():
    parser = StreamingToolParser("hermes", None)
    assert parser.feed("1 <") == [ContentDelta("1")]
    assert parser.feed("2") == [ContentDelta(" <2")]
    assert parser.feed("\n") == []
    assert parser.finish() == [ContentDelta("\n")]


def test_implicit_call_is_abandoned_early_when_it_cannot_be_one():
    parser = StreamingToolParser("pythonic", None)
    assert parser.feed("[get") == []
    assert parser.feed(" it](x)") == [ContentDelta("[get it](x)")]
    parser = StreamingToolParser("llama3_json", None)
    assert parser.feed('{"na') == []
    assert parser.feed('me": 1, "x": 2}') == []  # could still be a call until the end
    assert parser.finish() == [ContentDelta('{"name": 1, "x": 2}')]


def test_unserialisable_arguments_are_content():
    text = "[f(x={1, 2})]"  # a Python set is not JSON
    assert parse_complete("pythonic", text, None) == (text, [])


def test_tags_match_mlx_lm_modules():
    import importlib

    for name in TOOL_PARSER_NAMES:
        spec = get_tool_parser(name)
        if spec.mlx_lm_module is not None:
            module = importlib.import_module(f"mlx_lm.tool_parsers.{spec.mlx_lm_module}")
            assert (spec.start, spec.end) == (module.tool_call_start, module.tool_call_end)


def test_choose_tool_parser():
    from mlxhost.structured.templates import AGENT_CHAT_TEMPLATE
    from mlxhost.testing.demo import CHAT_TEMPLATE

    qwen3_coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    assert choose_tool_parser(qwen3_coder, "qwen3_moe", None) == "qwen3_coder"
    assert choose_tool_parser(AGENT_CHAT_TEMPLATE, None, None) == "hermes"
    assert choose_tool_parser("{{ '[TOOL_CALLS]' }}", None, None) == "mistral"
    assert choose_tool_parser("{{ '<|python_tag|>' }}", None, None) == "llama3_json"
    assert choose_tool_parser("[func_name1(params_name1=params_value1)]", "llama4", None) == "pythonic"
    assert choose_tool_parser(CHAT_TEMPLATE, None, None) is None
    assert choose_tool_parser(CHAT_TEMPLATE, "llama", None) == "llama3_json"
    assert choose_tool_parser(None, "mistral3", None) == "mistral"
    assert choose_tool_parser(None, "gpt2", None) is None
    assert choose_tool_parser(AGENT_CHAT_TEMPLATE, "qwen3", "pythonic") == "pythonic"
    with pytest.raises(ValueError, match="hermes, qwen3_coder, llama3_json, mistral, pythonic"):
        choose_tool_parser(AGENT_CHAT_TEMPLATE, "qwen3", "nope")


def test_package_imports_no_mlx():
    code = (
        "import sys, mlxhost.structured.tool_parsers, mlxhost.structured.reasoning, "
        "mlxhost.structured.templates; assert not any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
