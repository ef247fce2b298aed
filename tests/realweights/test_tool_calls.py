"""Tool calls from the real Qwen2.5-Coder-0.5B-Instruct (its GGUF, converted to float32) through the three
dialects, streamed and whole: `tool_choice` required / any gives a valid `get_weather` call, and `auto` on a
weather question gives one too. Slow on a CPU (a few seconds a token): short replies, greedy."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.e2e.conftest import start_server

pytestmark = pytest.mark.needs("qwen25-coder")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]
QUESTION = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(qwen25_coder_dir):
    live = start_server(qwen25_coder_dir, max_num_seqs=2, prefill_step_size=512)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=900) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=900) as c:
        yield c


def check_paris(name: str, arguments) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather" and isinstance(args.get("city"), str) and "paris" in args["city"].lower(), args


def chat_streamed(client, model, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or ():
            name, args = calls.get(tc.index, ("", ""))
            calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_chat_completions(client, server, choice):
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(model=server.model_name, **kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls", msg
    assert len(msg.tool_calls) == 1 and not msg.content
    check_paris(msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments)
    content, calls, finish = chat_streamed(client, server.model_name, **kw)
    assert finish == "tool_calls" and not content
    assert calls == [(msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments)]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages(claude, server, stream):
    kw = dict(model=server.model_name, max_tokens=MAX_TOKENS, messages=MESSAGES, tool_choice={"type": "any"},
              tools=[{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}],
              extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**kw)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and not [b for b in message.content if b.type == "text" and b.text.strip()]
    check_paris(uses[0].name, uses[0].input)


@pytest.mark.parametrize("stream", [False, True])
def test_responses(client, server, stream):
    kw = dict(model=server.model_name, input=QUESTION, tool_choice="required", temperature=0,
              max_output_tokens=MAX_TOKENS, tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER,
                                                    "description": "Get the current weather in a city"}])
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        response = events[-1].response
        assert not [e for e in events if e.type == "response.output_text.delta"]
    else:
        response = client.responses.create(**kw)
    assert response.status == "completed", response
    calls = [o for o in response.output if o.type == "function_call"]
    assert len(calls) == 1 and response.output_text == ""
    check_paris(calls[0].name, calls[0].arguments)
