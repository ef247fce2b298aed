"""The adapters loaded onto one model, on its engine thread: load, unload, and each forward's rows.

`AdapterSet` is the single owner of the wrapped layers and their stacks. Loading an adapter wraps the layers
it names (the first time any adapter names them) and appends its weights to their stacks as a new slot;
unloading removes its slot, and a layer no adapter names any more gets its base layer back, so a model with
no adapters left is the model as loaded. The runner brackets each forward with `rows(adapter_ids)`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_unflatten

from mlxserve.lora.adapters import AdapterBusy, AdapterError, AdapterFiles, AdapterNoRoom
from mlxserve.lora.layers import MultiLoRALinear, RowAdapters, linear_dims
from mlxserve.memory.budget import MemoryBudgetError

log = logging.getLogger(__name__)


@dataclass
class _Loaded:
    files: AdapterFiles
    ranks: dict[str, int]  # module path -> rank, for the layers it adapts
    nbytes: int


class AdapterSet:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.row_state = RowAdapters()
        self.layers: dict[str, MultiLoRALinear] = {}  # module path -> wrapper in the model
        self.slots: list[str] = [""]  # slot -> adapter id; slot 0: no adapter
        self._loaded: dict[str, _Loaded] = {}
        self._scales: dict[str, float] = {"": 0.0}
        self._last: tuple | None = None  # (adapter ids, index, scales) of the last forward's rows
        self.charged_bytes = 0  # what the memory budget counts for the adapters (load_adapter)

    # -- what is loaded -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._loaded)

    def has(self, adapter_id: str) -> bool:
        return not adapter_id or adapter_id in self._loaded

    def check(self, adapter_id: str) -> None:
        """Raises for a request whose adapter is not (any more) loaded: it fails alone."""
        if not self.has(adapter_id):
            raise AdapterError(f"LoRA adapter {adapter_id.rsplit('@', 1)[0]!r} is not loaded (it was unloaded)")

    @property
    def nbytes(self) -> int:
        """Bytes the stacks hold (padding to the largest rank and zero slots included)."""
        return sum(a.nbytes + b.nbytes for layer in self.layers.values() for a, b in [layer.stacks])

    def stats(self) -> dict:
        return {"num_adapters": len(self._loaded), "num_layers": len(self.layers), "memory_bytes": self.nbytes,
                "adapters": {aid: {"rank": f.files.rank, "scale": f.files.scale, "num_modules": len(f.ranks),
                                   "format": f.files.format} for aid, f in self._loaded.items()}}

    # -- forwards -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, adapter_ids: Sequence[str]) -> Iterator[None]:
        """The forward run inside runs row i under adapter `adapter_ids[i]` ('' for none). A forward only
        builds the graph, which keeps the index arrays it read, so they are cleared again on exit."""
        if not self._loaded or not any(adapter_ids):
            yield
            return
        key = tuple(adapter_ids)
        if self._last is None or self._last[0] != key:
            slot_of = {aid: i for i, aid in enumerate(self.slots)}
            for aid in key:
                self.check(aid)
            index = mx.array([slot_of[a] for a in key], dtype=mx.int32)
            scales = mx.array([self._scales[a] for a in key], dtype=mx.float32)[:, None, None]
            self._last = (key, index, scales)
        state = self.row_state
        state.index, state.scales = self._last[1], self._last[2]
        try:
            yield
        finally:
            state.index = state.scales = None

    def rows_of(self, row_ids: Sequence[str | None], requests: dict) -> list[str]:
        """Adapter ids of a decode batch's rows (fillers and unknown rows: none)."""
        return [getattr(requests.get(rid), "adapter", "") if rid is not None else "" for rid in row_ids]

    # -- loading --------------------------------------------------------------------------------
    def load(self, adapter_id: str, files: AdapterFiles) -> int:
        """Adds an adapter as a new slot of every layer; returns the bytes it added. AdapterError when its
        modules do not fit the model (nothing changes then)."""
        if adapter_id in self._loaded:
            return 0
        targets = self._targets(files)
        weights = mx.load(files.weights_file)
        before = self.nbytes
        pairs = {}
        for m in files.modules:
            a, b = weights[m.key_a], weights[m.key_b]
            if files.transposed:
                a, b = a.T, b.T
            pairs[m.path] = (a, b)
        for path, layer in targets.items():
            if path not in self.layers:
                self.layers[path] = layer = MultiLoRALinear(layer, self.row_state, *linear_dims(layer))
                self.model.update_modules(tree_unflatten([(path, layer)]))
        num_slots = len(self.slots)
        for path, layer in self.layers.items():
            a_new, b_new = pairs.get(path, (None, None))
            layer.set_stacks(*_append(layer, num_slots, a_new, b_new))
        self.slots.append(adapter_id)
        self._scales[adapter_id] = files.scale
        self._loaded[adapter_id] = _Loaded(files, {m.path: m.rank for m in files.modules}, 0)
        self._last = None
        mx.eval([s for layer in self.layers.values() for s in layer.stacks])
        added = self.nbytes - before
        self._loaded[adapter_id].nbytes = added
        log.info("LoRA adapter %s loaded from %s (%s, rank %d, scale %g, %d layers, %.1f MB)", adapter_id,
                 files.path, files.format, files.rank, files.scale, len(files.modules), added / 1e6)
        return added

    def unload(self, adapter_id: str) -> int:
        """Removes an adapter's slot; layers no adapter adapts any more get their base layer back. Returns
        the bytes freed. The caller makes sure no running request uses it."""
        if adapter_id not in self._loaded:
            return 0
        before = self.nbytes
        slot = self.slots.index(adapter_id)
        keep = mx.array([i for i in range(len(self.slots)) if i != slot], dtype=mx.int32)
        del self._loaded[adapter_id], self._scales[adapter_id]
        self.slots.pop(slot)
        self._last = None
        for path, layer in list(self.layers.items()):
            rank = max((f.ranks[path] for f in self._loaded.values() if path in f.ranks), default=0)
            if rank == 0:  # nobody adapts this layer now: the base layer goes back in its place
                self.model.update_modules(tree_unflatten([(path, layer.linear)]))
                del self.layers[path]
                continue
            a, b = layer.stacks
            layer.set_stacks(mx.take(a, keep, axis=0)[..., :rank], mx.take(b, keep, axis=0)[:, :rank, :])
        mx.eval([s for layer in self.layers.values() for s in layer.stacks])
        return before - self.nbytes

    def _targets(self, files: AdapterFiles) -> dict[str, Any]:
        """The model's layers the adapter names, checked: each must exist, be a linear layer and have the
        adapter's sizes."""
        modules = dict(self.model.named_modules())
        found = {}
        for m in files.modules:
            layer = modules.get(m.path)
            if layer is None:
                raise AdapterError(f"the adapter at {files.path} adapts {m.path!r}, which this model does not have"
                                   f" (was it trained on another base model?)")
            dims = linear_dims(layer)
            if dims is None:
                raise AdapterError(f"the adapter at {files.path} adapts {m.path!r}, a {type(layer).__name__}: only "
                                   "linear layers are served")
            if dims != (m.in_dims, m.out_dims):
                raise AdapterError(f"the adapter at {files.path} has {m.path!r} as {m.in_dims} -> {m.out_dims}; "
                                   f"this model's is {dims[0]} -> {dims[1]} (another base model?)")
            if isinstance(layer, MultiLoRALinear) and self.layers.get(m.path) is not layer:
                raise RuntimeError("this model's layers are wrapped by another AdapterSet: one set per model")
            found[m.path] = layer.linear if isinstance(layer, MultiLoRALinear) else layer
        return found


def _append(layer: MultiLoRALinear, num_slots: int, a_new: mx.array | None, b_new: mx.array | None):
    """The layer's stacks with one more slot: the adapter's pair, or zeros where it leaves the layer alone.
    Ranks are padded with zeros to the largest, which adds exact zeros to each row's delta."""
    a, b = layer.stacks
    old_rank = a.shape[-1] if a is not None else 0
    rank = max(old_rank, a_new.shape[-1] if a_new is not None else 0)
    dtype = _dtype(a, a_new)
    if a is None:
        a = mx.zeros((num_slots, layer.in_dims, rank), dtype)
        b = mx.zeros((num_slots, rank, layer.out_dims), dtype)
    elif rank > old_rank or a.dtype != dtype:
        a = mx.pad(a.astype(dtype), [(0, 0), (0, 0), (0, rank - old_rank)])
        b = mx.pad(b.astype(dtype), [(0, 0), (0, rank - old_rank), (0, 0)])
    if a_new is None:
        a_new = mx.zeros((layer.in_dims, rank), dtype)
        b_new = mx.zeros((rank, layer.out_dims), dtype)
    else:
        pad = rank - a_new.shape[-1]
        a_new = mx.pad(a_new.astype(dtype), [(0, 0), (0, pad)])
        b_new = mx.pad(b_new.astype(dtype), [(0, pad), (0, 0)])
    return mx.concatenate([a, a_new[None]]), mx.concatenate([b, b_new[None]])


def _dtype(a: mx.array | None, a_new: mx.array | None):
    """One dtype per stack: the widest of the adapters' (they are usually all float32 or all bfloat16)."""
    kinds = [x.dtype for x in (a, a_new) if x is not None]
    if not kinds:
        return mx.float32
    return kinds[0] if len(set(kinds)) == 1 else mx.float32


def load_adapter(core: Any, adapter_id: str, files: AdapterFiles) -> int:
    """On the engine thread: loads an adapter into the core's model (a no-op when it is loaded) and charges
    its bytes to the memory budget. Returns the bytes the adapters hold now."""
    lora = core.runner.lora
    if not lora.has(adapter_id):
        if getattr(core.runner.model, "is_vlm", False):
            raise AdapterError("LoRA adapters are served on text models only")
        lora.load(adapter_id, files)
        try:
            _charge(core)
        except MemoryBudgetError as exc:
            lora.unload(adapter_id)  # it does not fit: nothing stays loaded
            raise AdapterNoRoom(f"no room for LoRA adapter {adapter_id.rsplit('@', 1)[0]!r}: {exc}") from None
    return lora.nbytes


def unload_adapter(core: Any, adapter_id: str) -> int:
    """On the engine thread: unloads an adapter no request uses and gives its memory back; returns the bytes
    freed. AdapterBusy while a running or waiting request uses it."""
    scheduler = core.scheduler
    users = [r.request_id for r in (*scheduler.running.values(), *scheduler.waiting) if r.adapter == adapter_id]
    if users:
        raise AdapterBusy(f"LoRA adapter {adapter_id.rsplit('@', 1)[0]!r} is serving {len(users)} "
                               "request(s); unload it when they end")
    freed = core.runner.lora.unload(adapter_id)
    _charge(core)
    from mlxserve.memory.release import give_back_memory

    give_back_memory()
    return freed


def _charge(core: Any) -> None:
    """The budget's fixed part follows what the adapters hold (their bytes leave the KV share)."""
    lora, governor = core.runner.lora, getattr(core, "governor", None)
    held = lora.nbytes
    if governor is not None and held != lora.charged_bytes:
        governor.hold_fixed(held - lora.charged_bytes)
    lora.charged_bytes = held


def load_configured(core: Any, loras: Sequence[Any]) -> None:
    """On the engine thread as it starts: the adapters configured for this model (LoraSpec: --lora, a models
    file), so one that does not fit the model fails the model's load with the reason."""
    from mlxserve.lora.adapters import adapter_id, read_adapter

    for lora in loras:
        files = read_adapter(lora.path)
        try:
            load_adapter(core, adapter_id(lora.name, files), files)
        except AdapterError as exc:
            raise AdapterError(f"LoRA adapter {lora.name!r} ({lora.path}): {exc}") from None
