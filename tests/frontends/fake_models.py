"""The real app (`create_app`) over a fake model manager: one byte-level "model" whose chat template
records what it was given (messages, tools, template arguments) and whose engine answers at once. Every
HTTP layer runs as served (schemas, translation, gateway, preparation, grammars, renderers); no MLX."""

from __future__ import annotations

import contextlib
import json

from fastapi.testclient import TestClient

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.app import create_app
from mlxhost.serving.model import ServedModel

NAME = "tiny"
REPLY = "hello"
JSON_REPLY = json.dumps({"title": "Greeting"})


class RecordingTokenizer:
    """One id per byte; a chat template that writes each message as `role: content` and keeps what it got."""

    chat_template = "recorded"

    def __init__(self) -> None:
        self.renders: list[dict] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kwargs):
        self.renders.append({"messages": messages, "tools": tools, "kwargs": kwargs})
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        return self.encode(text) if tokenize else text


class InstantEngine:
    """Answers every request with one output: `reply` if set, JSON under a json_schema grammar, else a
    short text."""

    kv_capacity_tokens = None

    def __init__(self) -> None:
        self.requests: list = []
        self.reply: str | None = None

    def generate(self, request):
        self.requests.append(request)
        constraint = request.sampling.constraint
        text = self.reply or (JSON_REPLY if constraint is not None and constraint.kind == "json_schema" else REPLY)

        async def outputs():
            yield RequestOutput(request.request_id, [1] * len(text), text, request.num_prompt_tokens, len(text),
                                "stop")

        return outputs()


class FakeModels:
    def __init__(self) -> None:
        self.tokenizer = RecordingTokenizer()
        self.engine = InstantEngine()
        self.served = ServedModel(name=NAME, aliases=frozenset({"claude-sonnet-4-5"}), tokenizer=self.tokenizer,
                                  max_model_len=1 << 20, vocab_size=256, eos_token_ids=frozenset({0}),
                                  default_max_tokens=64, created=0, tool_parser="hermes")
        self.names = [NAME]

    def start(self, loop) -> None:
        pass

    def close(self, until=lambda: None) -> int:  # the manager's signature: nothing to stop here
        return 0

    def loaded_engines(self) -> list:
        return []

    def resolve(self, requested: str) -> str:
        return NAME

    def cards(self) -> list[dict]:
        return [{"id": NAME, "object": "model"}]

    @contextlib.asynccontextmanager
    async def lease(self, requested: str):
        yield self.served, self.engine

    @property
    def last_render(self) -> dict:
        return self.tokenizer.renders[-1]


def fake_client() -> tuple[TestClient, FakeModels]:
    models = FakeModels()
    return TestClient(create_app(models)), models
