import shutil
import struct

import pytest

from mlxserve.cli import main
from mlxserve.models.loader import ModelLoadError, load_model


@pytest.fixture
def model_copy(qwen3_model_dir, tmp_path):
    return shutil.copytree(qwen3_model_dir, tmp_path / "model")


def test_good_folder_loads(model_copy):
    loaded = load_model(str(model_copy))
    assert loaded.config["model_type"] == "qwen3"


def test_truncated_file_names_it(model_copy):
    path = model_copy / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated: \d+ bytes, header says \d+"):
        load_model(str(model_copy))


def test_garbage_header(model_copy):
    path = model_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + header_len] = b"\xff" * header_len
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: bad safetensors header"):
        load_model(str(model_copy))


def test_absurd_header_length(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or not safetensors"):
        load_model(str(model_copy))


def test_serve_exits_with_the_message(model_copy, capsys):
    path = model_copy / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(100)
    assert main(["serve", str(model_copy)]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err
