"""The one place tests ask for what lies beyond the test extra (mlxhost.testing.needs)."""

from __future__ import annotations

import pathlib

import pytest

from mlxhost.testing import needs, real_models

CLIENTS = pathlib.Path(__file__).resolve().parents[1] / "external" / "clients.txt"


def _missing(monkeypatch, name: str, ci_installs: bool = True) -> None:
    monkeypatch.setitem(needs.OPTIONAL, name, needs.Prerequisite(lambda: None, f"install {name}", ci_installs))


def test_a_missing_thing_skips_with_its_install_line(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    _missing(monkeypatch, "thing")
    with pytest.raises(pytest.skip.Exception, match="^needs thing: install thing$"):
        needs.need("thing")


def test_under_ci_a_missing_thing_fails_unless_ci_cannot_install_it(monkeypatch):
    monkeypatch.setenv("CI", "true")
    _missing(monkeypatch, "thing")
    _missing(monkeypatch, "gpu", ci_installs=False)
    with pytest.raises(pytest.fail.Exception, match="needs thing"):
        needs.need("thing")
    with pytest.raises(pytest.skip.Exception, match="needs gpu"):
        needs.need("gpu")


def test_need_returns_where_the_first_thing_is(monkeypatch):
    monkeypatch.setitem(needs.OPTIONAL, "a", needs.Prerequisite(lambda: "/bin/a", "x"))
    monkeypatch.setitem(needs.OPTIONAL, "b", needs.Prerequisite(lambda: "/bin/b", "x"))
    assert needs.need("a", "b") == "/bin/a" and needs.find("b") == "/bin/b"


def test_an_agent_cli_is_found_in_the_pinned_prefix(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXHOST_AGENT_CLIS", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert needs.find("codex") is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "codex").touch()
    assert needs.find("codex") == str(tmp_path / "bin" / "codex")


def test_every_pinned_agent_cli_and_real_model_is_known():
    commands = {line.split()[3] for line in CLIENTS.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")}
    assert commands | set(real_models.MODELS) <= set(needs.OPTIONAL)


def test_a_real_model_is_found_in_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(real_models.ENV_CACHE, str(tmp_path))
    assert needs.find("smollm2") is None
    assert needs.missing_reason("smollm2").startswith("needs smollm2: python -m mlxhost.testing.real_models fetch")
