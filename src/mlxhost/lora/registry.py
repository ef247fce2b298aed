"""The served LoRA adapters, on the HTTP side (no MLX): names, their base models, load state, cards.

An adapter is served as a model name of its own (`NAME`, or `BASE:NAME`); a request for it runs on its base
model's engine, its `Request.adapter` set. The engine holds the weights (manager.py); this registry only
knows which engine has an adapter loaded: a base model unloaded takes its adapters with it, and the next
request for one loads it again, as models load on first use. The `ModelManager` owns one registry.

A request holds its adapter (`use`) from the moment it is routed until it is queued on the engine, the
time its prompt is prepared: the engine cannot see it yet, so an unload meanwhile is refused here (409), as
the engine refuses one while a queued or running request uses the adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from mlxhost.config import LoraSpec, ModelSpec
from mlxhost.lora.adapters import AdapterBusy, AdapterError, AdapterFiles, adapter_id, read_adapter

log = logging.getLogger(__name__)


@dataclass
class ServedAdapter:
    spec: LoraSpec
    files: AdapterFiles
    engine: Any = None  # the base engine it is loaded in; None: not loaded
    # (the base's ServedModel, the one requests for this adapter get: the base's under its name and adapter)
    served: tuple[Any, Any] | None = None
    loaded_at: int = 0
    holders: int = 0  # requests routed to it and not yet queued on the engine (`AdapterRegistry.use`)

    @property
    def id(self) -> str:
        return adapter_id(self.spec.name, self.files)

    @property
    def base(self) -> str:
        return self.spec.base or ""


class AdapterRegistry:
    def __init__(self, specs: Sequence[ModelSpec]) -> None:
        self._models = {n: s.name for s in specs for n in (s.name, *s.aliases)}
        self._adapters: dict[str, ServedAdapter] = {}
        for spec in specs:
            for lora in spec.loras:
                # Start-up: a malformed folder is an error now (AdapterError), not at the first request.
                self.add(dataclasses.replace(lora, base=spec.name))

    # -- names ---------------------------------------------------------------------------------
    def find(self, requested: str) -> ServedAdapter | None:
        """The adapter `requested` names (NAME or BASE:NAME); None when it names no adapter."""
        adapter = self._adapters.get(requested)
        if adapter is not None:
            return adapter
        base, colon, name = requested.rpartition(":")
        adapter = self._adapters.get(name) if colon else None
        if adapter is not None and self._models.get(base) == adapter.base:
            return adapter
        return None

    def add(self, spec: LoraSpec) -> ServedAdapter:
        """Registers (or re-registers, with new files) an adapter; AdapterError for a bad folder."""
        if spec.name in self._models:
            raise AdapterError(f"LoRA adapter name {spec.name!r} is already a model's name")
        if spec.base not in self._models:
            raise AdapterError(f"LoRA adapter {spec.name!r}: base model {spec.base!r} is not served here")
        spec = dataclasses.replace(spec, base=self._models[spec.base])
        old = self._adapters.get(spec.name)
        if old is not None and old.engine is not None:
            raise AdapterError(f"LoRA adapter {spec.name!r} is loaded: unload it before loading another under its name")
        adapter = ServedAdapter(spec, read_adapter(spec.path))
        self._adapters[spec.name] = adapter
        return adapter

    def adapters_of(self, base: str) -> list[ServedAdapter]:
        return [a for a in self._adapters.values() if a.base == base]

    # -- engine state -------------------------------------------------------------------------
    def base_loaded(self, base: str, engine: Any, configured: Sequence[LoraSpec]) -> None:
        """A base model just loaded: its engine loaded the adapters configured for it while starting."""
        preloaded = {(s.name, s.path) for s in configured}
        for adapter in self.adapters_of(base):
            if (adapter.spec.name, adapter.spec.path) in preloaded:
                self._mark(adapter, engine)

    def is_loaded(self, adapter: ServedAdapter, engine: Any) -> bool:
        return engine is not None and adapter.engine is engine

    def loaded_bytes(self, base: str, engine: Any) -> int:
        return sum(a.files.nbytes for a in self.adapters_of(base) if self.is_loaded(a, engine))

    @contextlib.asynccontextmanager
    async def use(self, adapter: ServedAdapter, served: Any, engine: Any) -> AsyncIterator[Any]:
        """`attach`, held by a request until it is queued on the engine (leave it right after
        `engine.generate`): meanwhile `unload` raises AdapterBusy."""
        adapter.holders += 1
        try:
            yield await self.attach(adapter, served, engine)
        finally:
            adapter.holders -= 1

    async def attach(self, adapter: ServedAdapter, served: Any, engine: Any) -> Any:
        """The ServedModel for a request under `adapter` on its base (`served`, `engine`), loading the adapter
        into the engine first if it is not there."""
        if not self.is_loaded(adapter, engine):
            from mlxhost.lora.manager import load_adapter  # lazy: pulls in mlx

            aid, files = adapter.id, adapter.files
            await engine.call(lambda core: load_adapter(core, aid, files))
            self._mark(adapter, engine)
        if adapter.served is None or adapter.served[0] is not served:
            names = frozenset(f"{n}:{adapter.spec.name}" for n in (served.name, *served.aliases))
            adapter.served = (served, dataclasses.replace(served, name=adapter.spec.name, aliases=names,
                                                          adapter=adapter.id))
        return adapter.served[1]

    async def unload(self, adapter: ServedAdapter, engine: Any) -> None:
        """Unloads an adapter from its base's engine; AdapterBusy while requests use it."""
        if adapter.holders:
            # Their prompts are being prepared (or the adapter loaded for them): the engine has not seen them.
            raise AdapterBusy(f"LoRA adapter {adapter.spec.name!r} is serving {adapter.holders} request(s); "
                              "unload it when they end")
        if not self.is_loaded(adapter, engine):
            adapter.engine = None
            return
        from mlxhost.lora.manager import unload_adapter  # lazy: pulls in mlx

        aid = adapter.id
        # Marked unloaded first: a request arriving meanwhile queues a load behind this unload, not a request
        # for an adapter about to go.
        adapter.engine = None
        try:
            freed = await engine.call(lambda core: unload_adapter(core, aid))
        except AdapterBusy:
            self._mark(adapter, engine)
            raise
        adapter.served = None
        log.info("LoRA adapter %r unloaded (%.1f MB freed)", adapter.spec.name, freed / 1e6)

    def _mark(self, adapter: ServedAdapter, engine: Any) -> None:
        adapter.engine, adapter.loaded_at = engine, int(time.time())

    # -- what the HTTP layer shows -------------------------------------------------------------
    def cards(self, base_loaded: dict[str, Any], created: int) -> list[dict]:
        """/v1/models entries of the adapters; `base_loaded`: base name -> its engine (None: not loaded)."""
        out = []
        for adapter in self._adapters.values():
            loaded = self.is_loaded(adapter, base_loaded.get(adapter.base))
            out.append({"id": adapter.spec.name, "object": "model", "created": adapter.loaded_at or created,
                        "owned_by": "mlxhost", "parent": adapter.base, "root": adapter.base,
                        "status": "loaded" if loaded else "not_loaded", "lora_path": adapter.spec.path,
                        "lora_format": adapter.files.format, "lora_rank": adapter.files.rank,
                        "aliases": [f"{adapter.base}:{adapter.spec.name}"], "weight_bytes": adapter.files.nbytes})
        return out


def with_flag_loras(specs: tuple[ModelSpec, ...], loras: Sequence[LoraSpec]) -> tuple[ModelSpec, ...]:
    """`--lora` adapters put on their base model's spec: the one named (BASE:NAME=PATH), else the only model."""
    if not loras:
        return specs
    names = {n: s.name for s in specs for n in (s.name, *s.aliases)}
    extra: dict[str, list[LoraSpec]] = {}
    for lora in loras:
        if lora.base is None and len(specs) > 1:
            raise ValueError(f"--lora {lora.name}=...: several models are served, name the base model "
                             f"(--lora BASE:{lora.name}=PATH with BASE one of {', '.join(s.name for s in specs)})")
        base = specs[0].name if lora.base is None else names.get(lora.base)
        if base is None:
            raise ValueError(f"--lora {lora.base}:{lora.name}: no model named {lora.base!r} is served")
        extra.setdefault(base, []).append(dataclasses.replace(lora, base=base))
    return tuple(dataclasses.replace(s, loras=s.loras + tuple(extra.get(s.name, ()))) for s in specs)
