"""What a saved .mlpackage holds, read through coremltools' spec and MIL APIs (works on Linux, where
packages cannot run): inputs with their ranged dims, states, the program's op types, and the block-wise
quantized weights. `mlxhost export coreml` prints it; the tests assert on it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

BLOCKWISE_OP = "constexpr_blockwise_shift_scale"  # iOS 18 / macOS 15 block-wise (de)quantization


@dataclass(frozen=True)
class QuantizedWeight:
    name: str  # the MIL op's name
    dtype: str  # of the stored data, e.g. "int4"
    shape: tuple[int, ...]
    block_shape: tuple[int, ...]  # elements sharing one scale, per axis (data shape / scale shape)


@dataclass
class PackageSummary:
    # name -> per-axis (lower, upper) bounds; a fixed dim has lower == upper
    inputs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    states: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype)
    outputs: list[str] = field(default_factory=list)
    dtypes: dict[str, str] = field(default_factory=dict)  # input / output name -> array dtype
    output_shapes: dict[str, tuple] = field(default_factory=dict)  # from the program; None: a flexible dim
    op_counts: Counter = field(default_factory=Counter)
    quantized: list[QuantizedWeight] = field(default_factory=list)
    spec_version: int = 0
    size_bytes: int = 0

    def describe(self) -> str:
        def dims(bounds):
            return "(" + ", ".join(str(lo) if lo == hi else f"[{lo}, {hi}]" for lo, hi in bounds) + ")"

        lines = ["inputs: " + ", ".join(f"{k} {dims(v)}" for k, v in self.inputs.items()),
                 "states: " + ", ".join(f"{k} {shape} {dtype}" for k, (shape, dtype) in self.states.items()),
                 "outputs: " + ", ".join(f"{k} {self._shape(k)}" for k in self.outputs),
                 f"fused scaled_dot_product_attention ops: {self.op_counts.get('scaled_dot_product_attention', 0)}"]
        if self.quantized:
            blocks = sorted({(w.dtype, w.block_shape) for w in self.quantized})
            lines.append(f"quantized weights: {len(self.quantized)} ({', '.join(f'{d} blocks {b}' for d, b in blocks)})")
        lines.append(f"package size: {self.size_bytes / 1e6:.1f} MB")
        return "\n".join(lines)

    def _shape(self, name: str) -> str:
        shape = self.output_shapes.get(name)
        return "" if shape is None else "(" + ", ".join("n" if d is None else str(d) for d in shape) + ")"


def _array_dtype(array_type) -> str:
    from coremltools.proto import FeatureTypes_pb2 as ft  # optional: the coreml extra

    return ft.ArrayFeatureType.ArrayDataType.Name(array_type.dataType).lower()


def load_program(path: str | Path):
    """The package's MIL program (pymil), with its weights, without loading the model into Core ML."""
    import coremltools as ct  # optional: the coreml extra
    from coremltools.converters.mil.frontend.milproto.load import load  # optional: the coreml extra

    mlmodel = ct.models.MLModel(str(path), skip_model_load=True)
    spec = mlmodel.get_spec()
    return load(spec, spec.specificationVersion, file_weights_dir=mlmodel.weights_dir), spec


def _operations(block):
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from _operations(inner)


def summarize(path: str | Path) -> PackageSummary:
    from coremltools.converters.mil.mil.types import builtin_to_string  # optional: the coreml extra

    program, spec = load_program(path)
    summary = PackageSummary(spec_version=spec.specificationVersion)
    for feature in spec.description.input:
        array = feature.type.multiArrayType
        summary.dtypes[feature.name] = _array_dtype(array)
        ranges = array.shapeRange.sizeRanges
        if ranges:
            summary.inputs[feature.name] = [(int(r.lowerBound), int(r.upperBound)) for r in ranges]
        else:
            summary.inputs[feature.name] = [(int(d), int(d)) for d in array.shape]
    for feature in spec.description.state:
        array = feature.type.stateType.arrayType
        summary.states[feature.name] = (tuple(int(d) for d in array.shape), _array_dtype(array))
    summary.outputs = [feature.name for feature in spec.description.output]
    summary.dtypes.update((f.name, _array_dtype(f.type.multiArrayType)) for f in spec.description.output)
    for function in program.functions.values():
        for var in function.outputs:
            summary.output_shapes[var.name] = tuple(d if isinstance(d, int) else None for d in var.shape)
        for op in _operations(function):
            summary.op_counts[op.op_type] += 1
            if op.op_type == BLOCKWISE_OP:
                data, scale = op.data, op.scale
                summary.quantized.append(QuantizedWeight(
                    name=op.name, dtype=builtin_to_string(data.dtype), shape=tuple(data.shape),
                    block_shape=tuple(int(d // s) for d, s in zip(data.shape, scale.shape))))
    summary.size_bytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return summary


def dequantized_weights(path: str | Path) -> dict:
    """Every block-wise quantized weight of the package as float32, scale * (data - offset): what the
    Core ML runtime computes from the int4 data."""
    import numpy as np  # lazy: numpy only when used

    program, _ = load_program(path)
    weights = {}
    for function in program.functions.values():
        for op in _operations(function):
            if op.op_type != BLOCKWISE_OP:
                continue
            data = np.asarray(op.data.val, dtype=np.float32)
            scale = np.asarray(op.scale.val, dtype=np.float32)
            offset = np.zeros_like(scale) if op.offset is None else np.asarray(op.offset.val, dtype=np.float32)
            for axis in range(data.ndim):
                repeat = data.shape[axis] // scale.shape[axis]
                scale, offset = np.repeat(scale, repeat, axis), np.repeat(offset, repeat, axis)
            weights[op.name] = scale * (data - offset)
    return weights
