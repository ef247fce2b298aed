"""`mlxhost bench coreml OUT.mlpackage`: an exported Core ML model on this Mac (macOS only).

What the Core ML recipe for on-device Llama measures, at several context sizes: the prompt's time to
first token (one call over `context - extend` tokens) and extend speed over `--extend-tokens` single-token
calls through the KV state, greedy. Other systems get a clear message and a non-zero exit: coremltools
converts on Linux but only macOS can run a package.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path
from mlxhost.export.coreml import MissingCoreMLError, require_coreml

_COLUMNS = [("context", "context", "d"), ("prompt_tokens", "prompt tokens", "d"), ("ttft_ms", "TTFT ms", ".1f"),
            ("prompt_tok_s", "prompt tok/s", ".0f"), ("extend_tokens", "extend tokens", "d"),
            ("extend_tok_s", "extend tok/s", ".1f")]
COMPUTE_UNITS = ("all", "cpu_and_ne", "cpu_and_gpu", "cpu_only")
DEFAULT_CONTEXTS = (256, 512, 1024, 2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("package", metavar="OUT.mlpackage", help="a package from `mlxhost export coreml`")
    parser.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                        help="context sizes to measure (comma-separated); sizes past the package's --context are"
                             " skipped")
    parser.add_argument("--extend-tokens", type=int, default=100, help="single-token extend steps per context")
    parser.add_argument("--compute-units", choices=COMPUTE_UNITS, default="all",
                        help="Core ML compute units the model may use")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/coreml-*.json)")


def plan(max_context: int, contexts: list[int], extend_tokens: int) -> list[tuple[int, int]]:
    """(context, prompt tokens) pairs: the prompt leaves room for the extend steps within the context."""
    return [(c, c - extend_tokens) for c in contexts if extend_tokens < c <= max_context]


def package_limits(model) -> tuple[int, type]:
    """The package's largest input length and the dtype its causal_mask takes."""
    from coremltools.proto import FeatureTypes_pb2 as ft  # optional: the coreml extra

    spec = model.get_spec()
    inputs = {f.name: f.type.multiArrayType for f in spec.description.input}
    max_context = int(inputs["input_ids"].shapeRange.sizeRanges[1].upperBound)
    float16 = inputs["causal_mask"].dataType == ft.ArrayFeatureType.FLOAT16
    return max_context, np.float16 if float16 else np.float32


def _measure(model, context: int, prompt_tokens: int, extend_tokens: int, mask_dtype) -> dict:
    from mlxhost.export.wrapper import make_causal_mask  # optional: torch (coreml extra)

    rng = np.random.default_rng(context)
    prompt = rng.integers(0, 1000, size=(1, prompt_tokens)).astype(np.int32)
    state = model.make_state()
    start = time.perf_counter()
    out = model.predict({"input_ids": prompt, "causal_mask": make_causal_mask(prompt_tokens, prompt_tokens,
                                                                              mask_dtype)}, state)
    ttft = time.perf_counter() - start
    token = int(np.argmax(out["logits"][0, -1]))
    start = time.perf_counter()
    for end in range(prompt_tokens + 1, prompt_tokens + extend_tokens + 1):
        out = model.predict({"input_ids": np.array([[token]], dtype=np.int32),
                             "causal_mask": make_causal_mask(1, end, mask_dtype)}, state)
        token = int(np.argmax(out["logits"][0, -1]))
    extend_s = time.perf_counter() - start
    return {"context": context, "prompt_tokens": prompt_tokens, "ttft_ms": ttft * 1e3,
            "prompt_tok_s": prompt_tokens / ttft, "extend_tokens": extend_tokens,
            "extend_tok_s": extend_tokens / extend_s}


def run(args: argparse.Namespace) -> int:
    if sys.platform != "darwin":
        print(f"mlxhost bench coreml: running a Core ML model needs macOS (this is {platform.system()}); "
              "`mlxhost export coreml` works here, benchmark the package on a Mac", file=sys.stderr)
        return 2

    try:
        require_coreml()
    except MissingCoreMLError as e:
        print(f"mlxhost bench coreml: {e}", file=sys.stderr)
        return 2
    import coremltools as ct  # optional: the coreml extra

    start = time.perf_counter()
    model = ct.models.MLModel(args.package, compute_units=getattr(ct.ComputeUnit, args.compute_units.upper()))
    load_s = time.perf_counter() - start
    max_context, mask_dtype = package_limits(model)
    cells = plan(max_context, [int(c) for c in args.contexts.split(",") if c.strip()], args.extend_tokens)
    if not cells:
        print(f"mlxhost bench coreml: no context in {args.contexts} fits the package (context {max_context})"
              f" with {args.extend_tokens} extend tokens", file=sys.stderr)
        return 2
    print(f"loaded {args.package} in {load_s:.1f} s (compute units: {args.compute_units})", flush=True)
    _measure(model, cells[0][0], cells[0][1], 2, mask_dtype)  # warm-up: the first predict specializes
    rows = []
    for context, prompt_tokens in cells:
        rows.append(_measure(model, context, prompt_tokens, args.extend_tokens, mask_dtype))
        print(format_table(rows[-1:], _COLUMNS), flush=True)
    print(format_table(rows, _COLUMNS))
    result = {"package": str(args.package), "compute_units": args.compute_units, "load_s": load_s,
              "platform": platform.platform(), "rows": rows}
    print(f"wrote {write_json(args.output_json or default_json_path('coreml'), result)}")
    return 0
