"""`mlxhost launch` pre-warming an agent's fixed prefix on the demo model: the first run of an agent version saves
the system prompt and tools the server noted; a later launch computes them into the cache before the agent
starts, so a new conversation's first turn reads >= 90% of its prompt from the cache.

`claude` here is a script that answers `--version` as Claude Code 2.1.332 does and sends one first turn shaped like
its own (system blocks with breakpoints, its tools, a system message after the user's) with its User-Agent. The
real CLI: tests/external."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from claude_code_request import claude_code_request

from mlxhost.agents import launch
from mlxhost.server import cli
from mlxhost.testing.demo import DemoModelConfig, build_model_folder

VERSION = "2.1.332"
AGENT_SCRIPT = """
import json, os, sys, urllib.request
if sys.argv[1:] == ["--version"]:
    print("{version} (Claude Code)")
    sys.exit(0)
first = json.load(open({first!r}))
first["model"] = os.environ["ANTHROPIC_MODEL"]
first["messages"] = [{{"role": "user", "content": sys.argv[-1]}}, first["messages"][1]]  # the context after it
request = urllib.request.Request(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages", json.dumps(first).encode(),
                                 {{"content-type": "application/json",
                                   "user-agent": "claude-cli/{version} (external, cli)"}})
usage = json.load(urllib.request.urlopen(request, timeout=600))["usage"]
json.dump(usage, open({record!r}, "w"))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_module_server):
    # The demo model with room for an agent's prompt (the session fixture's context is 4096 tokens).
    folder = build_model_folder(tmp_path_factory.mktemp("demo32k"), DemoModelConfig(max_position_embeddings=32768))
    return make_module_server(folder, max_num_seqs=4, prefill_step_size=512)


@pytest.fixture
def fake_claude(tmp_path, monkeypatch, server):
    first = tmp_path / "first.json"
    first.write_text(json.dumps(claude_code_request(server.model_name, max_tokens=1)))
    record = tmp_path / "usage.json"
    script = tmp_path / "claude"
    script.write_text(f"#!{sys.executable}\n" + AGENT_SCRIPT.format(version=VERSION, first=str(first),
                                                                      record=str(record)))
    script.chmod(0o755)
    monkeypatch.setattr(launch, "find_command", lambda command: str(script) if command == "claude" else None)
    monkeypatch.setattr(launch, "agent_folder", lambda name: tmp_path / "agents" / name)
    return record, tmp_path / "agents" / "claude" / "prefixes"


def turn(server, record, question: str, prewarm: str) -> dict:
    port = server.url.rsplit(":", 1)[1]
    assert cli.main(["launch", "claude", "--port", port, "--prewarm", prewarm, "--", "-p", question]) == 0
    return json.loads(record.read_text())


def read_share(usage: dict) -> float:
    total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    return usage["cache_read_input_tokens"] / total


def test_a_new_conversations_first_turn_reads_the_prewarmed_prefix(server, fake_claude):
    record, prefixes = fake_claude
    clear = lambda: httpx.delete(server.url + "/v1/cache", timeout=60).raise_for_status()  # noqa: E731
    clear()
    first = turn(server, record, "conversation one: list the files", "wait")
    assert read_share(first) < 0.1  # nothing saved yet: a cold start, which saves the prefix
    (saved,) = prefixes.iterdir()
    assert saved.name.startswith(VERSION + "--")
    body = json.loads(saved.read_text())["body"]
    # The system message sent after the user's is rendered before it, so it is part of the saved prefix.
    assert [m["role"] for m in body["messages"]] == ["system", "system"] and "conversation one" not in saved.read_text()

    clear()  # a new day, a restarted server: the cache is cold again
    cold = turn(server, record, "conversation two: explain the README", "off")
    assert read_share(cold) < 0.1
    clear()
    warm = turn(server, record, "conversation three: fix the tests", "wait")
    assert read_share(warm) >= 0.9, warm
