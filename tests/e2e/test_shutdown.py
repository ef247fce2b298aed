"""The serving process (`mlxhost serve` in a subprocess, tiny model, 127.0.0.1): SIGTERM under 32
long streams ends them at the shutdown deadline (each gets an error event, none runs to its end) and the
SSD tier's queued blocks are on disk; SIGTERM during start-up exits; a port in use is reported before the
model loads. The time bounds here only catch hangs: a slow machine must not fail these tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

SHUTDOWN_TIMEOUT_S = 3
NUM_STREAMS = 32
_START_TIMEOUT_S = 120  # bounds for loops, not timing checks
_EXIT_BOUND_S = 45  # a hang bound, well under the 60 s deadline of the second-signal test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model_dir, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "tiny", "--log-level", "warning", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start")


def read_stream(url: str, events: list, index: int, started: threading.Event | None = None) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {index} " + "long " * 60}],
            "max_tokens": 3000, "ignore_eos": True, "stream": True}
    got = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                    if started is not None:
                        started.set()
    except httpx.HTTPError as exc:
        got.append({"transport_error": repr(exc)})
    events[index] = got


@pytest.fixture
def stopper():
    procs: list[subprocess.Popen] = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_sigterm_under_32_streams_ends_by_the_deadline(qwen3_model_dir, tmp_path, stopper):
    port, ssd = free_port(), tmp_path / "ssd"
    proc = serve(qwen3_model_dir, port, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--ssd-cache-dir", str(ssd),
                 "--block-size", "16", "--max-num-seqs", str(NUM_STREAMS), "--max-model-len", "4096")
    stopper(proc)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    events: list = [None] * NUM_STREAMS
    threads = [threading.Thread(target=read_stream, args=(url, events, i)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:  # every stream is producing tokens
        text = httpx.get(url + "/metrics", timeout=10).text
        if f"mlxhost_num_requests_running {NUM_STREAMS}.0" in text:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=_EXIT_BOUND_S)  # 3000 tokens in each of 32 streams would take far longer
    for t in threads:
        t.join(timeout=30)
    assert proc.returncode == 0, proc.stdout.read()
    for got in events:
        assert got and any(e.get("choices") for e in got), got[:3]  # tokens came before the signal
        assert got[-1].get("error", {}).get("code") == "server_shutting_down", got[-2:]
        assert got[-2]["choices"][0]["finish_reason"] == "abort"
    blocks = list(ssd.rglob("*.safetensors"))
    assert blocks, "the SSD tier's queued blocks were not written at shutdown"


def test_sigterm_during_start_up_exits_in_seconds(qwen3_model_dir, stopper):
    # A slow start-up on purpose: many sequences to warm up, so the signal lands while the app starts.
    proc = serve(qwen3_model_dir, free_port(), "--warmup", "on", "--max-num-seqs", "256", "--log-level", "info")
    stopper(proc)
    lines = []
    for line in proc.stdout:  # the engine is starting: uvicorn's handlers are installed, the loop waits
        lines.append(line)
        if "Waiting for application startup" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=_EXIT_BOUND_S)
    assert proc.returncode == -signal.SIGTERM, "".join(lines) + out
    assert "Application startup complete" not in out


def test_port_in_use_is_reported_before_loading(qwen3_model_dir, stopper, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A folder that passes the start-up check (it has a config.json) but has no weights: loading would fail
        # with another message, so only a port checked before loading gives this one.
        unloadable = Path(tmp_path) / "no-weights-here"
        unloadable.mkdir()
        (unloadable / "config.json").write_text('{"model_type": "qwen3"}')
        proc = serve(unloadable, port)
        stopper(proc)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in out and "no-weights-here" not in out


@pytest.mark.skipif(not hasattr(os, "getpgid"), reason="POSIX signals")
def test_second_signal_ends_at_once(qwen3_model_dir, tmp_path, stopper):
    port = free_port()
    proc = serve(qwen3_model_dir, port, "--shutdown-timeout", "60", "--ssd-cache-dir", str(tmp_path / "ssd"))
    stopper(proc)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url)
    events: list = [None]
    started = threading.Event()
    reader = threading.Thread(target=read_stream, args=(url, events, 0, started))
    reader.start()
    assert started.wait(_START_TIMEOUT_S)  # the stream is producing tokens
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=_EXIT_BOUND_S)  # not the 60 s deadline
    reader.join(timeout=30)
    assert events[0] and events[0][-1].get("error", {}).get("code") == "server_shutting_down", events[0][-2:]
