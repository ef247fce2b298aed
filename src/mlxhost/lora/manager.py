"""The adapters loaded onto one model, on its engine thread: load, unload, and each forward's rows.

`AdapterSet` is the single owner of the wrapped layers and their stacks. Loading an adapter wraps the layers
it names (the first time any adapter names them) and appends its weights to theirs as a new block;
unloading removes its block, and a layer no adapter names any more gets its base layer back, so a model with
no adapters left is the model as loaded. The runner brackets each forward with `rows(adapter_ids)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxhost.lora.adapters import AdapterBusy, AdapterError, AdapterFiles, AdapterNoRoom, adapter_id, read_adapter
from mlxhost.lora.fused import CudaFused
from mlxhost.lora.layers import MultiLoRALinear, RowAdapters, group_layers, layer_bytes, linear_dims
from mlxhost.memory.budget import MemoryBudgetError
from mlxhost.memory.release import give_back_memory
from mlxhost.platform import backend

log = logging.getLogger(__name__)


@dataclass
class _Loaded:
    files: AdapterFiles
    ranks: dict[str, int]  # module path -> rank, for the layers it adapts
    nbytes: int


class AdapterSet:
    def __init__(self, model: Any, layout: str | None = None, fused=None) -> None:
        self.model = model
        # The layers' layout (layers.py): fused on MLX-CUDA, dense elsewhere; MLXHOST_LORA_LAYOUT=dense|gather|fused
        # picks one (for benchmarks). `fused`: the fused layout's kernel (fused.py), else MLX-CUDA's own.
        self.layout, self.fused = _layout(layout, fused)
        self.gather = self.layout != "dense"  # the fused layout keeps the gathered stacks
        self.row_state = RowAdapters()
        self.layers: dict[str, MultiLoRALinear] = {}  # module path -> wrapper in the model
        self.slots: list[str] = []  # adapter ids, in the order of their blocks in every layer
        self.rank = 0  # every block's width: the largest loaded rank
        self.dtype = None  # of every layer's adapter matrices
        self._loaded: dict[str, _Loaded] = {}
        self._last: tuple | None = None  # (adapter ids, *_row_arrays) of the last forward's rows
        self.charged_bytes = 0  # what the memory budget counts for the adapters (load_adapter)
        self._warmed: set[tuple] = set()  # fused kernel shapes compiled so far (_settle)

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
        """Bytes the adapters' matrices hold (padding to the largest rank and zero blocks included)."""
        return layer_bytes(self.layers)

    def stats(self) -> dict:
        return {"num_adapters": len(self._loaded), "num_layers": len(self.layers), "memory_bytes": self.nbytes,
                "adapters": {aid: {"rank": f.files.rank, "scale": f.files.scale, "num_modules": len(f.ranks),
                                   "format": f.files.format} for aid, f in self._loaded.items()}}

    # -- forwards -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, adapter_ids: Sequence[str]) -> Iterator[None]:
        """The forward run inside runs row i under adapter `adapter_ids[i]` ('' for none). A forward only
        builds the graph, which keeps the arrays it read, so they are cleared again on exit."""
        if not self._loaded or not any(adapter_ids):
            yield
            return
        key = tuple(adapter_ids)
        if self._last is None or self._last[0] != key:
            self._last = (key, *self._row_arrays(key))
        self.row_state.set(*self._last[1:])
        try:
            yield
        finally:
            self.row_state.set(None)

    def _row_arrays(self, key: tuple[str, ...]) -> tuple:
        """(dense scales [B, 1, K*R], gathered slots [B], gathered scales [B, 1, 1]) for these rows."""
        for aid in key:
            self.check(aid)
        block = {aid: i for i, aid in enumerate(self.slots)}
        scale = mx.array([self._loaded[a].files.scale if a else 0.0 for a in key], dtype=mx.float32)
        if self.gather:
            index = mx.array([block[a] + 1 if a else 0 for a in key], dtype=mx.int32)
            return None, index, scale[:, None, None]
        index = mx.array([block.get(a, -1) for a in key], dtype=mx.int32)
        columns = mx.arange(len(self.slots) * self.rank, dtype=mx.int32) // self.rank
        scales = mx.where(columns[None, :] == index[:, None], scale[:, None], 0.0).astype(mx.float32)
        return scales[:, None, :], None, None

    def rows_of(self, row_ids: Sequence[str | None], requests: dict) -> list[str]:
        """Adapter ids of a decode batch's rows (fillers and unknown rows: none); nothing to look up while no
        adapter is loaded."""
        if not self._loaded:
            return []
        return [getattr(requests.get(rid), "adapter", "") if rid is not None else "" for rid in row_ids]

    # -- loading --------------------------------------------------------------------------------
    def load(self, adapter_id: str, files: AdapterFiles) -> int:
        """Adds an adapter as a new block of every wrapped layer; returns the bytes it added. AdapterError
        when its modules do not fit the model (nothing changes then)."""
        if adapter_id in self._loaded:
            return 0
        targets = self._targets(files)
        weights = mx.load(files.weights_file)
        before = self.nbytes
        pairs = {}
        for m in files.modules:
            a, b = weights[m.key_a], weights[m.key_b]
            pairs[m.path] = (a.T, b.T) if files.transposed else (a, b)
        dtype = _dtype(self.dtype, [a.dtype for a, _ in pairs.values()])
        for path, layer in targets.items():
            if path not in self.layers:
                self.layers[path] = layer = MultiLoRALinear(layer, self.row_state, *linear_dims(layer))
                self.model.update_modules(tree_unflatten([(path, layer)]))
        rank, num = max(self.rank, files.rank), len(self.slots)
        new = {}
        for path, layer in self.layers.items():
            a, b = _blocks(layer, num, self.rank, rank, dtype)
            a_new, b_new = pairs.get(path, (None, None))
            if a_new is None:
                a_new, b_new = mx.zeros((layer.in_dims, rank), dtype), mx.zeros((rank, layer.out_dims), dtype)
            else:
                pad = rank - a_new.shape[-1]
                a_new = mx.pad(a_new.astype(dtype), [(0, 0), (0, pad)])
                b_new = mx.pad(b_new.astype(dtype), [(0, pad), (0, 0)])
            a = mx.concatenate([a, a_new[:, None, :]], axis=1).reshape(layer.in_dims, (num + 1) * rank)
            b = mx.concatenate([b, b_new[None]], axis=0).reshape((num + 1) * rank, layer.out_dims)
            new[path] = (a, b)
        group_layers(self.layers, new, rank if self.gather else 0, self.fused)
        self.slots.append(adapter_id)
        self.rank, self.dtype, self._last = rank, dtype, None
        self._loaded[adapter_id] = _Loaded(files, {m.path: m.rank for m in files.modules}, 0)
        self._settle()
        added = self.nbytes - before
        self._loaded[adapter_id].nbytes = added
        log.info("LoRA adapter %s loaded from %s (%s, rank %d, scale %g, %d layers, %.1f MB)", adapter_id,
                 files.path, files.format, files.rank, files.scale, len(files.modules), added / 1e6)
        return added

    def unload(self, adapter_id: str) -> int:
        """Removes an adapter's block; layers no adapter adapts any more get their base layer back. Returns
        the bytes freed. The caller makes sure no running request uses it."""
        if adapter_id not in self._loaded:
            return 0
        before = self.nbytes
        num, old_rank = len(self.slots), self.rank
        keep = mx.array([i for i, aid in enumerate(self.slots) if aid != adapter_id], dtype=mx.int32)
        del self._loaded[adapter_id]
        self.slots.remove(adapter_id)
        self.rank = max((f.files.rank for f in self._loaded.values()), default=0)
        self._last = None
        new = {}
        for path, layer in list(self.layers.items()):
            if not any(path in f.ranks for f in self._loaded.values()):
                # Nobody adapts this layer now: the base layer goes back in its place.
                self.model.update_modules(tree_unflatten([(path, layer.linear)]))
                del self.layers[path]
                continue
            a, b = _blocks(layer, num, old_rank, old_rank, self.dtype)
            a = mx.take(a, keep, axis=1)[..., : self.rank].reshape(layer.in_dims, -1)
            b = mx.take(b, keep, axis=0)[:, : self.rank].reshape(-1, layer.out_dims)
            new[path] = (a, b)
        group_layers(self.layers, new, self.rank if self.gather else 0, self.fused)
        if not self._loaded:
            self.dtype = None
        self._settle()
        return before - self.nbytes

    def _settle(self) -> None:
        """Evaluates the new matrices now, so the old ones are freed and no forward builds them; in the fused
        layout also compiles the kernel for each group shape not seen yet."""
        mx.eval([a for layer in self.layers.values() for a in layer.arrays])
        if self.fused is None:
            return
        dtype = _activation_dtype(self.model)
        for layer in self.layers.values():
            group = layer._fused
            key = (group.signature(), dtype) if group is not None else None
            if key is not None and key not in self._warmed:
                group.warm(dtype)
                self._warmed.add(key)

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
            found[m.path] = layer
        return found


LAYOUTS = ("dense", "gather", "fused")


def _layout(choice: str | None, fused) -> tuple[str, Any]:
    """(layout, fused kernel or None). The fused layout needs a kernel: MLX-CUDA's (fused.py), only where MLX
    computes on CUDA, or the one passed in (tests); without one it falls back to the gathered ops."""
    choice = choice or os.environ.get("MLXHOST_LORA_LAYOUT", "")
    if choice not in LAYOUTS:
        choice = "fused" if backend.is_cuda() else "dense"
    if choice != "fused":
        return choice, None
    if fused is None and backend.is_cuda():
        fused = CudaFused()
    return ("fused", fused) if fused is not None else ("gather", None)


def _blocks(layer: MultiLoRALinear, num: int, rank: int, new_rank: int, dtype):
    """The layer's matrices as blocks, A [in, num, new_rank] and B [num, new_rank, out], padded with zeros
    from `rank` (zero blocks for a layer wrapped just now). Zero padding adds exact zeros to each row's delta."""
    a, b = layer.weights
    if a is None:
        return (mx.zeros((layer.in_dims, num, new_rank), dtype), mx.zeros((num, new_rank, layer.out_dims), dtype))
    a, b = a.reshape(layer.in_dims, num, rank).astype(dtype), b.reshape(num, rank, layer.out_dims).astype(dtype)
    if new_rank > rank:
        a = mx.pad(a, [(0, 0), (0, 0), (0, new_rank - rank)])
        b = mx.pad(b, [(0, 0), (0, new_rank - rank), (0, 0)])
    return a, b


def _activation_dtype(model: Any):
    """The dtype a model computes in: that of its first floating parameter (a quantized layer's scales)."""
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def _dtype(current, new: list):
    """One dtype for every adapter matrix: the adapters' own when they agree (usually all float32 or all
    bfloat16), float32 when they do not."""
    kinds = set(new) | ({current} if current is not None else set())
    return kinds.pop() if len(kinds) == 1 else mx.float32


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
    for lora in loras:
        files = read_adapter(lora.path)
        try:
            load_adapter(core, adapter_id(lora.name, files), files)
        except AdapterError as exc:
            raise AdapterError(f"LoRA adapter {lora.name!r} ({lora.path}): {exc}") from None
