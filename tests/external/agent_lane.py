"""Helpers of the external lane: the pinned CLIs, the demo server with an access log, one agent turn measured."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from mlxhost.testing.needs import find, need

CLIENTS_FILE = pathlib.Path(__file__).with_name("clients.txt")
# Answers are cut at this many tokens by the server when a client names no limit (Codex, aider, llm), and by
# the agent's own setting where it has one: a random model's answer is noise, the test is about the protocol.
MAX_OUTPUT_TOKENS = 32
TURN_TIMEOUT_S = float(os.environ.get("MLXHOST_EXTERNAL_TURN_TIMEOUT", "900"))
RESULTS: list[str] = []  # one line per client, printed at the end of the run (conftest.py)
_METRIC = re.compile(r"^(mlxhost_(?:prefix_cache_queried|prefix_cache_hit|completion)_tokens_total)\s+(\S+)$",
                     re.M)


def pinned_clients() -> dict[str, tuple[str, str, str]]:
    """{command: (registry, package, version)} from clients.txt."""
    out = {}
    for line in CLIENTS_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            registry, package, version, command = line.split()
            out[command] = (registry, package, version)
    return out


def find_cli(command: str) -> str:
    """The pinned install first, then PATH (mlxhost.testing.needs); skips (fails under CI) when neither has it."""
    return need(command)


# uvicorn's access log line: 127.0.0.1:5000 - "POST /v1/messages?beta=true HTTP/1.1" 200 OK
_ACCESS = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


@dataclass
class DemoServer:
    """`mlxhost serve` with no model (the demo model, its real context) as a process of its own."""

    url: str
    model: str
    context_tokens: int
    log_path: pathlib.Path
    process: subprocess.Popen = field(repr=False)

    def token_counters(self) -> tuple[float, float, float]:
        """(prompt tokens looked up in the prefix cache, tokens found there, tokens generated) so far."""
        found = dict(_METRIC.findall(httpx.get(self.url + "/metrics", timeout=30).text))
        return (float(found["mlxhost_prefix_cache_queried_tokens_total"]),
                float(found["mlxhost_prefix_cache_hit_tokens_total"]),
                float(found["mlxhost_completion_tokens_total"]))

    def access_log(self) -> list[tuple[str, str, int]]:
        """(method, path, status) of every request answered so far."""
        text = self.log_path.read_text(errors="replace")
        return [(m, p, int(s)) for m, p, s in _ACCESS.findall(text)]

    def errors_since(self, start: int) -> Counter:
        return Counter(f"{m} {p} {s}" for m, p, s in self.access_log()[start:] if s >= 400)


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo_server(log_path: pathlib.Path, default_max_tokens: int = MAX_OUTPUT_TOKENS,
                      timeout_s: float = 600, extra_args: tuple[str, ...] = ()) -> DemoServer:
    import sys

    port = _free_port()
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--default-max-tokens", str(default_max_tokens), "--no-web-ui", *extra_args]
    return _serve(cmd, port, log_path, timeout_s)


def start_held_server(log_path: pathlib.Path, hold_file: pathlib.Path, default_max_tokens: int = MAX_OUTPUT_TOKENS,
                      end_chance: float = 0.0, max_hold_s: float = 120, timeout_s: float = 600) -> DemoServer:
    """The demo model served by mlxhost.testing.held_step: its forward waits while `hold_file` exists, and each
    token ends the answer with `end_chance` (at temperature 1)."""
    import sys

    from mlxhost.testing.demo import ensure_demo_model

    port = _free_port()
    cmd = [sys.executable, "-m", "mlxhost.testing.held_step", str(ensure_demo_model()), "--port", str(port),
           "--hold-file", str(hold_file), "--default-max-tokens", str(default_max_tokens), "--log-level", "info",
           "--end-chance", str(end_chance), "--max-hold", str(max_hold_s)]
    return _serve(cmd, port, log_path, timeout_s)


def _serve(cmd: list[str], port: int, log_path: pathlib.Path, timeout_s: float) -> DemoServer:
    env = dict(os.environ)
    # MLX's CPU wheel multiplies matrices with a slow reference BLAS; Debian's OpenBLAS, preloaded, makes the
    # demo model's long agent prompts prefill about 3x faster here. Taken when present, never needed.
    openblas = find("openblas")
    if openblas and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = openblas
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the demo server exited with {process.returncode}: {log_path.read_text()[-3000:]}")
        try:
            card = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]
            return DemoServer(url, card["id"], card["max_model_len"], log_path, process)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the demo server did not start") from None
            time.sleep(0.5)


@dataclass
class Turn:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    errors: Counter  # "METHOD PATH STATUS" of every 4xx/5xx answered during the turn
    queried_tokens: float  # prompt tokens looked up in the prefix cache during the turn
    hit_tokens: float
    completion_tokens: float  # tokens the model generated during the turn

    @property
    def reuse(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def describe(self) -> str:
        return (f"exit {self.returncode}, {sum(self.errors.values())} 4xx/5xx {dict(self.errors)}, "
                f"{self.hit_tokens:.0f}/{self.queried_tokens:.0f} prompt tokens cached ({self.reuse:.1%}), "
                f"{self.completion_tokens:.0f} generated, {self.seconds:.0f} s")


def run_turn(server: DemoServer, argv: list[str], env: dict[str, str], cwd: pathlib.Path) -> Turn:
    start = len(server.access_log())
    queried0, hit0, generated0 = server.token_counters()
    began = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=TURN_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{argv[0]} did not finish within {TURN_TIMEOUT_S:.0f} s; stderr: {(e.stderr or '')[-2000:]}")
    seconds = time.monotonic() - began
    queried1, hit1, generated1 = server.token_counters()
    return Turn(done.returncode, done.stdout, done.stderr, seconds, server.errors_since(start),
                queried1 - queried0, hit1 - hit0, generated1 - generated0)


def stop_demo_server(server: DemoServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()


def isolated_env(root: pathlib.Path) -> tuple[dict, pathlib.Path, pathlib.Path]:
    """A home of its own under `root` for an agent (its config, sessions and history live there), and a project
    folder: (environment, home, project). The caller's API keys and base URLs are left out."""
    home, project = root / "home", root / "project"
    for path in (home / ".config", home / ".local" / "share", home / ".cache", home / ".local" / "state", project):
        path.mkdir(parents=True)
    (project / "README.md").write_text("# scratch\n\nA scratch project for an agent test.\n")
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_CACHE_HOME": str(home / ".cache"),
           "XDG_STATE_HOME": str(home / ".local" / "state"), "NO_COLOR": "1"}
    for name in ("MLXHOST_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        env.pop(name, None)
    return env, home, project
