"""One long engine step must not hold the server: a real server in a subprocess whose model's
forward waits while a file exists (mlxhost.testing.held_step), so one step lasts as long as the test wants.

While the step is held, /v1/status, /v1/cache/stats, /metrics and /v1/models answer from the engine's last
snapshot; the issue's acceptance bounds /v1/status at 1 s. SIGINT or SIGTERM then ends the process by the
announced shutdown deadline plus a small margin, though the step never ends: the held request's stream ends
with an error event, one log line names it, and no traceback is printed. Other bounds here only catch hangs.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.e2e.test_shutdown import free_port, wait_healthy

SHUTDOWN_TIMEOUT_S = 3.0
_READ_BOUND_S = 1.0  # the acceptance: status answers within a second while a step runs
_EXIT_MARGIN_S = 5.0  # past the announced deadline: the step's grace (1 s), log flush and process teardown
_BOUND_S = 60  # hang bounds for loops, not timing checks


def read_stream(url: str, events: list) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=_BOUND_S) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as exc:
        events.append({"transport_error": repr(exc)})


@pytest.fixture
def held_server(qwen3_model_dir, tmp_path):
    """(url, process, hold file): the server up, its model's forward not yet held."""
    port, hold = free_port(), tmp_path / "hold"
    cmd = [sys.executable, "-m", "mlxhost.testing.held_step", str(qwen3_model_dir), "--port", str(port),
           "--hold-file", str(hold), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url, proc, hold
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def hold_a_step(url: str, hold) -> tuple[list, threading.Thread]:
    """Starts a streamed request whose first forward waits; returns once the engine is inside it."""
    hold.touch()
    events: list = []
    reader = threading.Thread(target=read_stream, args=(url, events))
    reader.start()
    held = hold.with_name(hold.name + ".held")
    deadline = time.monotonic() + _BOUND_S
    while not held.exists():
        assert time.monotonic() < deadline, "the request's forward never started"
        time.sleep(0.05)
    return events, reader


def timed_get(url: str) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    r = httpx.get(url, timeout=_BOUND_S)
    return time.monotonic() - started, r


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_held_step_holds_neither_reads_nor_the_shutdown(held_server, sig):
    url, proc, hold = held_server
    idle = httpx.get(url + "/v1/status", timeout=_BOUND_S).json()
    events, reader = hold_a_step(url, hold)

    elapsed, r = timed_get(url + "/v1/status")
    assert r.status_code == 200 and elapsed < _READ_BOUND_S, (elapsed, r.text)
    assert r.json().keys() == idle.keys()  # the same shape as ever, from the last snapshot
    for path in ("/v1/cache/stats", "/metrics", "/v1/models"):  # hang bounds only
        elapsed, r = timed_get(url + path)
        assert r.status_code == 200, (path, r.text)

    signalled = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=_BOUND_S)
    took = time.monotonic() - signalled
    reader.join(timeout=_BOUND_S)
    assert hold.exists()  # the step was still held when the process ended
    assert took < SHUTDOWN_TIMEOUT_S + _EXIT_MARGIN_S, (took, out)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    ended = [line for line in out.splitlines() if "ended: the server is shutting down" in line]
    assert len(ended) == 1, out  # one line per aborted request
    assert "still inside a step" in out, out
    assert events and events[-1].get("error", {}).get("code") == "server_shutting_down", events[-2:]
