"""The indexing-kernel primer (platform/kernel_primer.py): which modules it compiles for which model, that a
warm cache starts nothing, and that each op it runs is the one MLX names the module after (run here on the
CPU, where nothing is compiled; the names follow mlx/backend/cuda/indexing.cpp)."""

from __future__ import annotations

import json

import mlx.core as mx

from mlxserve.platform import kernel_primer
from mlxserve.platform.kernel_primer import model_dtypes, module_name, modules


def test_a_quantized_model_primes_the_packed_weights_gathers_and_the_uint32_ids_first(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization": {"bits": 4}}))
    act, quantized = model_dtypes(str(tmp_path))
    names = [module_name(*m) for m in modules(act, quantized)]
    assert names[:2] == ["gather_bfloat16_uint32_1", "gather_uint32_uint32_1"]  # the first decode step's
    assert {"gather_axis_bfloat16_int32", "gather_int32_int32_1", "scatter_int32_int32_Assign_1",
            "scatter_uint32_int32_Assign_1"} <= set(names)
    assert len(names) == len(set(names))


def test_a_float16_model_without_quantization_primes_no_uint32_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "float16"}}))
    names = [module_name(*m) for m in modules(*model_dtypes(str(tmp_path)))]
    assert "gather_float16_uint32_1" in names and not any(n.startswith("gather_uint32") for n in names)
    assert model_dtypes(None) == ("bfloat16", True)  # nothing to read: MLX's usual serving format


def test_a_cache_holding_every_module_starts_no_process(tmp_path, monkeypatch):
    for m in modules("bfloat16", True):
        (tmp_path / f"{module_name(*m)}.ptx").write_bytes(b"")
    monkeypatch.setattr(kernel_primer.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert kernel_primer.start(None, tmp_path) == []


def test_the_missing_modules_spread_over_the_processes_first_ones_first(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(kernel_primer.subprocess, "Popen", lambda argv, **k: started.append(json.loads(argv[-1])))
    kernel_primer.start(None, tmp_path)
    assert len(started) == kernel_primer.PROCESSES
    assert [s["modules"][0] for s in started] == [list(m) for m in modules("bfloat16", True)[:kernel_primer.PROCESSES]]
    assert sorted(tuple(m) for s in started for m in s["modules"]) == sorted(modules("bfloat16", True))


def test_each_op_runs_and_a_helper_run_leaves_no_staging_folder(tmp_path, monkeypatch):
    for kind, dtype, index in modules("bfloat16", True):
        out = kernel_primer.run(kind, dtype, index)
        mx.eval(out)
        assert out.dtype == getattr(mx, dtype)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))  # start_staged points it at its staging folder
    spec = {"cache_dir": str(tmp_path), "modules": [["gather", "int32", "int32"]]}
    assert kernel_primer.main([json.dumps(spec)]) == 0
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())
