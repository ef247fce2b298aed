"""The real server (``build_app`` + uvicorn) on 127.0.0.1 in a background thread, and clients for it.

`server` is one qwen3 server per test module; `make_server(model_dir, **engine_kwargs)` starts more with
other `EngineConfig` values and stops them when the test ends.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from mlxhost.config import EngineConfig, MediaConfig, ServerConfig
from mlxhost.server.app import build_app

SERVED_NAME = "tiny"
_START_TIMEOUT_S = 120  # a bound for the start-up loop, not a timing check
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:<port>
    server: uvicorn.Server
    thread: threading.Thread
    model_name: str = SERVED_NAME

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            m = _METRIC_LINE.match(line)
            if m and not line.startswith("#"):
                out[m.group(1)] = float(m.group(2))
        return out

    def num_running(self) -> float:
        return self.metrics()["mlxhost_num_requests_running"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the test server did not stop"  # what follows reads its files


def start_server(model_dir, media: MediaConfig | None = None, cpu_weights: str = "auto",
                 **engine_kwargs) -> LiveServer:
    config = ServerConfig(model=str(model_dir), served_model_name=SERVED_NAME, engine=EngineConfig(**engine_kwargs),
                          media=media or MediaConfig(), cpu_weights=cpu_weights)
    return start_app(build_app(config))


def start_app(app) -> LiveServer:
    """Serves `app` (e.g. `build_app(ServerConfig(models=...))`) on a free port of 127.0.0.1."""
    # Port 0: the OS picks a free port; we read it back from the listening socket.
    uv_config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server exited during start-up")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", server, thread)


@pytest.fixture(scope="module")
def server(qwen3_model_dir):
    live = start_server(qwen3_model_dir, max_num_seqs=16, prefill_step_size=64)
    yield live
    live.stop()


def _server_factory():
    started: list[LiveServer] = []

    def make(model_dir, **engine_kwargs) -> LiveServer:
        live = start_server(model_dir, **engine_kwargs)
        started.append(live)
        return live

    yield make
    for live in started:
        live.stop()


@pytest.fixture
def make_server():
    """`make_server(model_dir, **engine_kwargs)`: servers that stop when the test ends."""
    yield from _server_factory()


@pytest.fixture(scope="module")
def make_module_server():
    """The same, for module-scoped fixtures: the servers stop when the module ends."""
    yield from _server_factory()


@pytest.fixture(scope="module")
def serve_module_app():
    """`serve_module_app(app)`: serves an app the test built (e.g. several models) until the module ends."""
    started: list[LiveServer] = []

    def serve(app) -> LiveServer:
        live = start_app(app)
        started.append(live)
        return live

    yield serve
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def client(server):
    # No retries: a retried 4xx/5xx would hide what the server answered and slow the suite.
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def async_client(server):
    # Function scope: an async client's connections belong to the event loop of one test.
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def response_head_to_headers_only(url: str, headers: str) -> bytes:
    """Sends a request's head alone (no body) to the server at `url` and returns the response head: a limit
    checked from the headers must answer without waiting for a body that never comes."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(headers.format(host=host, port=port).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(4096)
            assert data, "connection closed without a response"
            head += data
    return head
