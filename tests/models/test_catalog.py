"""`mlxhost list` and `--model-dir` on fixture folders: sizes, quantization bits, family, servable."""

import json
import shutil

import pytest

from mlxhost.models import catalog
from mlxhost.server import cli, serve_command


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen3_model_dir, qwen3_4bit_model_dir):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(qwen3_model_dir, root / "qwen-small")
    shutil.copytree(qwen3_4bit_model_dir, root / "qwen-4bit")
    (root / "odd").mkdir()  # an architecture mlx-lm has no module for
    (root / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    (root / "notes").mkdir()  # no config.json: not a model
    (root / "notes" / "readme.txt").write_text("hello")
    return root


def test_scan_model_dir_reads_family_bits_and_size(model_dir):
    found = {m.name: m for m in catalog.scan_model_dir(model_dir)}
    assert set(found) == {"qwen-small", "qwen-4bit", "odd"}
    assert (found["qwen-small"].family, found["qwen-small"].bits, found["qwen-small"].servable) == ("qwen3", None, True)
    assert (found["qwen-4bit"].bits, found["qwen-4bit"].servable) == (4, True)
    assert found["qwen-4bit"].num_bytes < found["qwen-small"].num_bytes
    assert not found["odd"].servable and "no_such_arch" in found["odd"].why_not


def test_can_serve_knows_remapped_types_and_vlms():
    assert catalog.can_serve({"model_type": "mistral"}) == (True, "")  # mlx-lm serves it with llama
    ok, why = catalog.can_serve({"model_type": "llava_next", "vision_config": {}})
    assert not ok and "not supported" in why


def test_vlm_without_the_vision_extra_names_it(monkeypatch):
    monkeypatch.setattr("mlxhost.models.extras.has_vision", lambda: False)
    ok, why = catalog.can_serve({"model_type": "qwen2_5_vl", "vision_config": {}})
    assert not ok and 'pip install "mlxhost[vision]"' in why


def test_hf_cache_layout_is_read(tmp_path, qwen3_4bit_model_dir):
    repo = tmp_path / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(qwen3_4bit_model_dir.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(blobs / f"blob{i}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (tmp_path / "models--org--broken" / "snapshots").mkdir(parents=True)  # a download that never finished
    (model,) = catalog.scan_hf_cache(tmp_path)
    assert (model.name, model.family, model.bits, model.path) == ("org/tiny", "qwen3", 4, snapshot)
    assert model.num_bytes == sum(f.stat().st_size for f in blobs.iterdir())


def test_model_dir_specs_skip_unservable_folders(model_dir, tmp_path):
    specs = catalog.model_dir_specs(model_dir)
    assert sorted(s.name for s in specs) == ["qwen-4bit", "qwen-small"]
    assert not any(s.pinned for s in specs)  # each loads on first use
    with pytest.raises(ValueError, match="no servable model"):
        catalog.model_dir_specs(tmp_path)


def test_list_command_prints_a_table(model_dir, capsys):
    assert cli.main(["list", "--no-hf-cache", "--model-dir", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "3 model(s)" in out
    line = next(line for line in out.splitlines() if line.startswith("qwen-4bit"))
    assert " 4 " in line and "qwen3" in line and "yes" in line
    assert "no (mlx-lm has no 'no_such_arch' module)" in out


def test_model_dir_flag_becomes_model_specs(model_dir):
    args = cli.make_parser().parse_args(["serve", "--model-dir", str(model_dir), "--max-loaded-models", "1"])
    fields = serve_command._models_fields(args)
    assert sorted(s.name for s in fields["models"]) == ["qwen-4bit", "qwen-small"]
    assert fields["max_loaded_models"] == 1
