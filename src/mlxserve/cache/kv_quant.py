"""Which layers hold quantized KV under `--kv-bits`, decided once per model (this module touches MLX).

Only plain attention caches (mlx-lm's `KVCache`) are quantized, the layers mlx-lm's own
`maybe_quantize_kv_cache` converts too. The others keep their float caches:
  * sliding-window layers (`RotatingKVCache`): mlx-lm has no quantized rotating cache;
  * recurrent state (`ArraysCache`): a fixed-size state, never quantized;
  * MLA layers (keys and values of different widths): DeepSeek's attention multiplies the rope part
    of the cache directly, which a quantized tuple cannot serve.
A model whose attention still fails with quantized caches (e.g. attention sinks, gpt-oss) keeps float
KV everywhere; the plan says why, and `/v1/status` shows it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxserve.cache.quantized_batch import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantizedRowKVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVQuantPlan:
    bits: int
    group_size: int
    layers: tuple[int, ...]  # layers whose KV is quantized
    num_layers: int
    note: str = ""  # why some layers (or all) stay float

    @property
    def label(self) -> str:
        """What the SSD tier's header records: blocks written under other settings are foreign."""
        # Which layers are quantized follows from the model (in the header too) and these settings.
        return f"{self.bits}bit-g{self.group_size}" if self.layers else ""

    def make_cache(self, model: Any) -> list[Any]:
        """mlx-lm's prompt cache with the planned layers swapped for quantized ones."""
        cache = make_prompt_cache(model)
        for i in self.layers:
            cache[i] = QuantizedRowKVCache(group_size=self.group_size, bits=self.bits)
        return cache

    def status(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "quantized_layers": len(self.layers),
                "num_layers": self.num_layers, "note": self.note or None}


def check_kv_quant_flags(bits: int | None, group_size: int) -> None:
    if bits is not None and bits not in SUPPORTED_BITS:
        raise ValueError(f"kv_bits must be one of {SUPPORTED_BITS} (or unset for float KV), got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")


def plan_kv_quant(model: Any, bits: int | None, group_size: int) -> KVQuantPlan | None:
    """The quantization plan for `model`, or None when `bits` is None. Raises ValueError when the
    group size does not divide a quantizable layer's head dim."""
    if bits is None:
        return None
    check_kv_quant_flags(bits, group_size)
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)  # shapes of each layer's keys and values
    candidates, widths, notes = [], set(), []
    for i, c in enumerate(cache):
        if type(c) is not KVCache:
            continue
        if c.keys.shape[-1] != c.values.shape[-1]:
            notes.append("MLA layers (keys and values of different widths) keep float KV")
            continue
        candidates.append(i)
        widths.add(c.keys.shape[-1])
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        fits = [g for g in SUPPORTED_GROUP_SIZES if bad[0] % g == 0]
        hint = f"; try --kv-group-size {max(fits)}" if fits else ""
        raise ValueError(f"kv_group_size {group_size} must divide the attention head dim ({bad[0]}){hint}")
    kinds = {type(c).__name__ for i, c in enumerate(cache) if type(c) is not KVCache}
    if kinds:
        notes.append(f"{', '.join(sorted(kinds))} layers keep float caches")
    plan = KVQuantPlan(bits, group_size, tuple(candidates), len(cache), "; ".join(dict.fromkeys(notes)))
    if candidates:
        try:
            # Two tokens, then one: the prefill (mask) and decode paths of the quantized attention.
            probe = plan.make_cache(model)
            mx.eval(model(mx.array([[0, 1]]), cache=probe), model(mx.array([[2]]), cache=probe))
        except Exception as exc:  # e.g. "Quantized SDPA does not support attention sinks."
            note = f"this model's attention cannot read quantized KV ({exc}): float KV"
            log.warning("--kv-bits %d: %s", bits, note)
            return KVQuantPlan(bits, group_size, (), len(cache), note)
    else:
        log.warning("--kv-bits %d: no layer of this model can hold quantized KV (%s)", bits, plan.note)
    return plan
