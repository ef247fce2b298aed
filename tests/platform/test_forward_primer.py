"""The forward primer (platform/forward_primer.py): which models it builds, that a warm cache starts nothing, that
its model of zeros runs the same graph as the loaded model (module names follow the graph and the dtypes, so the
same graph compiles the same modules; checked on the CPU through the graph MLX exports), and its process's ends."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxhost.models.loader import load_model
from mlxhost.platform import forward_primer
from mlxhost.platform.forward_primer import build_zeros, model_folder, prime_key, run_forwards

KV = {"kv_bits": None, "kv_group_size": 64, "kv_quant_mode": "auto"}


def _labels(path, out) -> list[str]:
    mx.export_to_dot(str(path), out)
    return sorted(line.split('label ="')[1].split('"')[0] for line in path.read_text().splitlines()
                  if 'label ="' in line)


def test_a_text_folder_is_primed_and_other_sources_are_not(qwen3_4bit_model_dir, tmp_path):
    assert model_folder(str(qwen3_4bit_model_dir)) == qwen3_4bit_model_dir
    assert model_folder(None) is None
    assert model_folder(str(tmp_path / "missing")) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_folder(str(tmp_path)) is None  # no weights to take the shapes from
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert model_folder(str(tmp_path)) == tmp_path
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    assert model_folder(str(tmp_path)) is None  # a vision model loads through mlx-vlm


def test_the_marker_of_a_finished_run_starts_no_process_and_a_new_kv_layout_does(qwen3_4bit_model_dir, tmp_path,
                                                                                monkeypatch):
    started = []
    monkeypatch.setattr(forward_primer.subprocess, "Popen", lambda argv, **_kw: started.append(json.loads(argv[-1])))
    (tmp_path / ".primed").mkdir()
    (tmp_path / ".primed" / prime_key(qwen3_4bit_model_dir, KV)).touch()
    assert forward_primer.start(str(qwen3_4bit_model_dir), tmp_path, KV) is None and not started
    forward_primer.start(str(qwen3_4bit_model_dir), tmp_path, dict(KV, kv_bits=8))
    assert started == [{"cache_dir": str(tmp_path), "folder": str(qwen3_4bit_model_dir), "kv": dict(KV, kv_bits=8)}]


def test_the_model_of_zeros_has_the_loaded_models_arrays_and_forward_graph(qwen3_4bit_model_dir, tmp_path):
    loaded = load_model(str(qwen3_4bit_model_dir)).model
    zeros = build_zeros(qwen3_4bit_model_dir)
    real, built = dict(tree_flatten(loaded.parameters())), dict(tree_flatten(zeros.parameters()))
    assert {k: (v.shape, v.dtype) for k, v in real.items()} == {k: (v.shape, v.dtype) for k, v in built.items()}
    assert all(not mx.any(v).item() for v in built.values())
    assert any(v.dtype == mx.uint32 for v in built.values())  # quantized as the config says
    from mlx_lm.models.cache import make_prompt_cache

    graphs = []
    for i, model in enumerate((loaded, zeros)):
        out = model(mx.zeros((1, 2), dtype=mx.int32), cache=make_prompt_cache(model))
        graphs.append(_labels(tmp_path / f"g{i}.dot", out))
    assert graphs[0] == graphs[1] and "Gather" in graphs[0]
    run_forwards(zeros, make_prompt_cache)


def test_a_run_where_the_weights_fit_marks_the_model_and_leaves_no_staging(qwen3_4bit_model_dir, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))  # start_staged points it at its staging folder
    spec = json.dumps({"cache_dir": str(tmp_path), "folder": str(qwen3_4bit_model_dir), "kv": KV})
    monkeypatch.setattr(forward_primer, "fits", lambda weights, free: False)
    assert forward_primer.main([spec]) == forward_primer.SKIPPED
    assert not (tmp_path / ".primed").exists()
    monkeypatch.setattr(forward_primer, "fits", lambda weights, free: True)
    assert forward_primer.main([spec]) == 0
    assert (tmp_path / ".primed" / prime_key(qwen3_4bit_model_dir, KV)).exists()
    assert not any(p.name.startswith(".staging-") for p in tmp_path.iterdir())


def test_room_for_the_zeros_is_twice_the_weights_and_headroom():
    gib = 1 << 30
    assert forward_primer.fits(4 * gib, 8 * gib + forward_primer.HEADROOM_BYTES)
    assert not forward_primer.fits(4 * gib, 8 * gib + forward_primer.HEADROOM_BYTES - 1)
    assert not forward_primer.fits(1, None)  # no free-memory reading (the CPU, Metal): nothing to prime


@pytest.mark.parametrize("code, level, words", [(0, "INFO", "waited"), (forward_primer.SKIPPED, "INFO", "no room"),
                                                (1, "WARNING", "exited with 1")])
def test_the_wait_says_how_the_process_ended(caplog, code, level, words):
    proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    with caplog.at_level("INFO", logger=forward_primer.__name__):
        forward_primer.wait(proc)
    assert [(r.levelname, words in r.getMessage()) for r in caplog.records] == [(level, True)]


def test_a_process_past_the_bound_is_stopped(caplog):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    forward_primer.wait(proc, timeout_s=0.2)
    assert proc.wait(10) != 0 and "ran past" in caplog.text
