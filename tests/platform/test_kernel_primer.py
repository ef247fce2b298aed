"""The indexing-kernel primer (platform/kernel_primer.py): which modules it compiles for which model, that a
warm cache starts nothing, and that each op it runs builds the primitive MLX names the module after (checked
on the CPU through the graph MLX exports; the names follow mlx/backend/cuda/indexing.cpp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from mlxhost.platform import kernel_primer
from mlxhost.platform.kernel_primer import model_dtypes, module_name, modules


def test_a_quantized_model_primes_its_first_forwards_modules_first_then_the_sampled_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization": {"bits": 4}}))
    act, quantized = model_dtypes(str(tmp_path))
    names = [module_name(*m) for m in modules(act, quantized)]
    # The first forwards': the embedding's at prompt ids, the fused swiglu (one process each), then a decode step's.
    assert names[:3] == ["gather_bfloat16_int32_1", "gather_uint32_int32_1", "swiglu_bfloat16"]
    assert names[3:5] == ["gather_bfloat16_uint32_1", "gather_uint32_uint32_1"]
    assert {"gather_axis_bfloat16_int32", "gather_int32_int32_1", "scatter_int32_int32_Assign_1",
            "scatter_uint32_int32_Assign_1"} <= set(names)
    assert "scatter_axis_bfloat16_uint32_Assign" in names  # top-k sampling's
    assert len(names) == len(set(names))


@pytest.mark.parametrize("config, expected", [
    ({"text_config": {"torch_dtype": "float16"}}, ("float16", False)),
    ({"dtype": "float16", "text_config": {"hidden_size": 8}}, ("float16", False)),  # newer transformers
    ({"text_config": None, "torch_dtype": "float32", "quantization_config": {"bits": 4}}, ("float32", True)),
    ({"torch_dtype": "int8"}, ("bfloat16", False)),
])
def test_the_dtype_is_read_wherever_the_config_puts_it(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_dtypes(str(tmp_path)) == expected
    assert model_dtypes(None) == ("bfloat16", True)  # nothing to read: MLX's usual serving format
    assert model_dtypes(str(tmp_path / "missing")) == ("bfloat16", True)


def test_an_unquantized_model_primes_no_uint32_weights():
    names = [module_name(*m) for m in modules("float16", False)]
    assert "gather_float16_uint32_1" in names and not any(n.startswith("gather_uint32") for n in names)


def _fill(cache, mods) -> None:
    (cache / ".primed").mkdir(exist_ok=True)
    for m in mods:
        path = cache / ".primed" / module_name(*m) if m[0] == "compiled" else cache / f"{module_name(*m)}.ptx"
        path.write_bytes(b"")


def test_a_cache_holding_every_module_starts_no_process(tmp_path, monkeypatch):
    _fill(tmp_path, modules("bfloat16", True))
    assert (tmp_path / "gather_bfloat16_uint32_1.ptx").exists()  # MLX's file name for the module
    monkeypatch.setattr(kernel_primer.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    assert kernel_primer.start(None, tmp_path) == []


def test_the_missing_modules_spread_over_the_processes_first_ones_first(tmp_path, monkeypatch):
    started = []

    class _Proc:
        returncode = 0

        def __init__(self, argv, **_kw):
            started.append(json.loads(argv[-1]))

        def wait(self):
            return 0

    monkeypatch.setattr(kernel_primer.subprocess, "Popen", _Proc)
    kernel_primer.start(None, tmp_path)
    assert len(started) == kernel_primer.PROCESSES
    assert [s["modules"][0] for s in started] == [list(m) for m in modules("bfloat16", True)[:kernel_primer.PROCESSES]]
    assert sorted(tuple(m) for s in started for m in s["modules"]) == sorted(modules("bfloat16", True))


@pytest.mark.parametrize("kind, primitive", [("gather", "Gather"), ("gather_axis", "GatherAxis"),
                                             ("scatter", "Scatter"), ("scatter_axis", "ScatterAxis")])
def test_each_op_builds_the_primitive_its_module_is_named_after(tmp_path, kind, primitive):
    out = kernel_primer.run(kind, "bfloat16", "int32")
    mx.export_to_dot(str(tmp_path / "g.dot"), out)
    labels = {line.split('label ="')[1].split('"')[0] for line in (tmp_path / "g.dot").read_text().splitlines()
              if 'label ="' in line}
    assert primitive in labels and not ({"Gather", "GatherAxis", "Scatter", "ScatterAxis", "SliceUpdate"}
                                        - {primitive}) & labels


def test_a_helper_run_compiles_skips_what_is_there_and_leaves_no_staging_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))  # start_staged points it at its staging folder
    (tmp_path / "gather_int32_int32_1.ptx").write_bytes(b"")
    ran = []
    monkeypatch.setattr(kernel_primer, "run", lambda *m: ran.append(m) or mx.zeros(1))
    spec = {"cache_dir": str(tmp_path), "modules": [["gather", "int32", "int32"], ["scatter", "int32", "int32"]]}
    assert kernel_primer.main([json.dumps(spec)]) == 0
    assert ran == [("scatter", "int32", "int32")]
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())


def test_top_k_sampling_builds_the_take_along_axis_scatter_the_primer_compiles(tmp_path):
    """mlx-lm's top-k filter, as the sampler calls it on bfloat16 logprobs: its graph holds the ScatterAxis at
    uint32 indices that `modules` lists (a change in mlx-lm that moves it fails here)."""
    from mlx_lm.sample_utils import apply_top_k

    logprobs = mx.zeros((2, 50), dtype=mx.bfloat16)
    mx.export_to_dot(str(tmp_path / "g.dot"), apply_top_k(logprobs, 5))
    text = (tmp_path / "g.dot").read_text()
    assert "ScatterAxis" in text and ("scatter_axis", "bfloat16", "uint32") in modules("bfloat16", True)
    assert mx.argpartition(-logprobs, kth=4, axis=-1).dtype == mx.uint32


def _compiled_kernels(code: str, tmp) -> set[str]:
    """The fused kernels a fresh process compiles running `code`, by name, from MLX's CPU kernel cache (under the
    temp folder, named as MLX-CUDA names its modules)."""
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TMPDIR=str(tmp)), check=True, timeout=300)
    return {p.name.split("_contiguous")[0].split("_strided")[0] for p in tmp.rglob("*.cpp")}


def test_the_first_forwards_fuse_exactly_the_kernel_the_primer_compiles(qwen3_4bit_model_dir, tmp_path):
    """The KV probe's and the memory profile's forwards of a quantized Qwen3, as the server runs them: the one fused
    kernel they compile is the one `run("compiled", ...)` compiles (a model that fuses another function, or an
    mlx-lm whose swiglu changes, fails here)."""
    act, _ = model_dtypes(str(qwen3_4bit_model_dir))
    (tmp_path / "model").mkdir()
    (tmp_path / "primer").mkdir()
    forwards = _compiled_kernels(
        "import mlx.core as mx\n"
        "from mlxhost.models.loader import load_model\n"
        "from mlxhost.kv.kinds.probe import probe_kv\n"
        "from mlxhost.memory.profile import activation_bytes\n"
        f"model = load_model({str(qwen3_4bit_model_dir)!r}).model\n"
        "probe_kv(model)\n"
        "activation_bytes(model, 16)\n", tmp_path / "model")
    primed = _compiled_kernels(
        "import mlx.core as mx\n"
        "from mlxhost.platform.kernel_primer import run\n"
        f"mx.eval(run('compiled', {act!r}, ''))\n", tmp_path / "primer")
    assert forwards == primed and len(primed) == 1


def test_the_server_waits_for_the_first_forwards_modules_or_for_no_process_left(tmp_path, caplog):
    caplog.set_level("INFO", logger=kernel_primer.__name__)
    first = kernel_primer.first_forward_modules("bfloat16", True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _fill(tmp_path, first)
        kernel_primer.wait_first([sleeper], None, tmp_path, timeout_s=20)
        assert "compiled beside the load" in caplog.text
        (tmp_path / f"{module_name(*first[0])}.ptx").unlink()
        caplog.clear()
        kernel_primer.wait_first([sleeper], None, tmp_path, timeout_s=0.2)  # bounded
        assert "not there yet" in caplog.text
    finally:
        sleeper.kill()
    sleeper.wait()
    caplog.clear()
    kernel_primer.wait_first([sleeper], None, tmp_path, timeout_s=20)  # nobody left to compile it: no wait
    assert "not there yet" in caplog.text and "waited 0.0 s" in caplog.text
    kernel_primer.wait_first([], None, tmp_path / "missing")  # none started (a warm cache)


def test_a_module_mlx_refuses_is_marked_failed_and_not_waited_for(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    first = kernel_primer.first_forward_modules("bfloat16", True)  # model_dtypes(None)'s
    _fill(tmp_path, first[:-1])
    monkeypatch.setattr(kernel_primer, "run", lambda *m: (_ for _ in ()).throw(RuntimeError("no")))
    assert kernel_primer.main([json.dumps({"cache_dir": str(tmp_path), "modules": [list(first[-1])]})]) == 1
    assert kernel_primer.failed_marker(tmp_path, first[-1]).exists() and not kernel_primer.cached(tmp_path, first[-1])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        caplog.set_level("INFO", logger=kernel_primer.__name__)
        kernel_primer.wait_first([sleeper], None, tmp_path, timeout_s=20)  # the marker ends the wait at once
        assert "not there yet (waited 0.0 s" in caplog.text
    finally:
        sleeper.kill()
    monkeypatch.setattr(kernel_primer.subprocess, "Popen", lambda *a, **k: sleeper)
    kernel_primer.start(None, tmp_path)  # a new launch tries again
    assert not kernel_primer.failed_marker(tmp_path, first[-1]).exists()


def test_a_fused_kernel_is_marked_once_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    spec = {"cache_dir": str(tmp_path), "modules": [["compiled", "float32", ""]]}
    assert kernel_primer.main([json.dumps(spec)]) == 0
    assert kernel_primer.cached(tmp_path, ("compiled", "float32", ""))
