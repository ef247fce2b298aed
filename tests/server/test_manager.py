"""ModelManager with fake loaders and engines (no weights): load on first use, one shared load, LRU
unloading of idle unpinned models, pinned models, ttl, unknown names; and the models YAML/flags."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.models.specs import load_models_file, parse_model_flag, parse_ttl, with_source_aliases
from mlxhost.server.manager import ModelManager, ModelState, ModelUnavailableError, UnknownModelError

MB = 10**6


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_active = 0  # requests in flight: what makes a model busy
        self.started = self.stopped = False

    def start(self, loop) -> None:
        self.started = True

    def stop(self, until=lambda: None) -> bool:
        self.stopped = True
        return True


@dataclass
class FakeServed:
    name: str
    max_model_len: int = 4096


class FakeLoader:
    """Counts loads; `gate` (a threading.Event) holds a load on the worker thread until set."""

    def __init__(self, fail: set[str] = frozenset(), gate: threading.Event | None = None) -> None:
        self.loads: list[str] = []
        self.engines: dict[str, FakeEngine] = {}
        self.fail, self.gate = fail, gate

    def __call__(self, spec: ModelSpec):
        if self.gate is not None:
            self.gate.wait(10)
        self.loads.append(spec.name)
        if spec.name in self.fail:
            raise OSError(f"no weights in {spec.source}")
        engine = FakeEngine(spec.name)
        self.engines[spec.name] = engine
        return FakeServed(spec.name), engine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_manager(specs, loader=None, sizes=None, clock=None, **kwargs) -> tuple[ModelManager, FakeLoader]:
    loader = loader or FakeLoader()
    sizes = sizes or {}
    manager = ModelManager(specs, loader, size_of=lambda s: sizes.get(s.name, MB), clock=clock or Clock(),
                           **kwargs)
    return manager, loader


def spec(name, **kw) -> ModelSpec:
    return ModelSpec(name=name, source=f"/models/{name}", **kw)


async def use(manager: ModelManager, name: str):
    async with manager.lease(name) as (served, engine):
        return served, engine


@pytest.fixture
def run():
    """Runs a coroutine on a fresh event loop with the manager started on it and closed after."""
    def go(manager: ModelManager, coro_fn):
        async def main():
            manager.start(asyncio.get_running_loop())
            try:
                return await coro_fn()
            finally:
                manager.close()
        return asyncio.run(main())
    return go


def test_loads_on_first_use_and_reuses(run):
    manager, loader = make_manager([spec("a"), spec("b")])

    async def main():
        assert manager.state("a") is ModelState.NOT_LOADED
        served, engine = await use(manager, "a")
        assert served.name == "a" and engine.started
        await use(manager, "a")
        return manager.cards()

    cards = run(manager, main)
    assert loader.loads == ["a"]
    assert {c["id"]: c["status"] for c in cards} == {"a": "loaded", "b": "not_loaded"}


def test_unknown_name_lists_served_names(run):
    manager, _ = make_manager([spec("a", aliases=("alpha",)), spec("b")])

    async def main():
        with pytest.raises(UnknownModelError) as info:
            await use(manager, "nope")
        return str(info.value)

    message = run(manager, main)
    assert "`nope`" in message and "`a`" in message and "`b`" in message
    assert manager.resolve("alpha") == "a"


def test_concurrent_first_requests_share_one_load(run):
    gate = threading.Event()
    manager, loader = make_manager([spec("a")], loader=FakeLoader(gate=gate))

    async def main():
        tasks = [asyncio.ensure_future(use(manager, "a")) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert manager.state("a") is ModelState.LOADING
        gate.set()
        return await asyncio.gather(*tasks)

    results = run(manager, main)
    assert loader.loads == ["a"]
    assert len({id(engine) for _, engine in results}) == 1


def test_lru_idle_unpinned_model_is_unloaded(run):
    clock = Clock()
    manager, loader = make_manager([spec("a"), spec("b"), spec("c")], clock=clock, max_loaded_models=2)

    async def main():
        for name in ("a", "b", "a"):  # a used last: b is the least recently used
            clock.now += 1
            await use(manager, name)
        clock.now += 1
        await use(manager, "c")
        assert loader.engines["b"].stopped and not loader.engines["a"].stopped
        return {n: manager.state(n) for n in "abc"}

    states = run(manager, main)
    assert states == {"a": ModelState.LOADED, "b": ModelState.NOT_LOADED, "c": ModelState.LOADED}


def test_byte_cap_unloads_until_it_fits(run):
    clock = Clock()
    sizes = {"a": 4 * MB, "b": 4 * MB, "c": 7 * MB}
    manager, loader = make_manager([spec("a"), spec("b"), spec("c")], sizes=sizes, clock=clock,
                                   max_loaded_bytes=10 * MB)

    async def main():
        for name in ("a", "b", "c"):
            clock.now += 1
            await use(manager, name)
        return {n: manager.state(n) for n in "abc"}

    # c (7 MB) next to b (4 MB) is over 10 MB: both a and b go, LRU first.
    assert run(manager, main) == {"a": ModelState.NOT_LOADED, "b": ModelState.NOT_LOADED, "c": ModelState.LOADED}


def test_pinned_model_loads_at_start_and_is_never_unloaded(run):
    clock = Clock()
    manager, loader = make_manager([spec("p", pinned=True, ttl_s=1.0), spec("b"), spec("c")], clock=clock,
                                   max_loaded_models=2)
    manager.load_pinned()
    assert loader.loads == ["p"]

    async def main():
        clock.now += 1
        await use(manager, "b")
        clock.now += 1
        await use(manager, "c")  # p is the least recently used, but pinned: b goes
        clock.now += 100
        await manager.expire_idle()  # a ttl on a pinned model is ignored
        assert loader.engines["p"].started and not loader.engines["p"].stopped
        return {n: manager.state(n) for n in ("p", "b", "c")}

    assert run(manager, main) == {"p": ModelState.LOADED, "b": ModelState.NOT_LOADED, "c": ModelState.LOADED}
    assert all(e.stopped for e in loader.engines.values())  # close() stops every engine


def test_pinned_models_taking_all_room_refuse_at_once(run):
    manager, loader = make_manager([spec("p", pinned=True), spec("b")], max_loaded_models=1)
    manager.load_pinned()

    async def main():
        with pytest.raises(ModelUnavailableError, match="pinned"):
            await use(manager, "b")
        return manager.state("b")

    assert run(manager, main) is ModelState.NOT_LOADED
    assert loader.loads == ["p"]


def test_busy_model_is_not_unloaded_a_load_waits_for_it(run):
    clock = Clock()
    manager, loader = make_manager([spec("a"), spec("b")], clock=clock, max_loaded_models=1)

    async def main():
        _, engine_a = await use(manager, "a")
        engine_a.num_active = 1  # a request still streaming
        task = asyncio.ensure_future(use(manager, "b"))
        await asyncio.sleep(0.2)
        assert not task.done() and manager.state("a") is ModelState.LOADED
        engine_a.num_active = 0
        await task
        return manager.state("a"), manager.state("b")

    assert run(manager, main) == (ModelState.NOT_LOADED, ModelState.LOADED)


def test_busy_wait_gives_up_with_503_error(run):
    manager, _ = make_manager([spec("a"), spec("b")], max_loaded_models=1, busy_wait_s=0.0)

    async def main():
        async with manager.lease("a"):  # held: a is busy
            with pytest.raises(ModelUnavailableError, match="busy"):
                await use(manager, "b")
        return manager.state("a")

    assert run(manager, main) is ModelState.LOADED


def test_ttl_unloads_idle_model_and_busy_time_does_not_count(run):
    clock = Clock()
    manager, loader = make_manager([spec("a", ttl_s=10.0), spec("b")], clock=clock)

    async def main():
        _, engine = await use(manager, "a")
        await use(manager, "b")
        engine.num_active = 1
        clock.now += 50
        assert await manager.expire_idle() == []  # busy for 50 s: not idle
        engine.num_active = 0
        clock.now += 5
        assert await manager.expire_idle() == []  # idle for 5 s < 10 s
        clock.now += 6
        assert await manager.expire_idle() == ["a"]
        return manager.state("a"), manager.state("b")

    assert run(manager, main) == (ModelState.NOT_LOADED, ModelState.LOADED)  # b has no ttl
    assert loader.engines["a"].stopped


def test_ttl_watcher_runs_by_itself(run):
    manager, _ = make_manager([spec("a", ttl_s=0.05)], clock=__import__("time").monotonic)

    async def main():
        await use(manager, "a")
        for _ in range(200):  # a bound for the loop, not a timing check
            if manager.state("a") is ModelState.NOT_LOADED:
                break
            await asyncio.sleep(0.02)
        return manager.state("a")

    assert run(manager, main) is ModelState.NOT_LOADED


def test_unloaded_model_loads_again_and_release_is_called(run):
    released = []
    clock = Clock()
    manager, loader = make_manager([spec("a"), spec("b")], clock=clock, max_loaded_models=1,
                                   release=lambda: released.append(1))

    async def main():
        for name in ("a", "b", "a"):
            clock.now += 1
            await use(manager, name)

    run(manager, main)
    assert loader.loads == ["a", "b", "a"] and len(released) == 2


def test_failed_load_reports_and_can_retry(run):
    loader = FakeLoader(fail={"a"})
    manager, _ = make_manager([spec("a")], loader=loader)

    async def main():
        with pytest.raises(ModelUnavailableError, match="failed to load.*no weights"):
            await use(manager, "a")
        card = manager.cards()[0]
        loader.fail = set()
        await use(manager, "a")
        return card

    card = run(manager, main)
    assert card["status"] == "not_loaded" and "no weights" in card["error"]
    assert loader.loads == ["a", "a"]


def test_memory_estimate_alone_never_blocks_the_only_model(run):
    # free_bytes says nothing fits: with nothing to unload the load goes ahead (the model's own
    # budget decides); with another idle model loaded, that one is unloaded first.
    clock = Clock()
    manager, loader = make_manager([spec("a"), spec("b")], clock=clock, free_bytes=lambda: 0)

    async def main():
        clock.now += 1
        await use(manager, "a")
        clock.now += 1
        await use(manager, "b")
        return manager.state("a"), manager.state("b")

    assert run(manager, main) == (ModelState.NOT_LOADED, ModelState.LOADED)


def test_hold_does_not_load(run):
    manager, loader = make_manager([spec("a")])

    async def main():
        with manager.hold("a") as engine:
            assert engine is None
        await use(manager, "a")
        with manager.hold("a") as engine:
            assert engine is loader.engines["a"]

    run(manager, main)


def test_unload_waits_out_a_status_read_not_a_request(run):
    """A dashboard's status poll (a hold) must not turn an operator's unload into a 409; a request must."""
    manager, loader = make_manager([spec("a")])

    async def main():
        await use(manager, "a")
        with manager.hold("a"):
            unloading = asyncio.ensure_future(manager.unload("a"))
            await asyncio.sleep(0.2)
            assert not unloading.done() and manager.state("a") is ModelState.LOADED  # the read still has it
        assert await unloading is True
        assert manager.state("a") is ModelState.NOT_LOADED and loader.engines["a"].stopped
        await use(manager, "a")
        loader.engines["a"].num_active = 1  # a request still streaming
        with manager.hold("a"):
            assert await manager.unload("a") is False
        return manager.state("a")

    assert run(manager, main) is ModelState.LOADED


# -- specs: YAML and flags -------------------------------------------------------------------------


def test_models_file(tmp_path):
    (tmp_path / "local").mkdir()
    path = tmp_path / "models.yaml"
    path.write_text(
        "max_loaded_models: 2\n"
        "max_loaded_memory: 3MB\n"
        "models:\n"
        "  - {name: q, path: local, pinned: true, aliases: [qwen]}\n"
        "  - {name: l, path: /elsewhere/llama, ttl: 10m, engine: {max_num_seqs: 4}}\n"
    )
    base = EngineConfig(max_num_seqs=16)
    models = load_models_file(path, base)
    q, l = models.models
    assert (models.max_loaded_models, models.max_loaded_bytes) == (2, 3 * 10**6)
    assert q.source == str(tmp_path / "local") and q.pinned and q.aliases == ("qwen",) and q.engine is None
    assert l.ttl_s == 600 and l.engine.max_num_seqs == 4 and l.engine.block_size == base.block_size


def test_models_file_mapping_form_and_errors(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("models:\n  a: /x/a\n  b: {path: /x/b, ttl: 30}\n")
    a, b = load_models_file(path, EngineConfig()).models
    assert (a.name, a.source, b.name, b.ttl_s) == ("a", "/x/a", "b", 30.0)
    for bad in ("models:\n  - {name: a}\n", "models:\n  - {path: /x, colour: red}\n",
                "models:\n  - {path: /x, engine: {warp: 9}}\n", "nothing: 1\n", "models: [\n"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_models_file(path, EngineConfig())


def test_model_flag_and_ttl():
    assert parse_model_flag("q=/m/qwen") == ModelSpec(name="q", source="/m/qwen")
    assert parse_model_flag("org/model").name == "org/model"  # a hub id names itself
    assert [parse_ttl(v) for v in (None, "off", 0, 5, "30s", "2m", "1h")] == [None, None, None, 5.0, 30.0, 120.0,
                                                                               3600.0]
    with pytest.raises(ValueError):
        parse_ttl("soon")


def test_names_must_be_unique_and_paths_become_aliases():
    with pytest.raises(ValueError, match="unique"):
        ServerConfig(models=(spec("a"), ModelSpec(name="b", source="/x", aliases=("a",))))
    specs = with_source_aliases((spec("a"), spec("b"), ModelSpec(name="c", source="/models/b")))
    assert specs[0].aliases == ("/models/a",)
    assert specs[1].aliases == () and specs[2].aliases == ()  # two models share /models/b


def test_cli_flags_and_file(tmp_path):
    from mlxhost.server.cli import make_parser
    from mlxhost.server.serve_command import _models_fields

    path = tmp_path / "models.yaml"
    path.write_text("max_loaded_models: 3\nmodels:\n  - {name: a, path: /x/a, pinned: true}\n")
    args = make_parser().parse_args(["serve", "--models-config", str(path), "--model", "b=/x/b",
                                     "--max-loaded-models", "2", "--max-loaded-memory", "1GB"])
    fields = _models_fields(args)
    assert [s.name for s in fields["models"]] == ["a", "b"] and fields["models"][0].pinned
    assert (fields["max_loaded_models"], fields["max_loaded_bytes"]) == (2, 10**9)  # flags win over the file
    assert _models_fields(make_parser().parse_args(["serve", "/x/a"]))["models"] == ()
    with pytest.raises(ValueError, match="served-model-name"):
        _models_fields(make_parser().parse_args(["serve", "--model", "/x/a", "--served-model-name", "z"]))


def test_models_of_a_multi_model_server_share_the_memory_budget():
    from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
    from mlxhost.server.app import shared_engine_config

    engine = EngineConfig()
    assert shared_engine_config(engine, ServerConfig(model="x"), "x") is engine  # alone: the whole budget
    sizes = {"a": 4 << 30, "b": 2 << 30, "c": 1 << 30}
    three = ServerConfig(models=tuple(ModelSpec(name=n, source=n) for n in "abc"), max_loaded_models=2)
    cfg = shared_engine_config(engine, three, "c", sizes.get)
    # Two may be loaded at once: c leaves out the largest other model's weights, takes half the rest.
    assert (cfg.memory_share, cfg.memory_reserved_bytes) == (0.5, 4 << 30)
    cfg = shared_engine_config(engine, ServerConfig(models=three.models), "a", sizes.get)
    assert (cfg.memory_share, cfg.memory_reserved_bytes) == (1 / 3, 3 << 30)
