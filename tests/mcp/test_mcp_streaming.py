"""`mcp_servers` streamed, over chat completions and Anthropic Messages, with a fake model whose rounds are
scripted and a real stdio MCP server: keep-alives while the rounds and calls run, the calls reported before
the answer's text, usage summed over the rounds, a tool error and a failed round in the stream's own shape."""

from __future__ import annotations

import json

from mlxhost.mcp.config import McpConfig
from tests.mcp.conftest import SLOW_SERVER, tool_call

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "mcp_servers": ["slow"], "stream": True}
MESSAGES = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "go"}], "mcp_servers": ["slow"],
            "stream": True}


def _chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _events(text: str) -> list[tuple[str, dict]]:
    names = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    return list(zip(names, _chunks(text)))


def test_chat_streams_the_calls_then_the_answer(mcp_app):
    client, models = mcp_app([tool_call("big", n=4), "The tool said xxxx."], McpConfig(servers=(SLOW_SERVER,)))
    r = client.post("/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.text.endswith("data: [DONE]\n\n")
    chunks = _chunks(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    [at] = [i for i, c in enumerate(chunks) if "mcp_calls" in c]
    [call] = chunks[at]["mcp_calls"]
    assert (call["server"], call["name"], call["output"], call["error"]) == ("slow", "big", "xxxx", None)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[at + 1:] if c["choices"])
    assert text == "The tool said xxxx."
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks[:at])  # the first round's call is not shown
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert len({c["id"] for c in chunks}) == 1
    # Usage counts both rounds, as the whole reply's does.
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(q.num_prompt_tokens for q in models.engine.requests)
    assert models.last_render["messages"][-1] == {"role": "tool", "tool_call_id": call["id"], "content": "xxxx"}


def test_messages_stream_the_calls_then_the_answer(mcp_app):
    client, models = mcp_app([tool_call("big", n=2), "Two xs."])
    r = client.post("/v1/messages", json=MESSAGES)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.index("mcp_calls") < names.index("content_block_start")
    [call] = dict(events)["mcp_calls"]["mcp_calls"]
    assert (call["server"], call["name"], call["output"], call["error"]) == ("slow", "big", "xx", None)
    text = "".join(e["delta"]["text"] for name, e in events if name == "content_block_delta")
    assert text == "Two xs."
    delta = dict(events)["message_delta"]
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert delta["usage"]["input_tokens"] == sum(q.num_prompt_tokens for q in models.engine.requests)
    assert dict(events)["message_start"]["message"]["id"].startswith("msg_")


def test_a_tool_error_reaches_the_model_and_the_stream_goes_on(mcp_app):
    client, models = mcp_app([tool_call("big", n="many"), "It failed."])
    r = client.post("/v1/chat/completions", json=CHAT)
    [at] = [c for c in _chunks(r.text) if "mcp_calls" in c]
    [call] = at["mcp_calls"]
    assert call["output"] is None and call["error"]
    assert models.last_render["messages"][-1]["content"].startswith("Error: ")
    assert "It failed." in r.text and '"error": {' not in r.text


def test_a_failed_round_ends_the_stream_in_its_shape(mcp_app):
    client, models = mcp_app([tool_call("big", n=1)])
    models.engine.failure = "crash"
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert _chunks(r.text)[-1]["error"]["message"] == "engine failed"
    r = client.post("/v1/messages", json=MESSAGES)
    assert _events(r.text)[-1][0] == "error"


def test_refusals_come_before_the_stream(mcp_app):
    client, _ = mcp_app(["hi"])
    r = client.post("/v1/chat/completions", json={**CHAT, "mcp_servers": ["nope"]})
    assert r.status_code == 400 and "no MCP server 'nope'" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={**MESSAGES, "mcp_servers": ["nope"]})
    assert r.status_code == 400
