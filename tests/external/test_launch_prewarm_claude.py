"""`mlxhost launch claude` with the real Claude Code: its first run saves the system prompt, tools and context, a
later new conversation after a cache clear is pre-warmed (`--prewarm wait`) and its first turn reads most of its
prompt from the cache (Claude Code's own usage report); a cold one (`--prewarm off`) is the comparison.

Claude Code 2.1.332 sends its per-project context (working directory, date, agent types, skills: ~4k tokens of the
demo tokenizer) as a system message after the first user message; the server renders it ahead of that message
(anthropic/translate.py), so the saved prefix holds it and only the user's first message is computed: 98.5% (22,272 of 22,604 tokens)
against 0% cold."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from agent_lane import RESULTS, TURN_TIMEOUT_S, find_cli

from mlxhost.agents.launch import agent_clis_prefix

MIN_READ = 0.90


def first_turn(server, env, project, question: str, prewarm: str) -> dict:
    port = server.url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "mlxhost.server.cli", "launch", "claude", "--port", port, "--prewarm", prewarm,
            "--", "-p", question, "--output-format", "stream-json", "--verbose"]
    done = subprocess.run(argv, env=env, cwd=project, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().split("\n")[-1])
    assert result["type"] == "result" and result["is_error"] is False, result
    return result["usage"]


def read_share(usage: dict) -> float:
    total = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage.get("cache_creation_input_tokens", 0)
    return usage["cache_read_input_tokens"] / total if total else 0.0


@pytest.mark.needs("claude")
def test_launch_prewarms_claude_codes_prefix(demo_server, isolated_env):
    find_cli("claude")
    base, home, project = isolated_env
    env = {**base, "MLXHOST_AGENT_CLIS": str(agent_clis_prefix()), "CLAUDE_CONFIG_DIR": str(home / ".claude")}
    clear = lambda: httpx.delete(demo_server.url + "/v1/cache", timeout=60).raise_for_status()  # noqa: E731
    clear()
    first_turn(demo_server, env, project, "Say hello in one short sentence.", "wait")  # saves the prefix
    clear()
    cold = first_turn(demo_server, env, project, "Name a colour in one word.", "off")
    clear()
    warm = first_turn(demo_server, env, project, "Name a fruit in one word.", "wait")
    RESULTS.append(f"claude launch pre-warm: first turn of a new conversation {read_share(warm):.1%} read from the "
                   f"cache ({warm}); cold {read_share(cold):.1%} ({cold})")
    assert read_share(cold) < 0.1 and read_share(warm) >= MIN_READ, RESULTS[-1]
