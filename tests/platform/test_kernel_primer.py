"""The indexing-kernel primer (platform/kernel_primer.py): which modules it compiles for which model, that a
warm cache starts nothing, and that each op it runs builds the primitive MLX names the module after (checked
on the CPU through the graph MLX exports; the names follow mlx/backend/cuda/indexing.cpp)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxhost.platform import kernel_primer
from mlxhost.platform.kernel_primer import model_dtypes, module_name, modules


def test_a_quantized_model_primes_the_prompt_ids_gathers_first_then_the_sampled_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "quantization": {"bits": 4}}))
    act, quantized = model_dtypes(str(tmp_path))
    names = [module_name(*m) for m in modules(act, quantized)]
    assert names[:2] == ["gather_bfloat16_int32_1", "gather_uint32_int32_1"]  # the start-up forwards' embedding
    assert names[2:4] == ["gather_bfloat16_uint32_1", "gather_uint32_uint32_1"]  # the first decode step's
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


def test_a_cache_holding_every_module_starts_no_process(tmp_path, monkeypatch):
    for m in modules("bfloat16", True):
        (tmp_path / f"{module_name(*m)}.ptx").write_bytes(b"")
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
