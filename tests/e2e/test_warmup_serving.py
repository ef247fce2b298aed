"""`--warmup background` end to end: the server starts with the warm-up still to run, answers, and serves."""

from __future__ import annotations

import signal

import httpx

from tests.e2e.test_shutdown import free_port, serve, wait_healthy


def test_a_server_warming_in_the_background_answers_and_serves(qwen3_model_dir):
    port = free_port()
    proc = serve(qwen3_model_dir, port, "--warmup", "background", "--max-num-seqs", "8", "--log-level", "info")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "ignore_eos": True}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "warm-up runs while serving" in out, out[-2000:]
