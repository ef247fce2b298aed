"""The Files and Batch APIs through the official `openai` client over the real app and a fake model: upload, list,
retrieve, content, delete; a batch over chat, completions and responses lines run through the server's own routes
in the lowest scheduling class; refusals in OpenAI's error shape; progress in /v1/status. With API keys: each key
sees only its own files and batches, and a batch's lines run under its creator's key (models, limits, cache group,
tokens counted)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient

from mlxhost.batch.store import BatchStore
from mlxhost.config import SecurityConfig
from mlxhost.frontends.app import create_app
from mlxhost.frontends.batch.dispatch import BATCH_PRIORITY
from mlxhost.frontends.batch.routes import install_batch_api
from mlxhost.frontends.common.security import install_security
from tests.frontends.fake_models import NAME, REPLY, FakeModels

_BOUND_S = 30  # a hang bound, not a timing check


class Models(FakeModels):
    def close(self, *_) -> None:  # the app's lifespan passes the shutdown deadline
        pass

    @contextlib.contextmanager
    def hold(self, name: str):  # /v1/status reads the engine's snapshot
        yield SimpleNamespace(snapshot=SimpleNamespace(status={"model": NAME}))


@pytest.fixture
def served(tmp_path):
    models = Models()
    app = create_app(models)
    install_batch_api(app, tmp_path / "batches")
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), models, http


def jsonl(url: str, bodies: list[dict]) -> io.BytesIO:
    text = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": b}) + "\n"
                   for i, b in enumerate(bodies))
    return io.BytesIO(text.encode())


def wait_done(client: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + _BOUND_S
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
    return batch


def test_files_upload_list_retrieve_content_delete(served):
    client, _, _ = served
    data = jsonl("/v1/chat/completions", [{"model": NAME, "messages": []}])
    made = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert made.purpose == "batch" and made.filename == "in.jsonl" and made.bytes == len(data.getvalue())
    assert client.files.retrieve(made.id).id == made.id
    assert [f.id for f in client.files.list(purpose="batch")] == [made.id]
    assert client.files.content(made.id).read() == data.getvalue()
    assert client.files.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)


def test_an_upload_writes_off_the_event_loop_which_answers_meanwhile(served, monkeypatch):
    client, _, http = served
    entered, release, seen = threading.Event(), threading.Event(), {}
    write = BatchStore.write_bytes

    def held_write(self, data, file_id=None):
        try:
            asyncio.get_running_loop()
            seen["on_loop"] = True
        except RuntimeError:  # no loop runs on this thread
            seen["on_loop"] = False
        entered.set()
        seen["released"] = release.wait(_BOUND_S)  # held until the loop has answered another request
        return write(self, data, file_id)

    monkeypatch.setattr(BatchStore, "write_bytes", held_write)
    with ThreadPoolExecutor(1) as pool:
        upload = pool.submit(client.files.create, file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert entered.wait(_BOUND_S)
        assert http.get("/v1/files").json()["data"] == []  # listed only once written
        release.set()
        made = upload.result(_BOUND_S)
    assert seen == {"on_loop": False, "released": True}
    assert client.files.retrieve(made.id).bytes == 3 and client.files.content(made.id).read() == b"{}\n"


@pytest.mark.parametrize("url, body, read", [
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
     lambda b: b["choices"][0]["message"]["content"]),
    ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 5}, lambda b: b["choices"][0]["text"]),
    ("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 5}, lambda b: b["output_text"]
     if "output_text" in b else b["output"][0]["content"][0]["text"]),
])
def test_a_batch_runs_each_line_through_the_route_in_the_lowest_class(served, url, body, read):
    client, models, http = served
    bodies = [body, {**body, "model": "tiny"}, {**body, "max_tokens": -1} if "max_tokens" in body
              else {**body, "max_output_tokens": -1}]
    source = client.files.create(file=("in.jsonl", jsonl(url, bodies)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint=url, completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    out = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["c0", "c1"]
    assert all(o["response"]["status_code"] == 200 and read(o["response"]["body"]) == REPLY for o in out)
    (err,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert err["custom_id"] == "c2" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["message"]  # the error body a live request gets
    assert models.engine.requests and all(r.priority == BATCH_PRIORITY for r in models.engine.requests)
    # A live request after it runs in its own class.
    http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "x"}]})
    assert models.engine.requests[-1].priority == 0
    assert [b.id for b in client.batches.list()] == [batch.id]
    status = http.get("/v1/status").json()["batches"]
    assert status["num_active"] == 0 and status["num_lines_run"] == 3


def test_refusals(served):
    client, _, _ = served
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    source = client.files.create(file=("in.jsonl", jsonl("/v1/chat/completions", [{}])), purpose="user_data")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=source.id, endpoint="/v1/images", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")
    source = client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert batch.status == "failed" and batch.errors.data[0].line == 1
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


KEYS = """
keys:
  - {key: sk-a, name: a, models: [tiny], priority: 3, max_concurrent: 1}
  - {key: sk-b, name: b}
"""
CHAT = "/v1/chat/completions"


class NamedModels(Models):
    def resolve(self, requested: str) -> str:  # every name is served, as itself: a key's model list decides
        return requested


@pytest.fixture
def keyed(tmp_path):
    """The server as `serve` builds it with a key file: the Batch API first, then the gate around it."""
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    models = NamedModels()
    app = create_app(models)
    install_batch_api(app, tmp_path / "batches")
    install_security(app, SecurityConfig(api_key_file=str(path), allowed_hosts=("testserver",),
                                         cache_isolation="key"), "127.0.0.1")
    with TestClient(app) as http:
        a, b = (openai.OpenAI(base_url="http://testserver/v1", api_key=k, http_client=http, max_retries=0)
                for k in ("sk-a", "sk-b"))
        yield a, b, models, http, app


def chat_line(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_with_keys_a_batch_runs_under_its_creators_key(keyed):
    a, _, models, http, app = keyed
    # Three lines against a limit of one at a time: the refused ones wait for the slot, they do not fail.
    source = a.files.create(file=("in.jsonl", jsonl(CHAT, [chat_line("tiny"), chat_line("other"),
                                                           chat_line("tiny")])), purpose="batch")
    batch = wait_done(a, a.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h").id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    (err,) = [json.loads(line) for line in a.files.content(batch.error_file_id).text.splitlines()]
    assert err["custom_id"] == "c1" and err["response"]["status_code"] == 404  # as a live request of this key
    assert err["response"]["body"]["error"]["code"] == "model_not_found"
    assert len(models.engine.requests) == 2
    # The batch class (worse than the key's floor of 3) and the key's cache group.
    assert all((r.priority, r.cache_group) == (BATCH_PRIORITY, "key:a") for r in models.engine.requests)
    ring = app.state.key_ring
    usage = ring.grant(ring.named("a")).usage
    assert usage.num_tokens > 0 and usage.num_in_flight == 0  # counted, and every slot released
    metrics = http.get("/metrics", headers={"Authorization": "Bearer sk-a"}).text
    assert float(re.search(r'mlxhost_key_tokens_total\{key="a"\} (\S+)', metrics).group(1)) == usage.num_tokens


def test_with_keys_files_and_batches_are_their_creators_only(keyed):
    a, b, _, _, _ = keyed
    source = a.files.create(file=("in.jsonl", jsonl(CHAT, [chat_line("tiny")])), purpose="batch")
    batch = a.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    mine = b.files.create(file=("in.jsonl", jsonl(CHAT, [chat_line("tiny")])), purpose="batch")
    for call in (lambda: b.files.retrieve(source.id), lambda: b.files.content(source.id),
                 lambda: b.files.delete(source.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id), lambda: a.files.retrieve(mine.id),
                 lambda: b.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [f.id for f in b.files.list()] == [mine.id] and list(b.batches.list()) == []
    done = wait_done(a, batch.id)
    assert done.status == "completed" and a.files.content(done.output_file_id).text
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert {f.id for f in a.files.list()} == {source.id, done.output_file_id}
    assert [x.id for x in a.batches.list()] == [batch.id]


def test_with_keys_a_line_whose_key_is_gone_fails_401(keyed):
    _, _, models, http, app = keyed
    dispatch = app.state.batch_runner.dispatch
    for owner in ("removed", None):  # a key no longer in the file; a batch from before keys were configured
        status, body = http.portal.call(dispatch, CHAT, chat_line("tiny"), owner)
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and body["error"]["message"]
    assert not models.engine.requests
