"""AGENT_CHAT_TEMPLATE through the demo tokenizer's apply_chat_template, as the server renders prompts."""

import json

import pytest

from mlxhost.structured.templates import AGENT_CHAT_TEMPLATE
from mlxhost.structured.tool_parsers import parse_complete
from mlxhost.testing.demo import CHAT_TEMPLATE, build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
PLAIN_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": "this?"}]},
        {"role": "assistant", "content": "A cat.\n"},
        {"role": "user", "content": "  And  this?\n\n"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
     {"role": "developer", "content": "b"}],
    [{"role": "user", "content": "Unicode: Zürich 東京 <b>&amp;</b> {{ not jinja }}"}],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("demo-tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def render(tokenizer, messages, template=AGENT_CHAT_TEMPLATE, **kwargs):
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


@pytest.mark.parametrize("messages", PLAIN_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_conversations_render_like_the_demo_template(tokenizer, messages, add_generation_prompt):
    kwargs = {"add_generation_prompt": add_generation_prompt}
    expected = render(tokenizer, messages, CHAT_TEMPLATE, **kwargs)
    assert render(tokenizer, messages, **kwargs) == expected
    # Empty tools, or variables the template does not use, change nothing either.
    assert render(tokenizer, messages, tools=[], **kwargs) == expected
    assert render(tokenizer, messages, reasoning_effort="low", **kwargs) == expected


def test_enable_thinking(tokenizer):
    messages = PLAIN_CONVERSATIONS[1]
    plain = render(tokenizer, messages, add_generation_prompt=True)
    # Thinking forced on: the prompt opens the block, the reply starts inside it.
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True) == plain + "<think>\n"
    # Off adds nothing (mlx-lm passes enable_thinking=False for tokenizers without think tokens).
    assert render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False) == plain
    assert render(tokenizer, messages, add_generation_prompt=False, enable_thinking=False) == render(
        tokenizer, messages, add_generation_prompt=False
    )


def test_tools_tool_calls_and_tool_results(tokenizer):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21C"}]},
        {"role": "assistant", "content": "Checking once more.", "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Köln"}}]},
        {"role": "tool", "content": "5C"},
    ]
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    expected = (
        "<|im_start|>system\nYou are helpful.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + tool_json
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nChecking once more.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, tools=TOOLS, add_generation_prompt=True) == expected


def test_tools_without_system_message(tokenizer):
    text = render(tokenizer, [{"role": "user", "content": "hi"}], tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_rendered_tool_calls_parse_back_with_hermes(tokenizer):
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "note": 'ünïcode "quoted" </tool_call'}},
        {"name": "ping", "arguments": {}},
    ]
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "On it.", "tool_calls": calls}]
    text = render(tokenizer, messages, tools=TOOLS)
    reply = text.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    content, parsed = parse_complete("hermes", reply, TOOLS)
    assert content == "On it."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("trim", [True, False])
def test_bare_jinja_renders_the_same(tokenizer, trim):
    """The template does its own whitespace control, so any jinja2 setup (mlx-lm's, ours) gives the same text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=trim, lstrip_blocks=trim)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    messages = PLAIN_CONVERSATIONS[2] + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ping", "arguments": {}}}]},
        {"role": "tool", "content": "pong"},
    ]
    kwargs = {"tools": TOOLS, "add_generation_prompt": True, "enable_thinking": False}
    bare = env.from_string(AGENT_CHAT_TEMPLATE).render(messages=messages, **kwargs)
    assert bare == render(tokenizer, messages, **kwargs)
