"""A served model's load state (one slot per configured model); the model manager (manager.py) owns the
slots. The errors a lookup or a load raises live in serving/model.py, where the front doors read them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from mlxhost.config import ModelSpec


class ModelState(str, Enum):
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass
class ModelSlot:
    """One configured model: its spec, load state, and what holds it loaded."""
    spec: ModelSpec
    weight_bytes: int
    state: ModelState = ModelState.NOT_LOADED
    served: Any = None  # ServedModel while loaded
    engine: Any = None  # AsyncEngine while loaded (started)
    last_used: float = 0.0
    # Requests holding or waiting for this model: a leased model is never unloaded.
    num_leases: int = 0
    # Status and cache reads under way (ModelManager.hold): short, so an unload asked for waits them out.
    num_holds: int = 0
    task: asyncio.Future | None = None  # the load or unload in progress
    error: str | None = None  # why the last load failed
    loaded_at: int = 0  # unix time, the card's `created`
    num_loads: int = 0
    # A client's idle ttl for this load (Ollama's keep_alive), over the spec's; None: the spec's.
    keep_alive_s: float | None = None

    @property
    def ttl_s(self) -> float | None:
        return self.keep_alive_s if self.keep_alive_s is not None else self.spec.ttl_s

    @property
    def is_serving(self) -> bool:
        return self.num_leases > 0 or (self.engine is not None and self.engine.num_active > 0)

    @property
    def is_idle(self) -> bool:
        return not self.is_serving and self.num_holds == 0


Loader = Callable[[ModelSpec], "tuple[Any, Any]"]  # spec -> (ServedModel, AsyncEngine not yet started)


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
