"""The serving process (process.py): its environment knobs (a bad one is reported before anything loads), and
the services closed on a shutdown with or without a second signal."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import uvicorn

from mlxhost.batch.store import BatchStore
from mlxhost.frontends.app import create_app
from mlxhost.frontends.batch.routes import install_batch_api
from mlxhost.server import cli, process
from tests.frontends.fake_models import FakeModels


@pytest.mark.parametrize("value, seconds", [(None, None), ("", None), ("1", 0.001), ("0.5", 0.0005)])
def test_switch_interval_from_the_environment(value, seconds):
    environ = {} if value is None else {process.SWITCH_INTERVAL_ENV: value}
    assert process.switch_interval_s(environ) == seconds


@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_switch_interval_stops_serve_with_a_message(value, monkeypatch, capsys):
    monkeypatch.setenv(process.SWITCH_INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=process.SWITCH_INTERVAL_ENV):
        process.switch_interval_s()
    # before the port is taken and the model loads: the folder does not even exist
    assert cli.main(["serve", "/nonexistent/model", "--port", "0"]) == 2
    assert process.SWITCH_INTERVAL_ENV in capsys.readouterr().err


class FakeMcp:
    """An MCP manager without servers that counts its starts and closes."""

    servers: dict = {}

    def __init__(self) -> None:
        self.num_starts = self.num_closes = 0

    async def start(self) -> None:
        self.num_starts += 1

    async def close(self) -> None:
        self.num_closes += 1


@pytest.mark.parametrize("second_signal", [True, False])
def test_the_services_close_once_on_either_path(tmp_path, second_signal):
    """A second signal makes uvicorn skip the app's lifespan shutdown: the server then closes the MCP sessions
    and the Batch API's runner itself (else they keep the process waiting); on the graceful path the lifespan
    closes them, and neither path closes one twice."""
    models, mcp = FakeModels(), FakeMcp()
    app = create_app(models, mcp)
    install_batch_api(app, tmp_path / "batches")
    server = process.GracefulServer(uvicorn.Config(app), shutdown_timeout_s=1)
    server.servers = []  # none listening: uvicorn's startup did not run

    def running_tasks() -> set[str]:
        return {t.get_name() for t in asyncio.all_tasks() if not t.done()}

    async def main() -> None:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        assert mcp.num_starts == 1 and "batch-runner" in running_tasks()
        app.state.stop_deadline = time.monotonic() + 60  # a hang bound, not a timing check
        server.force_exit = second_signal
        # What uvicorn's lifespan shutdown ends in (run unless a second signal came).
        server.lifespan = SimpleNamespace(shutdown=lambda: lifespan.__aexit__(None, None, None))
        await server.shutdown()
        assert mcp.num_closes == 1 and "batch-runner" not in running_tasks()
        BatchStore(tmp_path / "batches").close()  # the folder's lock is free again
        if second_signal:  # a lifespan shutdown that ran after all closes nothing twice
            await lifespan.__aexit__(None, None, None)
            assert mcp.num_closes == 1

    asyncio.run(main())


class CountingModels(FakeModels):
    num_closes = 0

    def close(self, until=lambda: None) -> int:
        self.num_closes += 1
        return super().close(until)


def test_a_service_that_fails_to_close_keeps_nothing_else_open(tmp_path):
    """A service whose close raises (a runner ended by a database error) is logged; the other services and the
    engines still close on the lifespan's way out."""

    class BrokenMcp(FakeMcp):
        async def close(self) -> None:
            await super().close()
            raise RuntimeError("the session's transport is gone")

    models, mcp = CountingModels(), BrokenMcp()
    app = create_app(models, mcp)
    install_batch_api(app, tmp_path / "batches")

    async def main() -> None:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        app.state.stop_deadline = time.monotonic() + 60
        await lifespan.__aexit__(None, None, None)
        running = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
        assert mcp.num_closes == 1 and models.num_closes == 1 and "batch-runner" not in running

    asyncio.run(main())
    BatchStore(tmp_path / "batches").close()  # the runner's store let its folder go


def test_a_second_signal_bounds_a_close_the_lifespan_already_started(tmp_path):
    """uvicorn does not interrupt a lifespan shutdown already running: a service close that hangs there is given up
    at the deadline a second signal brings forward, and the engines still close."""

    class HangingMcp(FakeMcp):
        async def close(self) -> None:
            await super().close()
            await asyncio.Event().wait()  # a session whose transport never answers

    models, mcp = CountingModels(), HangingMcp()
    app = create_app(models, mcp)
    install_batch_api(app, tmp_path / "batches")

    async def main() -> None:
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        app.state.stop_deadline = time.monotonic() + 3600  # the first signal's deadline: far away
        closing = asyncio.ensure_future(lifespan.__aexit__(None, None, None))
        while mcp.num_closes == 0:  # the lifespan is inside the hanging close
            await asyncio.sleep(0.01)
        assert not closing.done()
        app.state.stop_deadline = time.monotonic()  # what a second signal does (process.GracefulServer)
        await asyncio.wait_for(closing, 60)  # a hang bound, not a timing check
        running = {t.get_name() for t in asyncio.all_tasks() if not t.done()}
        assert models.num_closes == 1 and "batch-runner" not in running

    asyncio.run(main())
    BatchStore(tmp_path / "batches").close()
