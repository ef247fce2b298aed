"""Building the demo model says what it is doing on stderr: `demo-model`, and a first `serve` with no model."""

from mlxhost.config import ServerConfig
from mlxhost.server import cli
from mlxhost.server.app import model_specs


def test_demo_model_prints_stages(tmp_path, capsys):
    assert cli.main(["demo-model", str(tmp_path / "m")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "m")
    assert "demo model: training the tokenizer..." in err and "demo model: done in" in err
    assert cli.main(["demo-model", str(tmp_path / "m")]) == 0  # already there: nothing built, nothing said
    assert capsys.readouterr().err == ""


def test_serve_without_a_model_shows_the_first_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("mlxhost.testing.demo.default_demo_model_dir", lambda: tmp_path / "demo")
    (spec,) = model_specs(ServerConfig())
    assert spec.source == str(tmp_path / "demo")
    assert "building the demo model (first run only): writing weights..." in capsys.readouterr().err
