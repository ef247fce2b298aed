"""The real app (`create_app`) over a fake model manager: one byte-level "model" whose chat template
records what it was given (messages, tools, template arguments) and whose engine answers at once. Every
HTTP layer runs as served (schemas, translation, gateway, preparation, grammars, renderers); no MLX."""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi.testclient import TestClient

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.app import create_app
from mlxhost.serving.model import ServedModel
from mlxhost.structured.grammar import GrammarFailure

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


# How a request ends when `InstantEngine.failure` names it: the last output the engine sends then.
FAILURES = {
    "shutdown": {"finish_reason": "abort", "error": "server shutting down"},  # AsyncEngine.end_all's
    "grammar": {"error": GrammarFailure("the grammar could not continue")},  # the request's own grammar
    "crash": {"error": "engine failed"},  # anything else the engine reports
}


class InstantEngine:
    """Answers every request with one output: `reply` if set, JSON under a json_schema grammar, else a
    short text. With `failure` a FAILURES key, a first piece of text and then that failure; "hang": nothing
    until `release` is set. `closed` lists the requests whose output stream ended (finished or aborted)."""

    kv_capacity_tokens = None

    def __init__(self) -> None:
        self.requests: list = []
        self.reply: str | None = None
        self.failure: str | None = None
        self.closed: list[str] = []
        self.reached: asyncio.Event | None = None  # set once a request reaches the engine (made on first use)
        self.release: asyncio.Event | None = None

    def generate(self, request):
        self.requests.append(request)
        if self.reached is None:
            self.reached, self.release = asyncio.Event(), asyncio.Event()
        self.reached.set()
        constraint = request.sampling.constraint
        text = self.reply or (JSON_REPLY if constraint is not None and constraint.kind == "json_schema" else REPLY)
        rid, num_prompt, failure = request.request_id, request.num_prompt_tokens, self.failure

        async def outputs():
            try:
                if failure == "hang":
                    await self.release.wait()
                if failure in FAILURES:
                    yield RequestOutput(rid, [1, 1], text[:2], num_prompt, 2)
                    yield RequestOutput(rid, [], "", num_prompt, 2, **FAILURES[failure])
                    return
                yield RequestOutput(rid, [1] * len(text), text, num_prompt, len(text), "stop")
            finally:
                self.closed.append(rid)

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
