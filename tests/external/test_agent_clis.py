"""Each real agent CLI, headless, two turns against the served demo model: both turns exit 0, the server answers
no request with a 4xx/5xx, and turn 2 finds at least 80% of its prompt (less turn 1's answer) in the prefix
cache. The model has random weights: answers are noise, and the agents must still complete. Claude Code, Codex,
opencode and Qwen Code get exactly what `mlxhost launch` gives them (mlxhost/agents/)."""

from __future__ import annotations

import json
import pathlib

import pytest
from agent_lane import MAX_OUTPUT_TOKENS, RESULTS, DemoServer, Turn, find_cli, pinned_clients, run_turn

from mlxhost.agents import AGENTS, Target
from mlxhost.agents.base import default_max_output_tokens

# Each test also marks its CLI (`needs`): a missing one skips before the demo server starts.
pytestmark = pytest.mark.external

FIRST = "Say hello in one short sentence."
SECOND = "Now say goodbye in one short sentence."
API_KEY = "mlxhost-external"
MIN_REUSE = 0.8


def conventions(n: int) -> str:
    """House rules of the kind people give agents: long enough to fill prefix blocks (128 tokens)."""
    return "\n".join(f"- Rule {i}: answer in one short sentence, plainly, and never use lists or headings."
                     for i in range(n))


def _target(server: DemoServer, max_output_tokens: int) -> Target:
    return Target(url=server.url, model=server.model, api_key=API_KEY, context_tokens=server.context_tokens,
                  max_output_tokens=max_output_tokens)


def _two_turns(server: DemoServer, name: str, first: list[str], second: list[str], env: dict, cwd: pathlib.Path):
    turns: list[Turn] = []
    for argv in (first, second):
        turn = run_turn(server, argv, env, cwd)
        turns.append(turn)
        detail = f"{name} turn {len(turns)}: {turn.describe()}"
        assert turn.returncode == 0, f"{detail}\nstdout: {turn.stdout[-3000:]}\nstderr: {turn.stderr[-3000:]}"
        assert not turn.errors, detail
    # A random model's answer decodes to text that tokenizes to other ids than the ones generated, so turn 2
    # cannot find turn 1's answer in the cache (a real model's answer mostly re-tokenizes the same). Claude Code
    # and Codex answers run to the end-of-text token, thousands of tokens at times: the bar is on the rest.
    rest = turns[1].queried_tokens - turns[0].completion_tokens
    reuse = turns[1].hit_tokens / rest if rest > 0 else 0.0
    RESULTS.append(f"{name} {pinned_clients()[name][2]}: turn 1 {turns[0].describe()}; turn 2 {turns[1].describe()}"
                   f"; turn 2 without turn 1's answer {reuse:.1%} cached")
    assert reuse >= MIN_REUSE, RESULTS[-1]
    return turns


def _launch_env(server: DemoServer, agent: str, base_env: dict, folder: pathlib.Path,
                max_output_tokens: int = MAX_OUTPUT_TOKENS):
    setup = AGENTS[agent].configure(_target(server, max_output_tokens), folder)
    return {**base_env, **setup.env}, list(setup.args)


@pytest.mark.needs("claude")
def test_claude_code(demo_server, isolated_env):
    claude = find_cli("claude")
    base, home, project = isolated_env
    # Claude Code (2.1.197, 2.1.332) fails a run whose answer stops at max_tokens ("Claude's response exceeded the N output
    # token maximum", after three tries to continue it): it gets launch's own limit, and the random model's
    # answers end at its end-of-text token (~3k tokens on average).
    limit = default_max_output_tokens(demo_server.context_tokens)
    env, args = _launch_env(demo_server, "claude", base, home / ".claude", limit)
    env["CLAUDE_CONFIG_DIR"] = str(home / ".claude")  # sessions for --continue, no user settings
    out = ["--output-format", "stream-json", "--verbose"]
    turns = _two_turns(demo_server, "claude", [claude, *args, "-p", FIRST, *out],
                       [claude, *args, "-p", SECOND, "--continue", *out], env, project)
    for turn in turns:  # the last event says how the run ended
        # One event a line, split on "\n" only: str.splitlines() also splits at U+2028, \x85, ... which a JSON
        # string may hold unescaped (the random model writes them).
        result = json.loads(turn.stdout.strip().split("\n")[-1])
        assert result["type"] == "result" and result["is_error"] is False, result


@pytest.mark.needs("codex")
def test_codex(long_answer_server, isolated_env):
    codex = find_cli("codex")
    base, home, project = isolated_env
    env, args = _launch_env(long_answer_server, "codex", base, home / "codex")
    # --strict-config: launch's config.toml has no field this Codex does not know.
    run = [codex, *args, "exec", "--strict-config", "--skip-git-repo-check"]
    _two_turns(long_answer_server, "codex", [*run, FIRST], [*run, "resume", "--last", SECOND], env, project)


@pytest.mark.needs("opencode")
def test_opencode(demo_server, isolated_env):
    opencode = find_cli("opencode")
    base, home, project = isolated_env
    env, args = _launch_env(demo_server, "opencode", base, home / "opencode")
    _two_turns(demo_server, "opencode", [opencode, *args, "run", FIRST], [opencode, *args, "run", "--continue", SECOND],
               env, project)


@pytest.mark.needs("qwen")
def test_qwen_code(demo_server, isolated_env):
    qwen = find_cli("qwen")
    base, home, project = isolated_env
    env, args = _launch_env(demo_server, "qwen", base, home / "qwen")
    _two_turns(demo_server, "qwen", [qwen, *args, "-p", FIRST], [qwen, *args, "--continue", "-p", SECOND], env,
               project)


@pytest.mark.needs("aider")
def test_aider(demo_server, isolated_env):
    aider = find_cli("aider")
    base, home, project = isolated_env
    model = f"openai/{demo_server.model}"
    metadata = home / "model-metadata.json"  # the real context; aider knows only hosted models'
    metadata.write_text(json.dumps({model: {
        "max_input_tokens": demo_server.context_tokens, "max_output_tokens": MAX_OUTPUT_TOKENS,
        "litellm_provider": "openai", "mode": "chat", "input_cost_per_token": 0, "output_cost_per_token": 0}}))
    # LiteLLM would download its model price list at import.
    env = {**base, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    # Aider puts the history of turn 1 after its examples and before the file messages and its reminder, so
    # an empty project reuses only ~50% of turn 2's ~1,200 tokens; a conventions file (read-only files come
    # before the history), as real projects have, is the shared part it would be.
    (project / "CONVENTIONS.md").write_text(conventions(150) + "\n")
    run = [aider, "--model", model, "--read", "CONVENTIONS.md", "--openai-api-base", demo_server.url + "/v1", "--openai-api-key", API_KEY,
           "--model-metadata-file", str(metadata), "--no-git", "--yes-always", "--no-show-model-warnings",
           "--analytics-disable", "--no-check-update", "--no-pretty", "--no-fancy-input"]
    _two_turns(demo_server, "aider", [*run, "--message", FIRST],
               [*run, "--restore-chat-history", "--message", SECOND], env, project)




@pytest.mark.needs("llm")
def test_llm(demo_server, isolated_env):
    llm = find_cli("llm")
    base, home, project = isolated_env
    user_path = home / "llm"
    user_path.mkdir()
    (user_path / "extra-openai-models.yaml").write_text(
        f"- model_id: mlxhost\n  model_name: {json.dumps(demo_server.model)}\n"
        f"  api_base: {json.dumps(demo_server.url + '/v1')}\n  api_key_name: mlxhost\n")
    (user_path / "keys.json").write_text(json.dumps({"mlxhost": API_KEY}))
    env = {**base, "LLM_USER_PATH": str(user_path)}
    limit = ["-o", "max_tokens", str(MAX_OUTPUT_TOKENS)]
    # llm sends no system prompt of its own: without one, the turns are shorter than a prefix block.
    _two_turns(demo_server, "llm", [llm, "-m", "mlxhost", "-s", conventions(60), *limit, FIRST],
               [llm, "-c", *limit, SECOND], env, project)
