"""Responses `mcp` tools and Anthropic `mcp_servers` over a fake model with scripted rounds and a real stdio
MCP server: the items and events OpenAI defines, the approval round trip through previous_response_id, and
remote URLs refused."""

from __future__ import annotations

import json

from mlxhost.mcp.config import McpConfig
from tests.mcp.conftest import SLOW_SERVER, tool_call

MCP_TOOL = {"type": "mcp", "server_label": "slow", "require_approval": "never"}


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_calls_run_and_the_model_answers(mcp_app):
    client, models = mcp_app([tool_call("big", n=2), "It said xx."])
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [MCP_TOOL],
                                           "tool_choice": {"type": "mcp", "server_label": "slow", "name": "big"}})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_call", "message"]
    assert {t["name"] for t in out[0]["tools"]} == {"pid", "env", "sleep", "big", "wait_file"} and out[0]["server_label"] == "slow"
    call = out[1]
    assert (call["server_label"], call["name"], json.loads(call["arguments"]), call["output"], call["error"],
            call["status"]) == ("slow", "big", {"n": 2}, "xx", None, "completed")
    assert out[2]["content"][0]["text"] == "It said xx."
    assert r.json()["status"] == "completed"
    # The first round was forced to call `big`; the second saw its result.
    assert models.engine.requests[0].sampling.constraint is not None
    assert models.last_render["messages"][-1]["content"] == "xx"


def test_allowed_tools_narrow_the_listing(mcp_app):
    client, models = mcp_app(["no tools needed"])
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go",
                                           "tools": [{**MCP_TOOL, "allowed_tools": ["pid"]}]})
    assert [t["name"] for t in r.json()["output"][0]["tools"]] == ["pid"]
    assert [t["function"]["name"] for t in models.last_render["tools"]] == ["pid"]


def test_streamed_events(mcp_app):
    client, _ = mcp_app([tool_call("big", n=1), "done"])
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [MCP_TOOL], "stream": True})
    kinds = [e["type"] for e in _events(r.text)]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for kind in ("response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                 "response.mcp_call.in_progress", "response.mcp_call_arguments.done", "response.mcp_call.completed",
                 "response.output_text.delta", "response.output_text.done"):
        assert kind in kinds, kind
    assert kinds[-1] == "response.completed"
    final = _events(r.text)[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    seq = [e["sequence_number"] for e in _events(r.text)]
    assert seq == list(range(len(seq)))


def test_approval_round_trip(mcp_app):
    client, models = mcp_app([tool_call("big", n=3), "Three xs."])
    tool = {**MCP_TOOL, "require_approval": "always"}
    first = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [tool]}).json()
    assert [i["type"] for i in first["output"]] == ["mcp_list_tools", "mcp_approval_request"]
    request = first["output"][1]
    assert (request["name"], json.loads(request["arguments"])) == ("big", {"n": 3})
    second = client.post("/v1/responses", json={
        "model": "tiny", "tools": [tool], "previous_response_id": first["id"],
        "input": [{"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}]})
    assert second.status_code == 200, second.text
    out = second.json()["output"]
    assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_call", "message"]
    assert out[1]["output"] == "xxx" and out[1]["approval_request_id"] == request["id"]
    assert out[2]["content"][0]["text"] == "Three xs."
    assert models.last_render["messages"][-1]["content"] == "xxx"


def test_a_declined_call_is_not_run(mcp_app):
    client, models = mcp_app([tool_call("big", n=3), "Fine, I will not."])
    tool = {**MCP_TOOL, "require_approval": "always"}
    first = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [tool]}).json()
    second = client.post("/v1/responses", json={
        "model": "tiny", "tools": [tool], "previous_response_id": first["id"],
        "input": [{"type": "mcp_approval_response", "approval_request_id": first["output"][1]["id"],
                   "approve": False}]}).json()
    call = second["output"][1]
    assert call["type"] == "mcp_call" and call["output"] is None and "declined" in call["error"]


def test_remote_urls_are_refused(mcp_app):
    client, _ = mcp_app(["hi"])
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [
        {"type": "mcp", "server_label": "x", "server_url": "https://example.com/mcp"}]})
    assert r.status_code == 400 and "--mcp-allow-remote" in r.json()["error"]["message"]
    client, _ = mcp_app(["hi"], McpConfig(servers=(SLOW_SERVER,), allow_remote=True))
    r = client.post("/v1/responses", json={"model": "tiny", "input": "go", "tools": [
        {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1/mcp"}]})
    assert r.status_code == 400 and "private or local address" in r.json()["error"]["message"]


def test_anthropic_messages_with_mcp_servers(mcp_app):
    client, _ = mcp_app([tool_call("big", n=2), "Two xs."])
    r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 64, "mcp_servers": ["slow"],
                                          "messages": [{"role": "user", "content": "go"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == [{"type": "text", "text": "Two xs."}] and body["stop_reason"] == "end_turn"
    [call] = body["mcp_calls"]
    assert (call["server"], call["name"], call["output"]) == ("slow", "big", "xx")
