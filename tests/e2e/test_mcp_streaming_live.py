"""`mcp_servers` streamed to the official openai and anthropic clients by a live server over a fake model whose
rounds are scripted and a real stdio MCP server (tests/mcp/slow_server.py): keep-alives parse while a call is
held, the calls come before the answer's text, a server killed mid-call is a tool error the model answers,
and a client that leaves stops the rounds and the call under way. Calls are held on a file the test writes
(no timing assumption); the heartbeat interval is shortened."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from mlxhost.frontends.app import create_app
from mlxhost.mcp.client import McpManager
from mlxhost.mcp.config import McpConfig
from tests.e2e.conftest import start_app
from tests.e2e.test_streaming import fast_heartbeat  # noqa: F401 (a fixture)
from tests.frontends.fake_models import FakeModels
from tests.mcp.conftest import SLOW_SERVER, ScriptedEngine, tool_call

_BOUND_S = 60  # hang bounds, not timing checks
NUM_BEATS = 3
QUESTION = [{"role": "user", "content": "What does the file say?"}]


@pytest.fixture
def live_mcp(fast_heartbeat):  # noqa: F811
    """start(replies) -> (LiveServer, FakeModels): the app with the slow server configured, served by uvicorn."""
    started = []

    def start(replies: list[str]):
        models = FakeModels()
        models.engine = ScriptedEngine(replies)
        # A call timeout past every wait here: a held call ends only when the test lets it go or leaves.
        config = McpConfig(servers=(SLOW_SERVER,), call_timeout_s=10 * _BOUND_S)
        live = start_app(create_app(models, McpManager(config)))
        started.append(live)
        return live, models

    yield start
    for live in started:
        live.stop()


def wait_for(path: Path) -> str:
    deadline = time.monotonic() + _BOUND_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def _openai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", timeout=_BOUND_S, max_retries=0)


def _anthropic(live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", timeout=_BOUND_S, max_retries=0)


def test_openai_stream_beats_while_the_call_is_held_then_reports_it_and_answers(live_mcp, tmp_path):
    gate = tmp_path / "gate"
    live, _ = live_mcp([tool_call("wait_file", path=str(gate)), "The file says ready."])
    stream = _openai(live).chat.completions.create(model="tiny", messages=QUESTION, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"mcp_servers": ["slow"]})
    chunks, beats = [], 0
    for chunk in stream:
        chunks.append(chunk)
        empty = chunk.choices and not chunk.choices[0].delta.content and not chunk.choices[0].delta.role
        if empty and not (chunk.model_extra or {}).get("mcp_calls") and not chunk.choices[0].finish_reason:
            beats += 1
            if beats == NUM_BEATS:
                wait_for(gate.with_name("gate.started"))
                gate.write_text("ready")
    assert beats >= NUM_BEATS
    [at] = [i for i, c in enumerate(chunks) if (c.model_extra or {}).get("mcp_calls")]
    [call] = chunks[at].model_extra["mcp_calls"]
    assert (call["server"], call["name"], call["output"], call["error"]) == ("slow", "wait_file", "ready", None)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:at] if c.choices) == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks[at:] if c.choices) == "The file says ready."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens > 0


def test_openai_stream_helper_accepts_the_calls_chunk(live_mcp):
    live, _ = live_mcp([tool_call("big", n=3), "Three xs."])
    with _openai(live).chat.completions.stream(model="tiny", messages=QUESTION,
                                               extra_body={"mcp_servers": ["slow"]}) as stream:
        calls = [e.chunk.model_extra["mcp_calls"] for e in stream if e.type == "chunk"
                 and (e.chunk.model_extra or {}).get("mcp_calls")]
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Three xs." and final.choices[0].finish_reason == "stop"
    assert [[c["output"] for c in call] for call in calls] == [["xxx"]]


def test_anthropic_stream_beats_while_the_call_is_held_then_reports_it_and_answers(live_mcp, tmp_path):
    gate = tmp_path / "gate"
    call = tool_call("wait_file", path=str(gate))
    live, _ = live_mcp([call, "The file says ready.", call, "The file says ready."])
    events = []
    with httpx.Client(timeout=_BOUND_S) as http:  # pings are skipped by the SDK: count them on the wire
        with http.stream("POST", live.url + "/v1/messages", json={
                "model": "tiny", "max_tokens": 64, "messages": QUESTION, "mcp_servers": ["slow"],
                "stream": True}) as r:
            beats = 0
            for line in r.iter_lines():
                events.append(line)
                beats += line == "event: ping"
                if beats == NUM_BEATS and not gate.exists():
                    wait_for(gate.with_name("gate.started"))
                    gate.write_text("ready")
    assert beats >= NUM_BEATS
    names = [line[7:] for line in events if line.startswith("event: ")]
    assert names.index("mcp_calls") < names.index("content_block_start")
    # The SDK's stream helper passes the extension event on with the others.
    gate.write_text("again")
    with _anthropic(live).messages.stream(model="tiny", max_tokens=64, messages=QUESTION,
                                extra_body={"mcp_servers": ["slow"]}) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    [calls] = [e.mcp_calls for e in seen if e.type == "mcp_calls"]
    assert [(c["name"], c["output"], c["error"]) for c in calls] == [("wait_file", "again", None)]
    assert [b.text for b in final.content] == ["The file says ready."] and final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0


def test_a_server_killed_mid_call_streams_a_tool_error_then_the_answer(live_mcp, tmp_path):
    gate = tmp_path / "gate"
    live, _ = live_mcp([tool_call("wait_file", path=str(gate)), "Sorry, the tool failed."])
    stream = _anthropic(live).messages.create(model="tiny", max_tokens=64, messages=QUESTION, stream=True,
                                              extra_body={"mcp_servers": ["slow"]})
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 1:  # message_start came: the call runs once the first round ends
            os.kill(int(wait_for(gate.with_name("gate.started"))), signal.SIGKILL)
    [calls] = [e.mcp_calls for e in events if e.type == "mcp_calls"]
    [call] = calls
    assert call["output"] is None and "slow" in call["error"], call
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "Sorry, the tool failed." and events[-1].type == "message_stop"


def test_openai_stream_of_a_dead_server(live_mcp, tmp_path):
    gate = tmp_path / "gate"
    live, _ = live_mcp([tool_call("wait_file", path=str(gate)), "Sorry, the tool failed."])
    stream = _openai(live).chat.completions.create(model="tiny", messages=QUESTION, stream=True,
                                                   extra_body={"mcp_servers": ["slow"]})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 1:
            os.kill(int(wait_for(gate.with_name("gate.started"))), signal.SIGKILL)
    [call] = next(c.model_extra["mcp_calls"] for c in chunks if (c.model_extra or {}).get("mcp_calls"))
    assert call["output"] is None and call["error"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sorry, the tool failed."


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": QUESTION}),
    ("/v1/messages", {"messages": QUESTION, "max_tokens": 64}),
])
def test_a_client_that_leaves_stops_the_call_and_the_rounds(live_mcp, tmp_path, path, body):
    gate = tmp_path / "gate"
    live, models = live_mcp([tool_call("wait_file", path=str(gate)), "never sent"])
    with httpx.Client(timeout=_BOUND_S) as http:
        with http.stream("POST", live.url + path, json={"model": "tiny", "stream": True, "mcp_servers": ["slow"],
                                                        **body}) as r:
            for _ in r.iter_lines():  # keep-alives until the call runs
                if gate.with_name("gate.started").exists():
                    break
        # Leaving the block closed the connection.
    assert wait_for(gate.with_name("gate.cancelled")) == "cancelled"  # the MCP server was told to stop the call
    gate.write_text("too late")
    assert len(models.engine.requests) == 1  # no round after the call
    out = httpx.post(live.url + "/v1/mcp/call", json={"server": "slow", "tool": "big", "arguments": {"n": 2}},
                     timeout=_BOUND_S).json()
    assert out["output"] == "xx"


def test_a_whole_reply_whose_client_leaves_stops_the_call_too(live_mcp, tmp_path):
    gate = tmp_path / "gate"
    live, models = live_mcp([tool_call("wait_file", path=str(gate)), "never sent"])
    body = json.dumps({"model": "tiny", "messages": QUESTION, "mcp_servers": ["slow"]}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=_BOUND_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(gate.with_name("gate.started"))
    assert wait_for(gate.with_name("gate.cancelled")) == "cancelled"
    gate.write_text("too late")
    assert len(models.engine.requests) == 1
