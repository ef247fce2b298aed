"""The layout weights are served in on MLX's CPU backend.

MLX's CPU kernels for quantized and half-precision matrices are slow reference loops: SmolLM2-135M from its
Q4_1 GGUF prefilled a 44-token prompt in 207 s with 4-bit weights and float16 scales, 4.9 s with float32 scales,
6.8 s as float16, and 3.5 s as float32 (1.4 s with OpenBLAS; docs/gguf.md). So on the CPU a text model is served
as float32, dequantized, whenever that fits; one that does not fit keeps its quantized weights with float32
scales and activations. Metal and CUDA keep the weights as they are: their quantized kernels are the fast path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlxhost.memory.device import total_ram
from mlxhost.models.loader import materialize

log = logging.getLogger(__name__)

CHOICES = ("auto", "float32", "keep")
# float32 copies may take this share of the machine's RAM: the rest stays for the KV cache and everything else.
MAX_RAM_SHARE = 0.25


@dataclass(frozen=True)
class WeightPlan:
    layout: str  # "float32" (dequantized), "float32-scales" (quantized kept, floats in float32) or "keep"
    reason: str


def float32_bytes(model) -> int:
    """What the model's weights take as float32, every quantized matrix at its full size."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used

    total, counted = 0, set()
    for _, module in model.named_modules():
        if "scales" in module and isinstance(getattr(module, "bits", None), int):  # a quantized layer
            # uint32 words packing 32 / bits values each (3- and 6-bit values straddle words: no floor division)
            total += module.weight.size * 32 // module.bits * 4
            counted.update(id(module[k]) for k in ("weight", "scales", "biases") if k in module)
    for _, value in tree_flatten(model.parameters()):
        if id(value) not in counted and mx.issubdtype(value.dtype, mx.floating):
            total += value.size * 4
    return total


def plan(model, choice: str, on_cpu: bool, ram_bytes: int) -> WeightPlan:
    """Which layout `choice` ("auto", "float32" or "keep") gives this model on this backend."""
    if choice == "keep":
        return WeightPlan("keep", "--cpu-weights keep")
    if not on_cpu:
        return WeightPlan("keep", "not MLX's CPU backend: the weights' own layout is the fast one there")
    if _all_float32(model):
        return WeightPlan("keep", "already float32")
    need = float32_bytes(model)
    if choice == "float32" or need <= ram_bytes * MAX_RAM_SHARE:
        return WeightPlan("float32", f"float32 is MLX's fastest CPU layout; {need / 2**30:.2f} GiB as float32")
    return WeightPlan("float32-scales", f"float32 would take {need / 2**30:.1f} GiB, over {MAX_RAM_SHARE:.0%} of "
                                        f"{ram_bytes / 2**30:.0f} GiB RAM: quantized weights kept, floats in float32")


def apply(model, weight_plan: WeightPlan) -> None:
    """Changes the model in place to the plan's layout and evaluates it on this (the loading) thread."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx_lm.utils import dequantize_model  # lazy: mlx_lm only when used

    if weight_plan.layout == "keep":
        return
    if weight_plan.layout == "float32":
        dequantize_model(model)
    # Every floating array (scales and biases of kept quantized layers too) in float32; packed ints stay.
    model.apply(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    materialize(model)


def serve_layout(model, choice: str) -> WeightPlan:
    """Plans and applies the layout for a served text model, logging the choice in one line."""
    import mlx.core as mx  # lazy: mlx only when used

    weight_plan = plan(model, choice, mx.default_device() == mx.cpu, total_ram())
    apply(model, weight_plan)
    if weight_plan.layout != "keep" or choice != "auto" or mx.default_device() == mx.cpu:
        log.info("weights on this backend: %s (%s)", weight_plan.layout, weight_plan.reason)
    return weight_plan


def _all_float32(model) -> bool:
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used

    return all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters())
               if mx.issubdtype(v.dtype, mx.floating) or v.dtype == mx.uint32)
