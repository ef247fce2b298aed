"""Each real agent CLI survives a first turn held in prefill past its stream-idle timeout: the server's first
forward waits (mlxhost.testing.held_step) while the stream sends its dialect's keep-alive events
(frontends/common/stream.py), then the turn ends with exit 0, no retry or timeout in the CLI's output, and the
turn's requests in the server's access log as many as without a hold (one; opencode and Qwen Code send one more
of their own), all answered 200.

Each client gets a server of its own (requests are told apart by server, not by path) and all run at once, so
the file takes Claude Code's hold plus its turn (~7 min on a busy 2-core CPU). Each client's idle timeout, from
its source at the pinned version:

- Claude Code: its stream watchdog, `CLAUDE_STREAM_IDLE_TIMEOUT_MS`, is taken as at least 300 s whatever is set,
  so its first forward is held past that. `CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS` (bytes; 10 s at least) is
  lowered too; on giving up, Claude Code asks again without streaming, which the request count shows.
- Codex: `stream_idle_timeout_ms` of its model provider in config.toml (default 300 s), between SSE events.
- opencode: the provider option `chunkTimeout` (ms, default 300 s), between body chunks.
- Qwen Code: `QWEN_STREAM_IDLE_TIMEOUT_MS` (default 240 s), between parsed chunks (SSE comments do not count).
- aider: `--timeout` (seconds, default 600), LiteLLM's request timeout, which httpx applies to each read.
- llm: no setting: the openai client's 600 s read timeout. Held as long as the others; the file cannot wait 600 s.

A whole (non-streamed) reply sends nothing until it is done (a status code goes with the first byte), so a
client's read timeout must outlast the prefill: aider and llm whole turns keep their default 600 s and are held
as long as the streamed ones, which shows that nothing on the server's side ends or repeats a waiting request.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import pytest
from agent_lane import (
    MAX_OUTPUT_TOKENS,
    RESULTS,
    TURN_TIMEOUT_S,
    DemoServer,
    find_cli,
    isolated_env,
    start_held_server,
    stop_demo_server,
)

from mlxhost.agents import AGENTS, Target
from mlxhost.agents.base import default_max_output_tokens
from mlxhost.testing.needs import find

pytestmark = pytest.mark.external

IDLE_TIMEOUT_S = 15  # each client's stream-idle timeout, where it can be lowered
HOLD_S = 2 * IDLE_TIMEOUT_S  # the first forward waits this long once it started
CLAUDE_EVENT_IDLE_S = 300  # Claude Code's event watchdog, which no setting lowers
QUESTION = "Say hello in one short sentence."
API_KEY = "mlxhost-external"
# What a client prints when it retried a request or gave up waiting; the answers are too short to hold it.
RETRY_OR_TIMEOUT = re.compile(r"retr(y|ying|ied|ies)\b|reconnecting|timed? ?out|timeout", re.I)


@dataclass
class Setup:
    argv: list[str]
    env: dict[str, str]


@dataclass
class Case:
    name: str
    command: str  # the CLI (mlxhost.testing.needs)
    path: str  # the turn's endpoint
    knob: str  # the idle timeout as set here, for the summary
    build: Callable[[DemoServer, dict, pathlib.Path, pathlib.Path], Setup]
    default_max_tokens: int = MAX_OUTPUT_TOKENS
    hold_s: float = HOLD_S
    end_chance: float = 0.0  # held_step's: answers that no limit cuts end after ~1 / end_chance tokens
    # Requests answered (their stream started) when the hold ends: the held turn's, and opencode's session title,
    # which it asks for at once. A client that timed out and asked again would show one more.
    started_when_released: int = 1
    # The turn's requests in all: opencode's title, and a second request Qwen Code sends once the answer came.
    # Claude Code that gave up on its stream asks again without streaming: one more, answered whole.
    num_requests: int = 1


def _launch(server: DemoServer, agent: str, base: dict, folder: pathlib.Path, max_output_tokens: int):
    target = Target(url=server.url, model=server.model, api_key=API_KEY, context_tokens=server.context_tokens,
                    max_output_tokens=max_output_tokens)
    setup = AGENTS[agent].configure(target, folder)
    return {**base, **setup.env}, list(setup.args)


def claude(server, base, home, project) -> Setup:
    # Claude Code fails an answer cut at max_tokens: launch's own limit (test_agent_clis.py says why).
    env, args = _launch(server, "claude", base, home / ".claude", default_max_output_tokens(server.context_tokens))
    env.update(CLAUDE_CONFIG_DIR=str(home / ".claude"), CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS=str(IDLE_TIMEOUT_S * 1000))
    return Setup([find_cli("claude"), *args, "-p", QUESTION, "--output-format", "stream-json", "--verbose"], env)


def codex(server, base, home, project) -> Setup:
    env, args = _launch(server, "codex", base, home / "codex", MAX_OUTPUT_TOKENS)
    with open(home / "codex" / "config.toml", "a") as f:  # its last table is the provider's
        f.write(f"stream_idle_timeout_ms = {IDLE_TIMEOUT_S * 1000}\n")
    return Setup([find_cli("codex"), *args, "exec", "--strict-config", "--skip-git-repo-check", QUESTION], env)


def opencode(server, base, home, project) -> Setup:
    env, args = _launch(server, "opencode", base, home / "opencode", MAX_OUTPUT_TOKENS)
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    config["provider"]["mlxhost"]["options"]["chunkTimeout"] = IDLE_TIMEOUT_S * 1000
    env["OPENCODE_CONFIG_CONTENT"] = json.dumps(config)
    return Setup([find_cli("opencode"), *args, "run", QUESTION], env)


def qwen(server, base, home, project) -> Setup:
    env, args = _launch(server, "qwen", base, home / "qwen", MAX_OUTPUT_TOKENS)
    env["QWEN_STREAM_IDLE_TIMEOUT_MS"] = str(IDLE_TIMEOUT_S * 1000)
    return Setup([find_cli("qwen"), *args, "-p", QUESTION], env)


def aider(stream: bool) -> Callable[..., Setup]:
    def build(server, base, home, project) -> Setup:
        model = f"openai/{server.model}"
        metadata = home / "model-metadata.json"  # the real context; aider knows only hosted models'
        metadata.write_text(json.dumps({model: {
            "max_input_tokens": server.context_tokens, "max_output_tokens": MAX_OUTPUT_TOKENS,
            "litellm_provider": "openai", "mode": "chat", "input_cost_per_token": 0, "output_cost_per_token": 0}}))
        mode = ["--timeout", str(IDLE_TIMEOUT_S)] if stream else ["--no-stream"]
        argv = [find_cli("aider"), "--model", model, "--openai-api-base", server.url + "/v1", "--openai-api-key",
                API_KEY, "--model-metadata-file", str(metadata), "--no-git", "--yes-always",
                "--no-show-model-warnings", "--analytics-disable", "--no-check-update", "--no-pretty",
                "--no-fancy-input", *mode, "--message", QUESTION]
        # LiteLLM would download its model price list at import.
        return Setup(argv, {**base, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    return build


def llm(stream: bool) -> Callable[..., Setup]:
    def build(server, base, home, project) -> Setup:
        user_path = home / "llm"
        user_path.mkdir()
        (user_path / "extra-openai-models.yaml").write_text(
            f"- model_id: mlxhost\n  model_name: {json.dumps(server.model)}\n"
            f"  api_base: {json.dumps(server.url + '/v1')}\n  api_key_name: mlxhost\n")
        (user_path / "keys.json").write_text(json.dumps({"mlxhost": API_KEY}))
        mode = [] if stream else ["--no-stream"]
        argv = [find_cli("llm"), "-m", "mlxhost", "-o", "max_tokens", str(MAX_OUTPUT_TOKENS), *mode, QUESTION]
        return Setup(argv, {**base, "LLM_USER_PATH": str(user_path)})
    return build


CASES = [
    # Claude Code and Codex fail an answer cut short, so theirs run to the end-of-text token, which the held
    # model makes come sooner than the random model's thousands of tokens.
    Case("claude", "claude", "/v1/messages", f"CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS={IDLE_TIMEOUT_S}000", claude,
         hold_s=CLAUDE_EVENT_IDLE_S + 15, end_chance=0.02),
    Case("codex", "codex", "/v1/responses", f"stream_idle_timeout_ms = {IDLE_TIMEOUT_S}000", codex,
         default_max_tokens=32_000, end_chance=0.02),
    Case("opencode", "opencode", "/v1/chat/completions", f"chunkTimeout: {IDLE_TIMEOUT_S}000", opencode,
         started_when_released=2, num_requests=2),
    Case("qwen", "qwen", "/v1/chat/completions", f"QWEN_STREAM_IDLE_TIMEOUT_MS={IDLE_TIMEOUT_S}000", qwen,
         num_requests=2),
    Case("aider", "aider", "/v1/chat/completions", f"--timeout {IDLE_TIMEOUT_S}", aider(stream=True)),
    # A whole reply's status line goes out with its body: none has started when the hold ends.
    Case("aider-whole", "aider", "/v1/chat/completions", "--no-stream, 600 s read timeout", aider(stream=False),
         started_when_released=0),
    Case("llm", "llm", "/v1/chat/completions", "none: 600 s read timeout", llm(stream=True)),
    Case("llm-whole", "llm", "/v1/chat/completions", "--no-stream, 600 s read timeout", llm(stream=False),
         started_when_released=0),
]


@dataclass
class HeldTurn:
    returncode: int
    output: str  # stdout and stderr
    requests: list[tuple[str, str, int]]  # the server's access log: (method, path, status)
    started_when_released: list[tuple[str, str, int]]  # its lines when the hold ended
    held_s: float  # how long the first forward waited, for the summary
    outlasted: bool  # the client was still waiting when the hold ended (not ended before it)


@pytest.fixture(scope="module")
def held_turns(tmp_path_factory) -> dict[str, HeldTurn]:
    """Every installed client's first turn, all at once, each on its own server whose first forward is held
    its case's hold_s seconds."""
    cases = [c for c in CASES if find(c.command)]
    case_by_name = {c.name: c for c in cases}
    servers, procs, holds, held_since, outlasted, released, turns = {}, {}, {}, {}, {}, {}, {}
    try:
        for case in cases:
            holds[case.name] = tmp_path_factory.mktemp(case.name) / "hold"
        with ThreadPoolExecutor(len(cases)) as pool:  # the servers start side by side
            started = {c.name: pool.submit(start_held_server, holds[c.name].with_name("serve.log"), holds[c.name],
                                           c.default_max_tokens, c.end_chance, c.hold_s + 60) for c in cases}
            for name, future in started.items():
                servers[name] = future.result()
        for case in cases:
            root = holds[case.name].parent
            base, home, project = isolated_env(root)
            setup = case.build(servers[case.name], base, home, project)
            holds[case.name].touch()
            log = open(root / "cli.log", "w+")
            procs[case.name] = (subprocess.Popen(setup.argv, env=setup.env, cwd=project, stdin=subprocess.DEVNULL,
                                                 stdout=log, stderr=subprocess.STDOUT, text=True), log)
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while holds and time.monotonic() < deadline:
            for name, hold in list(holds.items()):
                if name not in held_since and hold.with_name("hold.held").exists():
                    held_since[name] = time.monotonic()
                if name in held_since and time.monotonic() - held_since[name] >= case_by_name[name].hold_s:
                    outlasted[name] = procs[name][0].poll() is None
                    released[name] = servers[name].access_log()
                    hold.unlink()
                    held_since[name] = time.monotonic() - held_since[name]
                    del holds[name]
                elif procs[name][0].poll() is not None:  # ended before its hold did: the test says how
                    hold.unlink()
                    held_since[name] = time.monotonic() - held_since.get(name, time.monotonic())
                    del holds[name]
            time.sleep(0.2)
        for name, (proc, log) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.seek(0)
            turns[name] = HeldTurn(proc.returncode, log.read(), servers[name].access_log(), released.get(name, []),
                                   held_since.get(name, 0.0), outlasted.get(name, False))
            log.close()
        yield turns
    finally:
        for hold in holds.values():
            hold.unlink(missing_ok=True)
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
        for server in servers.values():
            stop_demo_server(server)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_first_turn_held_past_idle_timeout(case, held_turns):
    find_cli(case.command)  # skips (fails under CI) when the client is missing
    turn = held_turns[case.name]

    def posts(log):
        return [status for method, path, status in log if method == "POST" and path.split("?")[0] == case.path]

    RESULTS.append(f"{case.name} ({case.knob}): first forward held {turn.held_s:.0f} s, exit {turn.returncode}, "
                   f"{len(posts(turn.started_when_released))} {case.path} started when released, "
                   f"{posts(turn.requests)} in all")
    detail = f"{RESULTS[-1]}\n{turn.requests}\n{turn.output[-3000:]}"
    assert turn.returncode == 0, detail
    assert turn.outlasted, detail  # its first forward was held, and the client still waited when it ended
    assert not RETRY_OR_TIMEOUT.search(turn.output), detail
    assert len(posts(turn.started_when_released)) == case.started_when_released, detail
    assert posts(turn.requests) == [200] * case.num_requests, detail
    assert all(status < 400 for *_, status in turn.requests), detail
