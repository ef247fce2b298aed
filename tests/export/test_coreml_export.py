"""`mlxhost export coreml` on the tiny Llama and Qwen3: what the saved package's program holds, read back
through coremltools' spec and MIL APIs (Linux cannot run a package; macOS runs it in test_macos.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mlxhost.testing.needs import need
from tests.export.conftest import CONTEXT

need("torch", "coremltools")  # at collection: every test here converts or runs through them

from mlxhost.export.package_info import BLOCKWISE_OP, dequantized_weights, summarize  # noqa: E402
from mlxhost.server.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def small_package(hf_llama_dir, tmp_path_factory):
    """Every option off its default: context 16, float32 compute, int4 in blocks of 64, all logits; with its
    output."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("coreml-small") / "small.mlpackage"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(["export", "coreml", str(hf_llama_dir), str(out), "--context", "16", "--precision", "float32",
                     "--quantize", "int4", "--block-size", "64", "--logits", "all"]) == 0
    return out, stdout.getvalue(), stderr.getvalue()


def test_states_are_the_kv_cache(int4_package):
    summary = summarize(int4_package)
    # (layers, batch, kv_heads, context, head_dim), float16 like the compute precision
    assert summary.states == {"key_cache": ((2, 1, 2, CONTEXT, 32), "float16"),
                              "value_cache": ((2, 1, 2, CONTEXT, 32), "float16")}
    # updated in place inside the program, not passed in and out
    assert summary.op_counts["read_state"] == 2
    assert summary.op_counts["coreml_update_state"] >= 2
    assert summary.op_counts["slice_update"] >= 2
    assert summary.outputs == ["logits"]
    assert summary.output_shapes["logits"] == (1, 1, 2048)  # --logits last (the default): one position
    assert summary.dtypes == {"input_ids": "int32", "causal_mask": "float16", "logits": "float16"}


def test_inputs_have_ranged_dims(int4_package):
    assert summarize(int4_package).inputs == {
        "input_ids": [(1, 1), (1, CONTEXT)],
        "causal_mask": [(1, 1), (1, 1), (1, CONTEXT), (1, CONTEXT)],
    }


def test_attention_is_one_fused_sdpa_op_per_layer(int4_package):
    summary = summarize(int4_package)
    assert summary.op_counts["scaled_dot_product_attention"] == 2  # one per layer
    assert summary.op_counts["softmax"] == 0  # no decomposed attention next to it
    assert summary.spec_version >= 9  # macOS 15 / iOS 18


def test_weights_are_int4_per_block(int4_package):
    summary = summarize(int4_package)
    # every projection of both layers (7 each) and the embedding, which the tied LM head shares
    assert len(summary.quantized) == 15
    assert summary.op_counts[BLOCKWISE_OP] == 15
    assert {w.dtype for w in summary.quantized} == {"int4"}
    assert {w.block_shape for w in summary.quantized} == {(1, 32)}  # 32 input channels per scale
    assert summary.op_counts["linear"] == 15  # 14 projections and the LM head, all on quantized weights


def test_int4_weights_are_over_3x_smaller_than_float16(int4_package, hf_dir):
    from mlxhost.export.wrapper import load_hf_model

    float16_bytes = 2 * sum(p.numel() for p in load_hf_model(hf_dir).parameters())
    weight_file = int4_package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    # int4 data + a float16 scale per 32 weights (4.5 bits); the norm gains stay float16
    assert weight_file.stat().st_size * 3 < float16_bytes


def test_options_reach_the_package(small_package):
    path, _, _ = small_package
    summary = summarize(path)
    assert summary.inputs["input_ids"] == [(1, 1), (1, 16)]
    assert summary.states["key_cache"] == ((2, 1, 2, 16, 32), "float16")  # Core ML states are float16 only
    assert summary.dtypes == {"input_ids": "int32", "causal_mask": "float32", "logits": "float32"}
    assert {w.block_shape for w in summary.quantized} == {(1, 64)}
    assert summary.output_shapes["logits"] == (1, None, 2048)  # --logits all: one row per input token
    assert summary.op_counts["scaled_dot_product_attention"] == 2
    assert all(np.isfinite(w).all() for w in dequantized_weights(path).values())


def test_export_prints_stages_and_a_summary(small_package):
    _, out, err = small_package
    for stage in ("loading", "tracing and converting", "quantizing weights to int4, blocks of 64", "saving", "done"):
        assert f"coreml export: {stage}" in err
    assert "input_ids (1, [1, 16])" in out
    assert "int4 blocks (1, 64)" in out


def test_missing_folder_and_quantized_folder_are_refused(hf_llama_dir, tmp_path, capsys):
    import json
    import shutil

    assert main(["export", "coreml", str(tmp_path / "nope"), str(tmp_path / "a.mlpackage")]) == 2
    assert "no model folder at" in capsys.readouterr().err
    quantized = tmp_path / "mlx-4bit"
    shutil.copytree(hf_llama_dir, quantized)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization": {"bits": 4, "group_size": 64}}))
    assert main(["export", "coreml", str(quantized), str(tmp_path / "b.mlpackage")]) == 2
    assert "quantized weights" in capsys.readouterr().err
    assert main(["export", "coreml", str(hf_llama_dir), str(tmp_path / "c.mlmodel")]) == 2
    assert ".mlpackage" in capsys.readouterr().err
    assert not any(tmp_path.glob("*.ml*"))
