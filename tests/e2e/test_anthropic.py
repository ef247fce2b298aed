"""Anthropic Messages through the official `anthropic` client, on the random-weight demo fixture. Tool
calls are only valid because the grammar forces them (`tool_choice` any / tool); temperature 0 makes a
streamed and a whole reply the same tokens."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from claude_code_request import CURRENT_FIELDS, claude_code_request

TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
        "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Time in a zone", "input_schema": TIME, "cache_control": {"type": "ephemeral"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
# This SDK has no sampling arguments any more; the server still reads them (Claude Code sends them).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    # No retries: a retried 4xx/5xx would hide what the server answered.
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def raw_events(claude, **kw) -> list:
    with claude.messages.create(stream=True, **kw) as stream:
        return list(stream)


def collapsed(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def sse_lines(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) as sent: the SDK drops pings before a test could see them."""
    out = []
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                out.append((name, data))
    return out


def test_create(claude, server):
    m = claude.messages.create(model=server.model_name, max_tokens=8, messages=MESSAGES, extra_body=GREEDY,
                               system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                               metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 0
    assert m.usage.cache_creation_input_tokens == 0 and m.usage.cache_read_input_tokens is not None


def test_stream_event_order_and_text(claude, server):
    kw = dict(model=server.model_name, max_tokens=10, messages=MESSAGES, extra_body=GREEDY)
    events = sse_lines(server.url, {"model": server.model_name, "max_tokens": 10, "messages": MESSAGES, **GREEDY})
    types = [name for name, _ in events]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    assert events[0][1]["message"]["content"] == [] and events[2][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 10
    # The SDK's raw events: the same grammar, pings left out (deltas may come merged differently).
    sdk_types = [e.type for e in raw_events(claude, **kw)]
    assert collapsed(sdk_types) == collapsed([t for t in types if t != "ping"])
    whole = claude.messages.create(**kw)
    assert text == whole.content[0].text
    # The SDK's own accumulator reads the same events into the same message.
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens"


def test_stop_sequence(claude, server):
    kw = dict(model=server.model_name, max_tokens=24, messages=MESSAGES, extra_body=GREEDY)
    text = claude.messages.create(**kw).content[0].text
    stop = text.strip()[3:6]
    cut = claude.messages.create(stop_sequences=["@@never@@", stop], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}])
def test_forced_tool_use_whole_and_streamed(claude, server, choice):
    kw = dict(model=server.model_name, max_tokens=120, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
              extra_body=GREEDY)
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].id.startswith("toolu_")
    if choice["type"] == "tool":
        assert calls[0].name == "get_time"
    jsonschema.validate(calls[0].input, SCHEMAS[calls[0].name])

    events = raw_events(claude, **kw)
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    assert len(starts) == 1 and starts[0].content_block.name == calls[0].name
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == calls[0].input
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]


def test_tool_round_trip(claude, server):
    first = claude.messages.create(model=server.model_name, max_tokens=120, messages=MESSAGES, tools=TOOLS,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   extra_body=GREEDY)
    call = next(b for b in first.content if b.type == "tool_use")
    history = MESSAGES + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "21 C, sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_other", "content": "timeout", "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    second = claude.messages.create(model=server.model_name, max_tokens=8, messages=history, tools=TOOLS)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (second.usage.input_tokens + second.usage.cache_read_input_tokens + second.usage.cache_creation_input_tokens
            > first.usage.input_tokens)


def test_count_tokens_matches_usage(claude, server):
    kw = dict(model=server.model_name, messages=MESSAGES, tools=TOOLS, system="You are terse.")
    counted = claude.messages.count_tokens(**kw)
    m = claude.messages.create(max_tokens=4, **kw)
    # input_tokens leaves out what the prefix cache served and what a breakpoint wrote to it (Anthropic's split):
    # the three together are the prompt.
    u = m.usage
    assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens


def test_thinking_block(claude, server):
    kw = dict(model=server.model_name, max_tokens=12, messages=MESSAGES, extra_body=GREEDY,
              thinking={"type": "enabled", "budget_tokens": 1024})
    m = claude.messages.create(**kw)
    assert m.content[0].type == "thinking" and m.content[0].thinking
    events = raw_events(claude, **kw)
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == m.content[0].thinking
    off = claude.messages.create(model=server.model_name, max_tokens=4, messages=MESSAGES,
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


@pytest.mark.parametrize("kw, words", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, ["tool_choice", "web_search"]),
    ({"tool_choice": {"type": "any"}}, ["tool_choice"]),
    ({"extra_body": {"temperature": 1.5}}, ["temperature"]),
    ({"extra_body": {"temperature": 1.5, "top_k": -1}, "stop_sequences": ["s"] * 17},
     ["3 problems", "temperature", "top_k", "stop_sequences"]),
])
def test_bad_requests_are_anthropic_400s(claude, server, kw, words):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=server.model_name, max_tokens=4, messages=MESSAGES, **kw)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert all(w in body["error"]["message"] for w in words), body["error"]["message"]


def test_unknown_fields_and_server_tools_are_accepted(claude, server):
    # Anthropic adds request fields often: unknown ones and bookkeeping are accepted; a server tool
    # the client does not force is skipped (the model sees the client tools only).
    m = claude.messages.create(model=server.model_name, max_tokens=4, messages=MESSAGES, extra_body={
        **GREEDY, **CURRENT_FIELDS, "bogus": 1, "speed": "fast"},
        tools=[{"type": "web_search_20250305", "name": "web_search"}, TOOLS[0]])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_unknown_model_and_missing_max_tokens(claude, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    assert err.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": server.model_name, "messages": MESSAGES}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    # Other paths keep OpenAI's shape.
    r = httpx.post(server.base_url + "/chat/completions", json={"model": "nope", "messages": MESSAGES}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.fixture(scope="module")
def long_context_server(make_module_server, qwen3_model_dir):
    # The demo tokenizer spends ~2 characters a token: Claude Code's ~2k-token request is ~7k here.
    return make_module_server(qwen3_model_dir, max_num_seqs=4, max_model_len=16384)


def test_claude_code_replay_hits_the_prefix_cache(long_context_server):
    live = long_context_server
    with anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=300) as claude:
        body = claude_code_request(live.model_name)
        first = claude.messages.create(**body, extra_body={**GREEDY, **CURRENT_FIELDS})
        assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
        counted = claude.messages.count_tokens(**{k: v for k, v in body.items() if k not in ("max_tokens", "metadata")})
        u = first.usage
        assert counted.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        body["messages"] += [{"role": "assistant", "content": first.content},
                             {"role": "user", "content": [{"type": "text", "text": "Good. Now commit it.",
                                                           "cache_control": {"type": "ephemeral"}}]}]
        with claude.messages.stream(**body, extra_body={**GREEDY, **CURRENT_FIELDS}) as stream:
            second = stream.get_final_message()
    # Everything up to the first reply is the same prompt: its whole blocks come from the cache (the
    # last one or two may not: a partial block is never cached, and tokens may merge across the seam).
    assert second.usage.cache_read_input_tokens > 0
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 2 * 128
