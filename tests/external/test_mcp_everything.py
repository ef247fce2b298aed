"""The reference MCP server (@modelcontextprotocol/server-everything, pinned in clients.txt) as a stdio server
of `mlxhost serve --mcp-config`: its tools are listed at /v1/mcp/tools and its `echo` runs through /v1/mcp/call."""

from __future__ import annotations

import json

import httpx
import pytest
from agent_lane import start_demo_server, stop_demo_server

from mlxhost.testing.needs import need

pytestmark = [pytest.mark.external, pytest.mark.needs("mcp-server-everything")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("everything")
    config = folder / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "everything": {"command": need("mcp-server-everything"), "args": ["stdio"]}}}))
    server = start_demo_server(folder / "serve.log", extra_args=("--mcp-config", str(config)))
    yield server
    stop_demo_server(server)


def test_its_tools_are_listed(served):
    servers = httpx.get(served.url + "/v1/mcp/servers", timeout=30).json()["data"]
    assert [(s["label"], s["transport"], s["state"]) for s in servers] == [("everything", "stdio", "ready")]
    tools = {t["name"]: t for t in httpx.get(served.url + "/v1/mcp/tools", timeout=30).json()["data"]}
    assert servers[0]["num_tools"] == len(tools)
    assert {"echo", "get-sum"} <= set(tools)
    assert tools["echo"]["server"] == "everything"
    assert tools["echo"]["input_schema"]["properties"]["message"]["type"] == "string"


def test_echo_runs_through_the_call_endpoint(served):
    r = httpx.post(served.url + "/v1/mcp/call", timeout=120, json={
        "server": "everything", "tool": "echo", "arguments": {"message": "héllo from mlxhost"}})
    assert r.status_code == 200, r.text
    assert r.json() == {"server": "everything", "tool": "echo", "output": "Echo: héllo from mlxhost", "error": None}
