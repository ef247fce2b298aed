"""The exported package run by Core ML itself (coremltools.models.MLModel with a state): macOS only, since
coremltools cannot run predictions on other systems. Same prompt + 20 extend steps as the PyTorch wrapper."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mlxhost.testing.needs import need
from tests.export.conftest import CONTEXT, PROMPT_LEN

if sys.platform != "darwin":
    pytest.skip("Core ML runs packages only on macOS (coremltools on Linux converts but cannot predict)",
                allow_module_level=True)
need("torch", "coremltools")  # at collection: every test here converts or runs through them

from mlxhost.export.wrapper import StatefulCausalLM, load_hf_model, make_causal_mask, stateful_logits  # noqa: E402
from mlxhost.server.cli import main  # noqa: E402

# Core ML states are float16, so even the float32-compute package rounds keys and values: PyTorch with its
# weights in float16 moves these logits by ~5e-3 (measured), float16 compute throughout by about as much.
FLOAT32_ATOL, FLOAT16_ATOL = 2e-2, 5e-2


def coreml_logits(package, token_ids, compute_units: str) -> np.ndarray:
    import coremltools as ct

    from mlxhost.bench.coreml import package_limits

    model = ct.models.MLModel(str(package), compute_units=getattr(ct.ComputeUnit, compute_units))
    _, mask_dtype = package_limits(model)
    state = model.make_state()
    ids = np.array([token_ids], dtype=np.int32)
    rows = [model.predict({"input_ids": ids[:, :PROMPT_LEN],
                           "causal_mask": make_causal_mask(PROMPT_LEN, PROMPT_LEN, mask_dtype)}, state)["logits"][0]]
    for end in range(PROMPT_LEN + 1, ids.shape[1] + 1):
        rows.append(model.predict({"input_ids": ids[:, end - 1:end],
                                   "causal_mask": make_causal_mask(1, end, mask_dtype)}, state)["logits"][0])
    return np.concatenate(rows).astype(np.float32)


@pytest.mark.parametrize("precision, compute_units, atol", [
    ("float32", "CPU_ONLY", FLOAT32_ATOL),
    ("float16", "ALL", FLOAT16_ATOL),
])
def test_core_ml_matches_pytorch_over_prompt_and_extend(hf_dir, token_ids, tmp_path, precision, compute_units,
                                                        atol):
    package = tmp_path / f"{precision}.mlpackage"
    assert main(["export", "coreml", str(hf_dir), str(package), "--context", str(CONTEXT),
                 "--precision", precision, "--logits", "all"]) == 0
    reference = stateful_logits(StatefulCausalLM(load_hf_model(hf_dir), CONTEXT), token_ids, PROMPT_LEN)
    np.testing.assert_allclose(coreml_logits(package, token_ids, compute_units), reference, rtol=0, atol=atol)


def test_int4_package_runs_with_state(int4_package, token_ids):
    logits = coreml_logits(int4_package, token_ids, "ALL")  # --logits last: one row per call
    assert logits.shape[0] == 1 + len(token_ids) - PROMPT_LEN and np.isfinite(logits).all()


def test_bench_coreml_runs(int4_package, tmp_path):
    assert main(["bench", "coreml", str(int4_package), "--contexts", "32,64", "--extend-tokens", "8",
                 "--output-json", str(tmp_path / "bench.json")]) == 0
    assert (tmp_path / "bench.json").exists()
