"""Which layers hold quantized KV under `--kv-bits`, and how attention reads it, decided once per model
(this module touches MLX).

Only layers whose kind can be quantized (registry.py: the plain kind, mlx-lm's `KVCache`) are, the layers mlx-lm's own
`maybe_quantize_kv_cache` converts too. The others keep their float caches:
  * sliding-window layers (`RotatingKVCache`): mlx-lm has no quantized rotating cache;
  * recurrent state (`ArraysCache`): a fixed-size state, never quantized;
  * MLA layers (keys and values of different widths): DeepSeek's attention multiplies the rope part
    of the cache directly, which a quantized tuple cannot serve.
Attention reads the quantized KV through MLX's quantized matmuls where they run this model's shapes.
Where they raise (MLX-CUDA's kernels reject mlx-lm's GQA broadcast; attention sinks, gpt-oss), each
layer's KV is dequantized for float attention instead: the same bytes kept, the float copy transient.
A model whose attention fails both ways keeps float KV everywhere; the plan says why, and `/v1/status`
shows it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.kv.kinds import KINDS
from mlxhost.kv.kinds.quantized import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, QuantizedRowKVCache

log = logging.getLogger(__name__)

# "auto": quantized attention where the probe runs it, else dequantized per layer.
KV_QUANT_MODES = ("auto", "quantized", "dequantized")
QUANTIZED_ATTENTION, DEQUANTIZED = "quantized attention", "dequantized per layer"


@dataclass(frozen=True)
class KVQuantPlan:
    bits: int
    group_size: int
    layers: tuple[int, ...]  # layers whose KV is quantized
    num_layers: int
    note: str = ""  # why some layers (or all) stay float, or why attention dequantizes
    dequantize: bool = False  # attention reads float copies of each layer's KV, not the quantized KV

    @property
    def label(self) -> str:
        """What the SSD tier's header records: blocks written under other settings are foreign."""
        # Which layers are quantized follows from the model (in the header too) and these settings.
        # Both attention modes keep the same bytes, so they share blocks.
        return f"{self.bits}bit-g{self.group_size}" if self.layers else ""

    @property
    def attention(self) -> str | None:
        if not self.layers:
            return None
        return DEQUANTIZED if self.dequantize else QUANTIZED_ATTENTION

    def make_cache(self, model: Any) -> list[Any]:
        """mlx-lm's prompt cache with the planned layers swapped for quantized ones."""
        cache = make_prompt_cache(model)
        for i in self.layers:
            cache[i] = QuantizedRowKVCache(group_size=self.group_size, bits=self.bits, dequantize=self.dequantize)
        return cache

    def status(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "quantized_layers": len(self.layers),
                "num_layers": self.num_layers, "attention": self.attention, "note": self.note or None}


def check_kv_quant_flags(bits: int | None, group_size: int, mode: str = "auto") -> None:
    if bits is not None and bits not in SUPPORTED_BITS:
        raise ValueError(f"kv_bits must be one of {SUPPORTED_BITS} (or unset for float KV), got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if mode not in KV_QUANT_MODES:
        raise ValueError(f"kv_quant_mode must be one of {KV_QUANT_MODES}, got {mode!r}")


def probe_attention(model: Any, plan: KVQuantPlan) -> None:
    """Runs `model` on `plan`'s caches the way the engine does; raises what its attention raises.

    Two prompts of several tokens, each one request's prefill (every query head of a GQA group against
    the quantized keys), then one decode step of both rows in one batch cache (left padding, the mask)."""
    rows, lengths = [], (33, 7)
    for n in lengths:
        cache = plan.make_cache(model)
        mx.eval(model(mx.arange(1, n + 1)[None], cache=cache))
        rows.append(cache)
    if KINDS.can_batch(rows[0]):
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
        # A VLM's batch decode takes each row's position, as the runner gives it.
        kw = {"positions": mx.array([[n] for n in lengths])} if getattr(model, "is_vlm", False) else {}
        mx.eval(model(mx.array([[2], [3]]), cache=batch, **kw))
    else:  # caches without a batch version decode one request at a time
        mx.eval(model(mx.array([[2]]), cache=rows[0]))


def plan_kv_quant(model: Any, bits: int | None, group_size: int, mode: str = "auto",
                  probe: Callable[[Any, KVQuantPlan], None] = probe_attention) -> KVQuantPlan | None:
    """The quantization plan for `model`, or None when `bits` is None. `mode` picks the attention:
    "quantized", "dequantized", or "auto" (the first of the two that `probe` runs). Raises ValueError
    when the group size does not divide a quantizable layer's head dim."""
    if bits is None:
        return None
    check_kv_quant_flags(bits, group_size, mode)
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)  # shapes of each layer's keys and values
    candidates, widths, notes = [], set(), []
    for i, c in enumerate(cache):
        if not KINDS.can_quantize(c):
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
    kinds = {type(c).__name__ for c in cache if not KINDS.can_quantize(c)}
    if kinds:
        notes.append(f"{', '.join(sorted(kinds))} layers keep float caches")
    plan = KVQuantPlan(bits, group_size, tuple(candidates), len(cache), "; ".join(dict.fromkeys(notes)),
                       dequantize=mode == "dequantized")
    if not candidates:
        log.warning("--kv-bits %d: no layer of this model can hold quantized KV (%s)", bits, plan.note)
        return plan
    return _probe_modes(model, plan, mode, probe)


def _probe_modes(model: Any, plan: KVQuantPlan, mode: str,
                 probe: Callable[[Any, KVQuantPlan], None]) -> KVQuantPlan:
    """`plan` in the first attention mode `probe` runs without raising, else float KV with the reasons."""
    failures = []
    for dequantize in ((False, True) if mode == "auto" else (mode == "dequantized",)):
        trial = dataclasses.replace(plan, dequantize=dequantize)
        try:
            probe(model, trial)
        except Exception as exc:  # e.g. "[quantized_matmul] No implementation for problem shape: ..."
            failures.append(f"{trial.attention} failed ({exc})")
            continue
        if failures:  # auto: the quantized matmuls raised, dequantizing works
            note = f"{failures[0]}: KV {DEQUANTIZED} for float attention"
            log.warning("--kv-bits %d: %s", plan.bits, note)
            return dataclasses.replace(trial, note="; ".join(n for n in (plan.note, note) if n))
        return trial
    note = f"this model's attention cannot read quantized KV ({'; '.join(failures)}): float KV"
    log.warning("--kv-bits %d: %s", plan.bits, note)
    return KVQuantPlan(plan.bits, plan.group_size, (), plan.num_layers, note)
