"""A rank that dies or stops answering: clients get an error (503), the server exits, nothing hangs; a
rank that dies during start-up ends the start-up at once, naming it. Every wait is bounded; the exit
code says the supervisor, not a crash, ended the server."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from mlxhost.distributed.supervisor import FATAL_EXIT_CODE, STARTUP_EXIT_CODE
from tests.distributed.conftest import SERVED_NAME, spawn_dist_server, start_dist_server

_EXIT_BOUND_S = 60  # the server must be gone within this (it takes ~1-2 s; the bound only stops a hang)


def _stream_until_error(server, started: threading.Event, result: dict) -> None:
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=_EXIT_BOUND_S) as client:
            stream = client.completions.create(model=SERVED_NAME, prompt="once upon a time", max_tokens=100000,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                result.setdefault("tokens", 0)
                result["tokens"] += 1
                started.set()
        result["outcome"] = "finished without an error"
    except Exception as exc:  # the error event, or the connection closed by the exiting server
        result["outcome"] = exc
    finally:
        started.set()


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_lost_rank_ends_streams_and_the_server(qwen3_model_dir, tmp_path, fault):
    # "stop": SIGSTOP keeps the rank's connection open, so only the step timeout can notice it. A killed rank
    # is seen by its closed connection: its test keeps the timeout out of the way (a slow step before the kill
    # must not end the server first).
    timeout = "20" if fault == "stop" else "600"
    server = start_dist_server(qwen3_model_dir, tmp_path, "--tensor-parallel", "2", "--distributed-timeout", timeout,
                               "--max-model-len", "200000")
    (rank1,) = server.rank_pids()
    try:
        started, result = threading.Event(), {}
        client = threading.Thread(target=_stream_until_error, args=(server, started, result), daemon=True)
        client.start()
        assert started.wait(_EXIT_BOUND_S), server.log()
        assert result.get("tokens"), result
        os.kill(rank1, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        client.join(_EXIT_BOUND_S)
        assert not client.is_alive(), "the stream hung"
        outcome = result["outcome"]
        # The stream's last event is the error (the openai client raises it), not a cut connection.
        assert isinstance(outcome, openai.APIError), repr(outcome)
        assert "lost a rank" in str(outcome), repr(outcome)
        try:
            code = server.proc.wait(_EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit:\n" + server.log())
        assert code == FATAL_EXIT_CODE, server.log()
        assert "distributed serving cannot go on" in server.log()
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        if fault == "stop":
            try:
                os.kill(rank1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()


def test_a_rank_dying_during_warm_up_fails_the_start_up_at_once(qwen3_model_dir, tmp_path):
    # Warm-up steps run on every rank (rank 0 sends them as plans): rank 1 killed in the middle of it. 256
    # sequences make the warm-up long enough that the kill lands inside it on a fast machine too.
    server = spawn_dist_server(qwen3_model_dir, tmp_path, "--tensor-parallel", "2", "--warmup", "on",
                               "--max-num-seqs", "256", "--distributed-timeout", "600")
    try:
        deadline = time.monotonic() + 150  # start-up bound on a shared CPU, not a timing check
        while "warm-up over 2 ranks starts" not in server.log():
            assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.02)
        (rank1,) = server.rank_pids()
        os.kill(rank1, signal.SIGKILL)
        try:  # far inside the 600-s step timeout: the dead rank itself was seen (it takes ~1 s)
            code = server.proc.wait(_EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the start-up did not end:\n" + server.log())
        assert code == STARTUP_EXIT_CODE, server.log()
        assert "start-up failed: rank 1" in server.log(), server.log()
    finally:
        server.stop()
