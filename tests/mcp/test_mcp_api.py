"""/v1/mcp/* and the tool-call loop over chat completions, with a fake model and a real stdio MCP server:
the listing, a direct call, calls run between rounds, a timeout, a server killed mid-call (a tool error,
then restarted), the output cap, and the refusals (unknown labels, remote URLs)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from mlxhost.mcp.config import McpConfig
from tests.mcp.conftest import SLOW_SERVER, tool_call

_BOUND_S = 60  # a bound against hangs, never a timing check


def test_servers_and_tools_are_listed(mcp_app):
    client, _ = mcp_app(["hi"])
    servers = client.get("/v1/mcp/servers").json()["data"]
    assert [(s["label"], s["transport"], s["state"]) for s in servers] == [("slow", "stdio", "ready")]
    tools = client.get("/v1/mcp/tools").json()
    assert tools["object"] == "list"
    assert {t["name"] for t in tools["data"]} == {"pid", "env", "sleep", "big", "wait_file"}
    big = next(t for t in tools["data"] if t["name"] == "big")
    assert big["server"] == "slow" and big["input_schema"]["properties"]["n"]["type"] == "integer"


def test_direct_call_and_its_errors(mcp_app):
    client, _ = mcp_app(["hi"])
    r = client.post("/v1/mcp/call", json={"server": "slow", "tool": "big", "arguments": {"n": 3}})
    assert r.status_code == 200 and r.json()["output"] == "xxx" and r.json()["error"] is None
    r = client.post("/v1/mcp/call", json={"server": "nope", "tool": "big", "arguments": {}})
    assert r.status_code == 404
    r = client.post("/v1/mcp/call", json={"server": "slow", "tool": "nope", "arguments": {}})
    assert r.status_code == 200 and "no tool 'nope'" in r.json()["error"]


def test_a_server_gets_only_the_environment_its_config_names(mcp_app, monkeypatch):
    # The model server's own secrets (API keys, tokens in its environment) never reach an MCP server.
    monkeypatch.setenv("MLXHOST_TEST_SECRET", "hunter2")
    named = dataclasses.replace(SLOW_SERVER, env=(("GREETING", "hello"),))
    client, _ = mcp_app(["hi"], McpConfig(servers=(named,)))

    def read(name: str) -> str:
        r = client.post("/v1/mcp/call", json={"server": "slow", "tool": "env", "arguments": {"name": name}})
        assert r.status_code == 200 and r.json()["error"] is None, r.text
        return r.json()["output"]

    assert read("GREETING") == "hello"
    assert read("MLXHOST_TEST_SECRET") == "unset"
    assert read("PATH") != "unset"  # the SDK's minimal set stays, so the program can start its own children


def test_output_is_capped(mcp_app):
    client, _ = mcp_app(["hi"], McpConfig(servers=(SLOW_SERVER,), max_output_bytes=100))
    out = client.post("/v1/mcp/call", json={"server": "slow", "tool": "big", "arguments": {"n": 5000}}).json()
    assert out["output"].startswith("x" * 100) and "[output cut at 100 of 5000 bytes]" in out["output"]


def test_a_hanging_tool_is_cut_at_the_timeout(mcp_app):
    client, _ = mcp_app(["hi"], McpConfig(servers=(SLOW_SERVER,), call_timeout_s=1))
    out = client.post("/v1/mcp/call", json={"server": "slow", "tool": "sleep", "arguments": {"seconds": 600}}).json()
    assert "timed out after 1 s" in out["error"]
    # The server still answers.
    assert client.post("/v1/mcp/call", json={"server": "slow", "tool": "big", "arguments": {"n": 1}}).json()["output"] == "x"


def test_chat_runs_the_calls_and_answers(mcp_app):
    client, models = mcp_app([tool_call("big", n=4), "The tool said xxxx."])
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                                                  "mcp_servers": ["slow"], "tool_choice": "required"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The tool said xxxx."
    assert body["choices"][0]["finish_reason"] == "stop"
    [call] = body["mcp_calls"]
    assert (call["server"], call["name"], call["output"], call["error"]) == ("slow", "big", "xxxx", None)
    # The second round saw the call and its result; the MCP tools were offered in both.
    second = models.last_render
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": call["id"], "content": "xxxx"}
    assert {t["function"]["name"] for t in second["tools"]} == {"pid", "env", "sleep", "big", "wait_file"}


def test_a_server_killed_mid_call_is_a_tool_error_then_restarted(mcp_app):
    client, _ = mcp_app([tool_call("sleep", seconds=30), "Sorry, the tool failed."],
                        McpConfig(servers=(SLOW_SERVER,), call_timeout_s=_BOUND_S))
    pid = int(client.post("/v1/mcp/call", json={"server": "slow", "tool": "pid", "arguments": {}}).json()["output"])

    def kill_once_sleeping():
        time.sleep(1)  # the chat request's call has started by then; if not, the call still fails or restarts
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_sleeping)
    killer.start()
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "go"}],
                                                  "mcp_servers": ["slow"]})
    killer.join()
    assert r.status_code == 200, r.text
    [call] = r.json()["mcp_calls"]
    assert call["output"] is None and "slow" in call["error"]
    assert r.json()["choices"][0]["message"]["content"] == "Sorry, the tool failed."
    # Restarted: a new process answers.
    deadline = time.monotonic() + _BOUND_S
    while True:
        out = client.post("/v1/mcp/call", json={"server": "slow", "tool": "pid", "arguments": {}}).json()
        if out["output"] is not None or time.monotonic() > deadline:
            break
    assert out["output"] is not None and int(out["output"]) != pid
    assert client.get("/v1/mcp/servers").json()["data"][0]["num_restarts"] >= 1


def test_unknown_labels_and_remote_urls_are_refused(mcp_app):
    client, _ = mcp_app(["hi"])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}
    r = client.post("/v1/chat/completions", json={**chat, "mcp_servers": ["nope"]})
    assert r.status_code == 400 and "no MCP server 'nope'" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**chat, "mcp_servers": [{"name": "x", "url": "https://example.com/mcp"}]})
    assert r.status_code == 400 and "--mcp-allow-remote" in r.json()["error"]["message"]


def test_with_remote_allowed_private_addresses_stay_refused(mcp_app):
    client, _ = mcp_app(["hi"], McpConfig(servers=(SLOW_SERVER,), allow_remote=True))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}
    for url in ("http://127.0.0.1:9/mcp", "http://10.0.0.1/mcp", "http://192.168.1.1/mcp", "http://[::1]:9/mcp",
                "http://169.254.169.254/mcp", "http://localhost:9/mcp"):
        r = client.post("/v1/chat/completions", json={**chat, "mcp_servers": [{"name": "x", "url": url}]})
        assert r.status_code == 400, url
        assert "private or local address" in r.json()["error"]["message"], url


def test_a_key_limited_to_other_servers_neither_sees_nor_calls_this_one():
    from fastapi.testclient import TestClient

    from mlxhost.frontends.app import create_app
    from mlxhost.frontends.common.keys import KeyPolicy
    from mlxhost.mcp.client import McpManager
    from mlxhost.mcp.config import McpConfig
    from tests.frontends.fake_models import FakeModels
    from tests.mcp.conftest import SLOW_SERVER

    app = create_app(FakeModels(), McpManager(McpConfig(servers=(SLOW_SERVER,), call_timeout_s=3)))

    @app.middleware("http")
    async def as_limited_key(request, call_next):  # what the key gate leaves on the request
        request.state.api_key = KeyPolicy(key="k", name="limited", mcp_servers=("other",))
        return await call_next(request)

    with TestClient(app) as client:
        assert client.get("/v1/mcp/servers").json()["data"] == []
        assert client.get("/v1/mcp/tools").json()["data"] == []
        r = client.post("/v1/mcp/call", json={"server": "slow", "tool": "big", "arguments": {"n": 3}})
        assert r.status_code == 403 and r.json()["error"]["code"] == "mcp_server_not_allowed"
