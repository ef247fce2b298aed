"""`mlxhost export coreml`: a stateful-KV, flexible-shape, optionally int4 block-quantized Core ML model.

Stages: load the Hugging Face checkpoint in PyTorch (float32) → wrap it so the KV cache is registered
state (wrapper.py) → trace → convert with coremltools for macOS 15 (the first target with Core ML state
and the fused `scaled_dot_product_attention` op), inputs `input_ids (1, [1, context])` and
`causal_mask (1, 1, [1, context], [1, context])` as ranged dims → optionally compress the weights to
int4 with one scale per block of `block_size` input channels → save the .mlpackage.

coremltools and torch come with the `coreml` extra and are imported here only, when an export runs.
Conversion works on Linux; running the package (`mlxhost bench coreml`) needs macOS.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxhost.export import UnsupportedModelError
from mlxhost.export.package_info import summarize
from mlxhost.server.progress import StageLog

COREML_HINT = 'pip install "mlxhost[coreml]"'
QUANTIZE_CHOICES = ("none", "int4")
PRECISIONS = ("float16", "float32")
STATE_NAMES = ("key_cache", "value_cache")


@dataclass(frozen=True)
class CoreMLExportConfig:
    context: int = 2048  # the most positions (prompt + generated) the state holds
    quantize: str = "none"  # "none" | "int4" (weights only, per block)
    block_size: int = 32  # input channels sharing one int4 scale
    precision: str = "float16"  # compute precision, and dtype of the mask and logits (the state is float16)
    logits: str = "last"  # "last": logits of the last position only (generation); "all": every position
    example_tokens: int = 4  # length of the traced example input (any value in [2, context] traces the same)

    def __post_init__(self):
        if self.context < 2:
            raise ValueError(f"--context must be at least 2, got {self.context}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"--quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be positive, got {self.block_size}")
        if self.logits not in ("all", "last"):
            raise ValueError(f"--logits must be all or last, got {self.logits!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")


class MissingCoreMLError(RuntimeError):
    """coremltools or torch is not installed."""


def require_coreml() -> None:
    missing = [name for name in ("coremltools", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingCoreMLError(f"the Core ML export needs {' and '.join(missing)}: {COREML_HINT} "
                                 "(or pip install -e \".[coreml]\" in a checkout)")


def _allow_numpy_24() -> None:
    """NumPy 2.4 made int() of a one-element array an error; coremltools 9.0's converter for the
    `aten::Int` node (traced `x.shape[-1] // 2` in rope's rotate_half) still does it. Registers the
    same conversion with `.item()` through coremltools' public op registry, only where needed."""
    import numpy as np  # lazy: numpy only when used

    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        return
    from coremltools.converters.mil import Builder as mb  # optional: the coreml extra
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs  # optional: the coreml extra

    # optional: the coreml extra
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    @register_torch_op(torch_alias=["int"], override=True)
    def _int(context, node):
        x = _get_inputs(context, node, expected=1)[0]
        if x.can_be_folded_to_const():
            res = mb.const(val=np.int32(np.asarray(x.val).item()), name=node.name)
        elif len(x.shape) > 0:
            res = mb.cast(x=mb.squeeze(x=x, name=node.name + "_item"), dtype="int32", name=node.name)
        else:
            res = mb.cast(x=x, dtype="int32", name=node.name)
        context.add(res, node.name)


def trace_wrapper(wrapper, example_tokens: int = 4):
    """TorchScript of the wrapper: shapes stay symbolic (sizes are traced), so one trace serves any
    prompt length and every extend step; its buffers are the wrapper's."""
    import torch  # optional: the coreml extra

    from mlxhost.export.wrapper import make_causal_mask  # optional: torch (coreml extra)

    n = min(example_tokens, wrapper.context)
    example = (torch.zeros((1, n), dtype=torch.int64), torch.from_numpy(make_causal_mask(n, n)))
    wrapper.reset()
    with torch.no_grad():
        traced = torch.jit.trace(wrapper.eval(), example)
    wrapper.reset()
    return traced


def convert_wrapper(wrapper, config: CoreMLExportConfig):
    """The traced wrapper as a Core ML ML program (not loaded: Linux cannot, and saving does not need it)."""
    import coremltools as ct  # optional: the coreml extra
    import numpy as np  # lazy: numpy only when used

    _allow_numpy_24()
    np_dtype = np.float16 if config.precision == "float16" else np.float32
    # Core ML states are float16 only; with float32 compute the converter casts around them.
    traced = trace_wrapper(wrapper, config.example_tokens)
    new, end = ct.RangeDim(1, config.context), ct.RangeDim(1, config.context)
    state_type = ct.TensorType(shape=wrapper.state_shape, dtype=np.float16)
    return ct.convert(
        traced,
        inputs=[ct.TensorType(name="input_ids", shape=(1, new), dtype=np.int32),
                ct.TensorType(name="causal_mask", shape=(1, 1, new, end), dtype=np_dtype)],
        outputs=[ct.TensorType(name="logits", dtype=np_dtype)],
        states=[ct.StateType(wrapped_type=state_type, name=name) for name in STATE_NAMES],
        minimum_deployment_target=ct.target.macOS15,
        compute_precision=ct.precision.FLOAT16 if config.precision == "float16" else ct.precision.FLOAT32,
        skip_model_load=True,
    )


def quantize_int4(mlmodel, block_size: int):
    """Weight-only int4, symmetric, one scale per `block_size` input channels (constexpr_blockwise_shift_scale)."""
    import coremltools.optimize as cto  # optional: the coreml extra

    op_config = cto.coreml.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4",
                                                   granularity="per_block", block_size=block_size)
    return cto.coreml.linear_quantize_weights(mlmodel, config=cto.coreml.OptimizationConfig(global_config=op_config))


def export_coreml(source: str | Path, out: str | Path, config: CoreMLExportConfig, progress=None) -> Path:
    """Export the model folder (or hub id) `source` to the package `out`; returns its path.
    `progress(stage)` is called as each stage starts (mlxhost.server.progress.StageLog prints them)."""
    require_coreml()
    stage = progress or (lambda _: None)
    out = Path(out)
    if out.suffix != ".mlpackage":
        raise ValueError(f"{out} must end in .mlpackage")
    from mlxhost.export.wrapper import StatefulCausalLM, load_hf_model  # optional: torch (coreml extra)

    stage(f"loading {source} in PyTorch (float32)")
    wrapper = StatefulCausalLM(load_hf_model(source), config.context, logits=config.logits)
    stage(f"tracing and converting (macOS 15 target, {config.precision}, context {config.context})")
    mlmodel = convert_wrapper(wrapper, config)
    if config.quantize == "int4":
        stage(f"quantizing weights to int4, blocks of {config.block_size}")
        mlmodel = quantize_int4(mlmodel, config.block_size)
    stage(f"saving {out}")
    if out.exists():
        shutil.rmtree(out)  # replaced whole: no file of an earlier export mixes with this one
    mlmodel.save(str(out))
    return out


# ---------------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = CoreMLExportConfig()
    p.add_argument("model", metavar="MODEL", help="Hugging Face model folder or hub id (float weights; "
                   "Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("out", metavar="OUT.mlpackage", help="the Core ML package to write (replaced if it exists)")
    p.add_argument("--context", type=int, default=d.context,
                   help="most positions the KV state holds; input_ids and causal_mask accept 1..N tokens")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=d.quantize,
                   help="int4: weight-only block-wise int4 (about 4x smaller than float16)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="with --quantize int4: input channels sharing one scale")
    p.add_argument("--logits", choices=("last", "all"), default=d.logits,
                   help="last: logits (1, 1, vocab) of the last position, what generation needs; all: (1, new"
                        " tokens, vocab), e.g. to score a prompt")
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="compute precision, and dtype of causal_mask and logits (the KV state is float16"
                        " either way: Core ML states are)")


def run(args) -> int:
    if logging.getLogger().level > logging.DEBUG:
        # Its INFO lines name every op it touches; its warnings on Linux say it cannot run models (known).
        logging.getLogger("coremltools").setLevel(logging.ERROR)
    try:
        config = CoreMLExportConfig(context=args.context, quantize=args.quantize, block_size=args.block_size,
                                    precision=args.precision, logits=args.logits)
        require_coreml()
        progress = StageLog("coreml export")
        path = export_coreml(args.model, args.out, config, progress=progress)
    except (MissingCoreMLError, UnsupportedModelError, ValueError, OSError) as e:
        print(f"mlxhost export coreml: {e}", file=sys.stderr)
        return 2
    progress.done()

    print(summarize(path).describe())
    return 0
