"""The set of served models: which are loaded, loading on first use, and unloading the least recently
used idle unpinned one when another needs room (or after its ttl).

`ModelManager` is the one owner of load state; it lives on the event loop. Loads and unloads run on
one worker thread of its own, one at a time: two loads at once would double the peak memory and
race on the room check. It imports no MLX: the server hands it the functions that load a model
(`load`) and give memory back (`release`), so the tests drive it with fakes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Callable, Sequence

from mlxhost.config import LoraSpec, ModelSpec
from mlxhost.lora.registry import AdapterRegistry
from mlxhost.memory.release import freeze_heap
from mlxhost.models.specs import weights_on_disk
from mlxhost.server.model_slot import Loader, ModelSlot, ModelState, mb
from mlxhost.serving.model import ModelUnavailableError, UnknownModelError

log = logging.getLogger(__name__)

# A load waits this long for a busy model to go idle before it gives up (503) instead of
# queueing forever; a model's requests usually end well within it.
_BUSY_WAIT_S = 300.0
_POLL_S = 0.05
# An unload asked for over HTTP waits this long for cache clears of the model to end (DELETE /v1/cache waits
# for the engine thread between two steps: a busy engine's may take a while; status reads never wait).
_HOLDS_WAIT_S = 30.0
# How often the ttl watcher looks when a client's keep_alive (not the config) started it.
_KEEP_ALIVE_POLL_S = 0.5


class ModelManager:
    def __init__(
        self,
        specs: Sequence[ModelSpec],
        load: Loader,
        *,
        max_loaded_models: int | None = None,
        max_loaded_bytes: int | None = None,
        free_bytes: Callable[[], int | None] | None = None,
        release: Callable[[], None] | None = None,
        size_of: Callable[[ModelSpec], int] = lambda spec: weights_on_disk(spec.source),
        clock: Callable[[], float] = time.monotonic,
        busy_wait_s: float = _BUSY_WAIT_S,
    ) -> None:
        if not specs:
            raise ValueError("a server needs at least one model")
        self._slots = {s.name: ModelSlot(s, size_of(s)) for s in specs}
        self._names = {n: s.name for s in specs for n in (s.name, *s.aliases)}
        # LoRA adapters, each a model name on its base (lora/registry.py); a bad folder fails start-up here.
        self.adapters = AdapterRegistry(specs)
        self._load_fn, self._release = load, release
        self.max_loaded_models, self.max_loaded_bytes = max_loaded_models, max_loaded_bytes
        # Without a configured cap: what the memory budget says this process may still take.
        self._free_bytes = free_bytes
        self._clock, self._busy_wait_s = clock, busy_wait_s
        self._lock = asyncio.Lock()  # one room decision (and load or unload) at a time
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlxhost-models")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._expiry: asyncio.Task | None = None
        self._started: list = []  # engines started and not stopped (touched by the worker, then close())
        self._stuck: list = []  # engines close() left inside a step
        self._created = int(time.time())

    # -- names ---------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def resolve(self, requested: str) -> str:
        """The served name for a name or alias; UnknownModelError lists what is served."""
        try:
            return self._names[requested]
        except KeyError:
            raise UnknownModelError(requested, self.names) from None

    def state(self, name: str) -> ModelState:
        return self._slots[self.resolve(name)].state

    def source(self, name: str) -> str:
        """Where a model's weights come from (a folder or hub id), for what a listing shows about it."""
        return self._slots[self.resolve(name)].spec.source

    # -- lifecycle -----------------------------------------------------------------------------
    def load_pinned(self) -> None:
        """Loads the pinned models now, on the calling thread (start-up: a bad folder fails here)."""
        for slot in self._slots.values():
            if slot.spec.pinned and slot.state is ModelState.NOT_LOADED:
                slot.served, slot.engine = self._load_fn(slot.spec)
                self._mark_loaded(slot)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the engines of the models loaded so far and the ttl watcher (on the loop's thread)."""
        self._loop = loop
        for slot in self._slots.values():
            if slot.state is ModelState.LOADED:
                slot.engine.start(loop)
                self._started.append(slot.engine)
        ttls = [s.spec.ttl_s for s in self._slots.values() if s.spec.ttl_s and not s.spec.pinned]
        if ttls:
            self._expiry = loop.create_task(self._expire_forever(min(max(min(ttls) / 4, _POLL_S), 5.0)))

    def close(self, until: Callable[[], float | None] = lambda: None) -> int:
        """Stops every engine; a load under way finishes first (its engine is stopped too). `until()`: the
        shutdown's deadline (time.monotonic()), past which an engine still inside a step is not waited for
        (AsyncEngine.stop). Returns how many were left so; a later close() looks at them again."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        stuck = []
        while self._started:
            engine = self._started.pop()
            if not engine.stop(until):
                busy_s = engine.busy_s
                if engine not in self._stuck:  # a later close() looks again, without a second line
                    log.warning("an engine is still inside a step%s: not waited for",
                                f" after {busy_s:.0f} s" if busy_s is not None else "")
                stuck.append(engine)
        self._started.extend(stuck)
        self._stuck = stuck
        return len(stuck)

    # -- requests ------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, requested: str) -> AsyncIterator[tuple[Any, Any]]:
        """`(ServedModel, AsyncEngine)` of a model, loading it first if needed. The model stays loaded
        while the lease is held and while its engine has requests: take the lease around
        `engine.generate`, whose stream then keeps the model busy until it ends."""
        _check_key_model(requested, self.resolve)  # before anything loads for a key that may not use it
        adapter = self.adapters.find(requested)
        slot = self._slots[adapter.base if adapter is not None else self.resolve(requested)]
        slot.num_leases += 1
        try:
            while slot.state is not ModelState.LOADED:
                if slot.state is ModelState.NOT_LOADED:
                    slot.state = ModelState.LOADING
                    slot.task = asyncio.ensure_future(self._load(slot))
                task = slot.task
                try:
                    # Shielded: a client that gives up must not cancel a load others share.
                    await asyncio.shield(task)
                except ModelUnavailableError:
                    raise
                except Exception as exc:
                    raise ModelUnavailableError(f"model `{slot.spec.name}` failed to load: {exc}") from exc
                # An unload's task is done before `_unload` marks the slot NOT_LOADED: yield, or this
                # loop awaits the same done task forever without letting that happen.
                await asyncio.sleep(0)
            slot.last_used = self._clock()
            if adapter is not None:
                self._check_adapter_room(adapter, slot)
            if adapter is None:
                yield slot.served, slot.engine
            else:  # held until the request is queued: an adapter unload meanwhile is a 409 (lora/registry.py)
                async with self.adapters.use(adapter, slot.served, slot.engine) as served:
                    yield served, slot.engine
        finally:
            slot.num_leases -= 1
            slot.last_used = self._clock()

    async def load(self, requested: str, lora_path: str | None = None, base: str | None = None) -> None:
        """Loads a model now (an operator's request, POST /v1/models/NAME/load), as a request would. With
        `lora_path`, `requested` names a LoRA adapter at that path, served on `base` (default: the first
        model); AdapterError for a bad folder."""
        _check_key_model(requested, self.resolve)
        if lora_path is not None:
            base = self.resolve(base) if base is not None else self.names[0]
            self.adapters.add(LoraSpec(requested, lora_path, base))
        async with self.lease(requested):
            pass

    async def unload(self, requested: str) -> bool:
        """Unloads a model now (POST /v1/models/NAME/unload); False while it serves requests. Status and
        cache reads under way (a dashboard polls them every few seconds) are waited out, up to
        `_HOLDS_WAIT_S`. The next request loads it again, pinned or not."""
        _check_key_model(requested, self.resolve)
        adapter = self.adapters.find(requested)
        if adapter is not None:  # AdapterBusy while its requests run
            slot = self._slots[adapter.base]
            await self.adapters.unload(adapter, slot.engine if slot.state is ModelState.LOADED else None)
            return True
        slot = self._slots[self.resolve(requested)]
        deadline = time.monotonic() + _HOLDS_WAIT_S
        while True:
            async with self._lock:  # after a load under way; waiting between looks, other models load meanwhile
                if slot.state is not ModelState.LOADED:
                    return True
                if slot.is_idle:
                    await self._unload(slot, "asked to over HTTP")
                    return True
                if slot.is_serving or time.monotonic() >= deadline:
                    return False
            await asyncio.sleep(_POLL_S)

    # -- loading and unloading -----------------------------------------------------------------
    async def _load(self, slot: ModelSlot) -> None:
        try:
            async with self._lock:
                await self._make_room(slot)
                served, engine = await self._in_worker(self._load_and_start, slot.spec)
        except BaseException as exc:
            slot.state, slot.error = ModelState.NOT_LOADED, str(exc)
            raise
        finally:
            slot.task = None
        slot.served, slot.engine = served, engine
        self._mark_loaded(slot)

    def _mark_loaded(self, slot: ModelSlot) -> None:
        slot.state, slot.error = ModelState.LOADED, None
        self.adapters.base_loaded(slot.spec.name, slot.engine, slot.spec.loras)
        slot.last_used, slot.loaded_at = self._clock(), int(time.time())
        slot.num_loads += 1

    def _load_and_start(self, spec: ModelSpec):
        log.info("loading model %r from %s", spec.name, spec.source)
        served, engine = self._load_fn(spec)
        engine.start(self._loop)  # returns once the engine is built and warmed up
        self._started.append(engine)
        freeze_heap()
        return served, engine

    async def _unload(self, slot: ModelSlot, reason: str) -> None:
        """Under the lock: stops the engine and drops every reference before memory is released."""
        log.info("unloading model %r: %s", slot.spec.name, reason)
        slot.state = ModelState.UNLOADING
        held = [slot.served, slot.engine]
        slot.served = slot.engine = None
        slot.keep_alive_s = None  # a client's keep_alive was for that load
        slot.task = asyncio.ensure_future(self._in_worker(self._stop_and_release, held))
        try:
            await asyncio.shield(slot.task)
        finally:
            slot.state, slot.task = ModelState.NOT_LOADED, None

    def _stop_and_release(self, held: list) -> None:
        engine = held[1]
        engine.stop()
        self._started.remove(engine)
        del engine
        held.clear()
        if self._release is not None:
            self._release()

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- room ------------------------------------------------------------------------------------
    async def _make_room(self, target: ModelSlot) -> None:
        """Unloads least recently used idle unpinned models until `target` fits; waits for busy ones
        to go idle (up to busy_wait_s) when only those could make room."""
        self._check_possible(target)
        deadline = None
        while (short := self._shortfall(target)) is not None:
            reason, hard = short
            victim = self._lru_victim(target)
            if victim is not None:
                await self._unload(victim, f"room for {target.spec.name!r} ({reason})")
                continue
            if not hard:
                # Only the memory estimate says no and nothing idle can go: try anyway, the model's own
                # budget decides (waiting on busy models for an estimate would stall this request).
                log.warning("loading %r although %s: nothing idle can be unloaded", target.spec.name, reason)
                return
            if not any(not s.spec.pinned for s in self._loaded(target)):
                raise ModelUnavailableError(f"cannot load `{target.spec.name}`: {reason}, and the other "
                                            "loaded models are pinned")
            now = self._clock()
            deadline = deadline if deadline is not None else now + self._busy_wait_s
            if now >= deadline:
                raise ModelUnavailableError(f"cannot load `{target.spec.name}` now: {reason} and every "
                                            "other loaded model is busy; retry shortly")
            await asyncio.sleep(_POLL_S)

    def _loaded(self, but: ModelSlot) -> list[ModelSlot]:
        return [s for s in self._slots.values() if s is not but and s.state is ModelState.LOADED]

    def _shortfall(self, target: ModelSlot) -> tuple[str, bool] | None:
        """Why `target` does not fit next to the loaded models, and whether a configured cap says so
        (hard) or only the memory estimate; None when it fits."""
        loaded = self._loaded(target)
        if self.max_loaded_models is not None and len(loaded) >= self.max_loaded_models:
            return f"{len(loaded)} of max {self.max_loaded_models} models loaded", True
        if self.max_loaded_bytes is not None:
            used = sum(self._weight_bytes(s) for s in loaded)
            if used + target.weight_bytes > self.max_loaded_bytes:
                return (f"weights {mb(target.weight_bytes)} + {mb(used)} loaded > max "
                        f"{mb(self.max_loaded_bytes)}"), True
        elif self._free_bytes is not None and loaded:
            free = self._free_bytes()
            if free is not None and target.weight_bytes > free:
                return f"weights {mb(target.weight_bytes)} > {mb(free)} free in the memory budget", False
        return None

    def _check_possible(self, target: ModelSlot) -> None:
        """Refuses at once what unloading everything unpinned could not fix."""
        pinned = [s for s in self._loaded(target) if s.spec.pinned]
        if self.max_loaded_models is not None and len(pinned) >= self.max_loaded_models:
            raise ModelUnavailableError(f"cannot load `{target.spec.name}`: the {len(pinned)} pinned models "
                                        f"take all max {self.max_loaded_models} loaded models")
        if self.max_loaded_bytes is not None:
            floor = sum(self._weight_bytes(s) for s in pinned) + target.weight_bytes
            if floor > self.max_loaded_bytes:
                raise ModelUnavailableError(f"cannot load `{target.spec.name}`: its weights "
                                            f"{mb(target.weight_bytes)} and the pinned models' do not fit in "
                                            f"max {mb(self.max_loaded_bytes)}")

    def _weight_bytes(self, slot: ModelSlot) -> int:
        """A loaded model's weights and the LoRA adapters loaded on it."""
        return slot.weight_bytes + self.adapters.loaded_bytes(slot.spec.name, slot.engine)

    def _check_adapter_room(self, adapter, slot: ModelSlot) -> None:
        """A LoRA adapter about to load must fit --max-loaded-memory beside the loaded models (the engine
        checks its memory budget itself)."""
        if self.max_loaded_bytes is None or self.adapters.is_loaded(adapter, slot.engine):
            return
        used = sum(self._weight_bytes(s) for s in self._slots.values() if s.state is ModelState.LOADED)
        if used + adapter.files.nbytes > self.max_loaded_bytes:
            raise ModelUnavailableError(f"cannot load LoRA adapter `{adapter.spec.name}`: its weights "
                                        f"{mb(adapter.files.nbytes)} + {mb(used)} loaded > max "
                                        f"{mb(self.max_loaded_bytes)}")

    def _lru_victim(self, target: ModelSlot) -> ModelSlot | None:
        idle = [s for s in self._loaded(target) if not s.spec.pinned and s.is_idle]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def _expire_forever(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.expire_idle()
            except Exception:  # the watcher must outlive one failed unload
                log.exception("unloading idle models failed")

    async def expire_idle(self) -> list[str]:
        """Unloads unpinned models idle for longer than their ttl; returns their names."""
        now = self._clock()
        for slot in self._slots.values():
            if slot.state is ModelState.LOADED and not slot.is_idle:
                slot.last_used = now  # busy: its idle time starts when the last request ends
        done = []
        for slot in self._slots.values():
            if self._expired(slot, now):
                async with self._lock:
                    if self._expired(slot, self._clock()):  # a request may have come meanwhile
                        await self._unload(slot, f"idle for more than its ttl of {slot.ttl_s:g} s")
                        done.append(slot.spec.name)
        return done

    @staticmethod
    def _expired(slot: ModelSlot, now: float) -> bool:
        ttl = slot.ttl_s
        # A pinned model goes only when a client asks for it to go at once (keep_alive 0, `ollama stop`).
        unpinned = not slot.spec.pinned or slot.keep_alive_s == 0
        return (slot.state is ModelState.LOADED and unpinned and ttl is not None and slot.is_idle
                and now - slot.last_used >= ttl)

    def keep_alive(self, requested: str, seconds: float) -> None:
        """A client's keep_alive for a loaded model: unloaded once idle this long (inf: never for being
        idle; 0: as soon as its requests end), until it is unloaded. A pinned model ignores all but 0."""
        slot = self._slots[self.resolve(requested)]
        if slot.state is not ModelState.LOADED or (slot.spec.pinned and seconds != 0):
            return
        slot.keep_alive_s = None if seconds == float("inf") else seconds
        if slot.keep_alive_s is not None and self._expiry is None and self._loop is not None:
            self._expiry = self._loop.create_task(self._expire_forever(_KEEP_ALIVE_POLL_S))

    def expires_in(self, requested: str) -> float | None:
        """Seconds until a loaded idle model would be unloaded for its ttl; None: never for being idle."""
        slot = self._slots[self.resolve(requested)]
        if slot.ttl_s is None or (slot.spec.pinned and slot.keep_alive_s != 0):
            return None
        return max(0.0, slot.ttl_s - (self._clock() - slot.last_used)) if slot.is_idle else slot.ttl_s

    # -- what the HTTP layer shows ---------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, name: str):
        """The engine of a loaded model, kept loaded while held (None when not loaded: nothing loads).
        For status and cache calls, which must not find the engine stopped under them."""
        slot = self._slots[self.resolve(name)]
        if slot.state is not ModelState.LOADED:
            yield None
            return
        slot.num_holds += 1
        try:
            yield slot.engine
        finally:
            slot.num_holds -= 1

    def card(self, requested: str) -> dict:
        """The /v1/models entry of a model or LoRA adapter name."""
        adapter = self.adapters.find(requested)
        wanted = adapter.spec.name if adapter is not None else self.resolve(requested)
        return next(c for c in self.cards() if c["id"] == wanted)

    def loaded_engines(self) -> list:
        return [s.engine for s in self._slots.values() if s.state is ModelState.LOADED]

    def cards(self) -> list[dict]:
        """/v1/models entries: every configured model with its load state."""
        out = []
        for slot in self._slots.values():
            spec, served = slot.spec, slot.served
            card = {"id": spec.name, "object": "model", "created": slot.loaded_at or self._created,
                    "owned_by": "mlxhost", "max_model_len": served.max_model_len if served else None,
                    "status": slot.state.value, "pinned": spec.pinned, "ttl": spec.ttl_s,
                    "aliases": [a for a in spec.aliases], "weight_bytes": slot.weight_bytes}
            if slot.error:
                card["error"] = slot.error
            out.append(card)
        engines = {s.spec.name: s.engine if s.state is ModelState.LOADED else None for s in self._slots.values()}
        return out + self.adapters.cards(engines, self._created)


def _check_key_model(requested: str, resolve: Callable[[str], str]) -> None:
    """Every way to a model (requests of every API, audio, rerank, operator loads) passes here: an API key
    limited to other models gets their 404 (frontends/common/keys.py) before anything is loaded for it."""
    from mlxhost.frontends.common.keys import current_grant  # the request's key, set by the HTTP gate

    grant = current_grant.get()
    if grant is not None:
        grant.check_model(requested, resolve)
