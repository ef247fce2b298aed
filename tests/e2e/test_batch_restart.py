"""The Batch API against `mlxhost serve` in a subprocess (tiny model, 127.0.0.1), through the official `openai`
client: 200 chat requests uploaded and batched, the server killed mid-batch and started again on the same
folder; the batch completes with 200 results whose greedy texts equal the same requests sent live, and the lines
answered before the kill are not run again. Cancel ends a running batch. Time bounds only catch hangs."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.e2e.test_shutdown import free_port, wait_healthy

NUM_REQUESTS = 200
_BOUND_S = 600  # a hang bound for the whole batch on a slow shared machine, not a timing check


def serve(model_dir, port: int, batch_dir, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", "tiny", "--log-level", "info", "--batch-dir", str(batch_dir), "--no-web-ui"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def bodies(n: int) -> list[dict]:
    return [{"model": "tiny", "messages": [{"role": "user", "content": f"request {i}: " + "word " * (i % 7)}],
             "max_tokens": 6, "temperature": 0} for i in range(n)]


def upload(client: openai.OpenAI, items: list[dict]) -> str:
    text = "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": b}) + "\n" for i, b in enumerate(items))
    return client.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def wait_for(predicate, what: str):
    deadline = time.monotonic() + _BOUND_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_a_batch_survives_a_restart_and_matches_live_answers(qwen3_model_dir, tmp_path, procs):
    port, batch_dir = free_port(), tmp_path / "batches"
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "first.log", "w") as log:
        procs.append(serve(qwen3_model_dir, port, batch_dir, log))
    wait_healthy(procs[-1], url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    items = bodies(NUM_REQUESTS)
    batch = client.batches.create(input_file_id=upload(client, items), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, "no line answered")
    procs[-1].send_signal(signal.SIGKILL)  # no chance to tidy up: what is on disk is what a restart gets
    procs[-1].wait(timeout=30)

    with open(tmp_path / "second.log", "w") as log:
        procs.append(serve(qwen3_model_dir, port, batch_dir, log))
    wait_healthy(procs[-1], url)
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                    "the batch did not end")
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (200, 200, 0)
    assert done.error_file_id is None
    resumed = re.search(r"resumes: (\d+) of 200 lines answered before", (tmp_path / "second.log").read_text())
    assert resumed, "the restarted server did not resume the batch"
    answered_before = int(resumed.group(1))
    assert 10 <= answered_before < NUM_REQUESTS  # killed mid-batch
    batches = httpx.get(url + "/v1/status", timeout=30).json()["batches"]
    assert batches["num_lines_run"] == NUM_REQUESTS - answered_before  # answered lines were not run again

    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(NUM_REQUESTS))
    by_id = {o["custom_id"]: o["response"] for o in out}
    for i, body in enumerate(items):
        live = client.chat.completions.create(**body)
        response = by_id[f"req-{i}"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content, i


def test_cancel_ends_a_running_batch(qwen3_model_dir, tmp_path, procs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        procs.append(serve(qwen3_model_dir, port, tmp_path / "batches", log))
    wait_healthy(procs[-1], url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    items = [{**b, "max_tokens": 64, "ignore_eos": True} for b in bodies(100)]
    batch = client.batches.create(input_file_id=upload(client, items), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", "the batch did not start")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b,
                    "the batch was not cancelled")
    assert done.cancelled_at and done.request_counts.completed < 100
    assert done.request_counts.failed == 0
