"""MCP tools on real Qwen2.5-Coder-0.5B with real MCP servers: `mcp-server-time` and `mcp-server-git` (stdio,
from PyPI, on a temporary repository) and a streamable-HTTP server built with the mcp SDK in this test. The
official clients run the loop: openai's responses.create with an `mcp` tool (forced tool choice; the approval
round trip), chat completions and the anthropic client with `mcp_servers`."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import anthropic
import httpx
import openai
import pytest
import uvicorn

from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.mcp.config import McpConfig, McpServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.needs import need
from tests.e2e.conftest import SERVED_NAME, start_app

pytestmark = pytest.mark.needs("qwen25-coder", "mcp-server-time", "mcp-server-git")
_BOUND_S = 600  # a bound against hangs, never a timing check


def _http_mcp_server():
    """A streamable-HTTP MCP server (the SDK's MCPServer, once FastMCP) on a free port of 127.0.0.1."""
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("calc")

    @app.tool()
    def add(a: int, b: int) -> str:
        """Adds two integers."""
        return str(a + b)

    server = uvicorn.Server(uvicorn.Config(app.streamable_http_app(), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}/mcp"


@pytest.fixture(scope="module")
def repo():
    # One fixed path, not pytest's numbered folder: the prompt quotes it, and a 0.5B model copying
    # `pytest-433/repo0` wrote `repo0.0` on one run out of several; the same prompt every run gives one answer.
    path = pathlib.Path(tempfile.gettempdir()) / "mlxhost-git-demo"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=Test", "-c", "user.email=test@example.com"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (path / "README").write_text("hello\n")
    subprocess.run(git + ["add", "README"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "Add the greeting file"], check=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def live(qwen25_coder_dir, repo):
    http_server, http_thread, url = _http_mcp_server()
    servers = (McpServerConfig("time", command=need("mcp-server-time"), args=("--local-timezone", "UTC")),
               McpServerConfig("git", command=need("mcp-server-git"), args=("--repository", str(repo))),
               McpServerConfig("calc", url=url))
    config = ServerConfig(model=str(qwen25_coder_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=2),
                          # Two rounds: the forced call, then the answer. A 0.5B model on a CPU takes a minute or
                          # more a round, and tends to call again rather than answer, which more rounds only repeat.
                          mcp=McpConfig(servers=servers, max_num_rounds=2))
    server = start_app(build_app(config))
    yield server
    server.stop()
    http_server.should_exit = True
    http_thread.join(timeout=30)


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", timeout=_BOUND_S)


def _items(response, kind: str) -> list:
    return [i for i in response.output if i.type == kind]


def test_servers_are_listed_and_the_http_server_answers(live):
    tools = httpx.get(live.url + "/v1/mcp/tools", timeout=60).json()["data"]
    by_server = {(t["server"], t["name"]) for t in tools}
    assert {("time", "get_current_time"), ("git", "git_log"), ("calc", "add")} <= by_server
    out = httpx.post(live.url + "/v1/mcp/call", json={"server": "calc", "tool": "add", "arguments": {"a": 2, "b": 3}},
                     timeout=60).json()
    assert out == {"server": "calc", "tool": "add", "output": "5", "error": None}


def test_responses_time_query(live):
    r = _client(live).responses.create(
        model=SERVED_NAME, input="What is the current time in UTC?", max_output_tokens=120, temperature=0,
        tools=[{"type": "mcp", "server_label": "time", "require_approval": "never"}],
        tool_choice={"type": "mcp", "server_label": "time", "name": "get_current_time"})
    [listing] = _items(r, "mcp_list_tools")
    assert {t.name for t in listing.tools} == {"get_current_time", "convert_time"}
    call = _items(r, "mcp_call")[0]
    assert call.name == "get_current_time" and call.error is None, call
    assert json.loads(call.output)["timezone"] == "UTC"
    # The 0.5B model tends to repeat the call after its result; the loop's last round then answers with
    # tool_choice "none" (often empty for this model): the query completes either way.
    print("responses/time answer:", repr(r.output_text), "| calls:", len(_items(r, "mcp_call")))
    assert r.status in ("completed", "incomplete")  # the answer round may run to max_output_tokens


def test_responses_git_log_query(live, repo):
    r = _client(live).responses.create(
        model=SERVED_NAME, input=f"Show the last 5 commits in the git log of the repository at {repo}.", max_output_tokens=160,
        temperature=0, tools=[{"type": "mcp", "server_label": "git", "require_approval": "never",
                               "allowed_tools": ["git_log", "git_status"]}],
        tool_choice={"type": "mcp", "server_label": "git", "name": "git_log"})
    call = _items(r, "mcp_call")[0]
    assert call.name == "git_log" and json.loads(call.arguments)["repo_path"] == str(repo), call
    # The server's answer, whatever filters the 0.5B model filled in (it has set max_count or a timestamp that
    # leaves the list empty); the commit itself is checked through a direct call below.
    assert call.error is None and call.output.startswith("Commit history:"), call
    print("responses/git arguments:", call.arguments, "| output:", repr(call.output), "| answer:", repr(r.output_text))
    direct = httpx.post(live.url + "/v1/mcp/call", json={"server": "git", "tool": "git_log",
                                                         "arguments": {"repo_path": str(repo)}}, timeout=60).json()
    assert "Add the greeting file" in direct["output"]
    assert r.status in ("completed", "incomplete")  # the answer round may run to max_output_tokens


def test_responses_approval_round_trip(live):
    client = _client(live)
    tools = [{"type": "mcp", "server_label": "time", "require_approval": "always"}]
    first = client.responses.create(model=SERVED_NAME, input="What is the current time in UTC?", tools=tools,
                                    max_output_tokens=120, temperature=0, tool_choice="required")
    [request] = _items(first, "mcp_approval_request")
    assert request.name in ("get_current_time", "convert_time") and not _items(first, "mcp_call")
    second = client.responses.create(
        model=SERVED_NAME, tools=tools, previous_response_id=first.id, max_output_tokens=120, temperature=0,
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}])
    [call] = _items(second, "mcp_call")
    assert call.approval_request_id == request.id and call.name == request.name
    print("responses/approved answer:", second.output_text, "| call error:", call.error)
    assert second.status in ("completed", "incomplete")


def test_chat_completions_with_mcp_servers(live):
    r = _client(live).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "What is the current time in UTC?"}],
        max_tokens=120, temperature=0, tool_choice="required", extra_body={"mcp_servers": ["time"]})
    calls = r.model_extra["mcp_calls"]
    assert calls and calls[0]["server"] == "time" and calls[0]["error"] is None, calls
    print("chat answer:", repr(r.choices[0].message.content), "| calls:", len(calls))
    assert r.choices[0].finish_reason in ("stop", "length")  # the answer round may run to max_tokens
    # After the result this model restates its call as plain JSON (the answer round is asked with tool_choice
    # "none"), with or without the tools in its prompt, and goes on with the time the tool gave.
    answer = r.choices[0].message.content
    assert answer and json.loads(calls[0]["output"])["datetime"][11:19] in answer


def test_chat_completions_streamed_with_mcp_servers(live):
    stream = _client(live).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "What is the current time in UTC?"}],
        max_tokens=120, temperature=0, tool_choice="required", stream=True, extra_body={"mcp_servers": ["time"]})
    chunks = list(stream)
    [calls] = [c.model_extra["mcp_calls"] for c in chunks if (c.model_extra or {}).get("mcp_calls")]
    assert calls[0]["server"] == "time" and calls[0]["error"] is None, calls
    assert json.loads(calls[0]["output"])["timezone"] == "UTC"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    print("streamed chat answer:", repr(text), "| chunks:", len(chunks))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert text and json.loads(calls[0]["output"])["datetime"][11:19] in text  # the time the tool gave


def test_anthropic_client_with_mcp_servers(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="x", timeout=_BOUND_S)
    r = client.messages.create(model=SERVED_NAME, max_tokens=120, tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "What is the current time in UTC?"}],
                               extra_body={"mcp_servers": ["time"]})
    calls = r.model_extra["mcp_calls"]
    assert calls and calls[0]["server"] == "time" and calls[0]["error"] is None, calls
    text = "".join(b.text for b in r.content if b.type == "text")
    print("anthropic answer:", repr(text), "| calls:", len(calls))
    assert r.stop_reason in ("end_turn", "max_tokens")  # the answer round may run to max_tokens
