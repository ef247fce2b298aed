"""The app over a fake model whose replies are scripted per round (tests/frontends/fake_models.py) and
MCP servers: a stdio one of this folder (slow_server.py) and any the test adds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mlxhost.frontends.app import create_app
from mlxhost.mcp.client import McpManager
from mlxhost.mcp.config import McpConfig, McpServerConfig
from mlxhost.mcp.remote import resolve_host
from tests.frontends.fake_models import FakeModels, InstantEngine

SLOW_SERVER = McpServerConfig("slow", command=sys.executable, args=(str(Path(__file__).with_name("slow_server.py")),))


class ScriptedEngine(InstantEngine):
    """Answers round i with replies[i] (the last one again when they run out)."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__()
        self.replies = replies

    def generate(self, request):
        self.reply = self.replies[min(len(self.requests), len(self.replies) - 1)]
        return super().generate(request)


def tool_call(name: str, **arguments) -> str:
    """A reply in the fake model's tool-call format (hermes)."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.fixture
def mcp_app():
    """make(replies, config=None, resolve=resolve_host) -> (TestClient inside its lifespan, FakeModels)."""
    clients = []

    def make(replies: list[str], config: McpConfig | None = None, resolve=resolve_host):
        models = FakeModels()
        models.engine = ScriptedEngine(replies)
        config = config or McpConfig(servers=(SLOW_SERVER,), call_timeout_s=3)
        client = TestClient(create_app(models, McpManager(config, resolve)))
        client.__enter__()
        clients.append(client)
        return client, models

    yield make
    for client in clients:
        client.__exit__(None, None, None)
