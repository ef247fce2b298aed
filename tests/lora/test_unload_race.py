"""An adapter unloaded while a request for it is on its way, through the real model manager and engine: a
request that holds its adapter (attached, prompt being prepared, not yet queued on the engine) makes the
unload a 409 (AdapterBusy) and is served with the adapter's tokens; a request that arrives while an unload
runs loads the adapter again and is served too. Neither may end in an engine error (the HTTP 500 of old:
the engine met a request for an adapter it had just dropped)."""

from __future__ import annotations

import asyncio

import pytest

from mlxhost.config import LoraSpec, ServerConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.lora.adapters import AdapterBusy
from mlxhost.server.app import build_app

PROMPT = [5, 77, 300, 12, 9, 400, 23, 8, 61, 1200, 7]
MAX_NEW = 10  # as conftest.py's references


@pytest.fixture
def models(qwen3_model_dir, adapters):
    app = build_app(ServerConfig(model=str(qwen3_model_dir), served_model_name="tiny",
                                 loras=(LoraSpec("alpha", adapters["alpha"]),)))
    manager = app.state.models
    yield manager
    manager.close()


def _queue(engine, served, rid: str):
    """Queues a request under the served adapter; returns its output stream."""
    return engine.generate(Request(rid, list(PROMPT), SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                     ignore_eos=True), adapter=served.adapter))


async def _tokens(stream) -> list[int]:
    """The request's greedy tokens; an engine error fails the test with its message."""
    ids = []
    async for out in stream:
        assert out.error is None, out.error
        ids.extend(out.new_token_ids)
    return ids


def test_an_unload_while_a_request_holds_its_adapter_is_refused(models, reference):
    async def main():
        models.start(asyncio.get_running_loop())
        async with models.lease("alpha") as (served, engine):
            # The request has its adapter and is being prepared; an operator unloads the adapter now.
            with pytest.raises(AdapterBusy, match="serving 1 request"):
                await models.unload("alpha")
            stream = _queue(engine, served, "held")
        ids = await _tokens(stream)
        assert models.card("alpha")["status"] == "loaded"
        await models.unload("alpha")  # nothing uses it now
        assert models.card("alpha")["status"] == "not_loaded"
        return ids

    assert asyncio.run(main()) == reference("alpha", PROMPT)


def test_a_request_arriving_during_an_unload_loads_the_adapter_again(models, reference):
    async def main():
        models.start(asyncio.get_running_loop())

        async def request(rid: str) -> list[int]:
            async with models.lease("alpha") as (served, engine):
                stream = _queue(engine, served, rid)
            return await _tokens(stream)

        unloading = asyncio.ensure_future(models.unload("alpha"))
        await asyncio.sleep(0)  # the unload is under way: the adapter is marked unloaded, the engine call queued
        ids = await request("late")
        await unloading
        assert models.card("alpha")["status"] == "loaded"  # loaded again for the late request
        return ids

    assert asyncio.run(main()) == reference("alpha", PROMPT)
