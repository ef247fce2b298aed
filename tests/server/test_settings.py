"""`mlxhost serve` settings: flags win over MLXHOST_<FLAG>, which wins over --config YAML, then the
built-in defaults; every flag's --help shows its default."""

import os

import pytest

from mlxhost.server import cli, serve_command
from mlxhost.server.settings import settings_defaults


def _serve_args(argv, monkeypatch, env=None):
    """The namespace main() would hand _serve (it stops there: _serve is replaced)."""
    for name in [n for n in os.environ if n.startswith("MLXHOST_")]:
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    seen = {}
    # make_parser (run inside main) picks up the stand-in, which keeps the namespace instead of serving.
    monkeypatch.setattr(serve_command, "_serve", lambda args: seen.setdefault("args", args) and 0)
    cli.main(["serve", *argv])
    return seen["args"]


def test_env_sets_a_flag_and_the_flag_wins(monkeypatch):
    args = _serve_args([], monkeypatch, {"MLXHOST_PORT": "9000", "MLXHOST_MAX_NUM_SEQS": "8"})
    assert (args.port, args.max_num_seqs) == (9000, 8)
    args = _serve_args(["--port", "9100"], monkeypatch, {"MLXHOST_PORT": "9000"})
    assert args.port == 9100


def test_config_file_under_env_under_flags(monkeypatch, tmp_path):
    cfg = tmp_path / "mlxhost.yaml"
    cfg.write_text("port: 9001\nmax-num-seqs: 4\nno_prefix_cache: true\nmemory_mode: dedicated\n"
                   "api-key: [k1, k2]\nmodel: /models/qwen\n")
    args = _serve_args(["--config", str(cfg)], monkeypatch)
    assert (args.port, args.max_num_seqs, args.no_prefix_cache, args.memory_mode) == (9001, 4, True, "dedicated")
    assert args.api_key == ["k1", "k2"] and args.model == "/models/qwen" and args.extra_models == []
    args = _serve_args(["--config", str(cfg), "--max-num-seqs", "2"], monkeypatch, {"MLXHOST_PORT": "9002"})
    assert (args.port, args.max_num_seqs) == (9002, 2)
    args = _serve_args([], monkeypatch, {"MLXHOST_CONFIG": str(cfg)})
    assert args.port == 9001


def test_several_models_and_booleans_from_env(monkeypatch):
    args = _serve_args([], monkeypatch, {"MLXHOST_MODEL": "a=/m/a,b=/m/b", "MLXHOST_NO_PREFIX_CACHE": "0",
                                         "MLXHOST_METRICS_PUBLIC": "yes"})
    assert args.model is None and args.extra_models == ["a=/m/a", "b=/m/b"]
    assert args.no_prefix_cache is False and args.metrics_public is True


def test_bad_values_and_unknown_keys_are_named(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _serve_args([], monkeypatch, {"MLXHOST_MEMORY_MODE": "greedy"})
    assert "MLXHOST_MEMORY_MODE" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prot: 9000\n")
    with pytest.raises(SystemExit):
        _serve_args(["--config", str(cfg)], monkeypatch)
    assert "prot" in capsys.readouterr().err


def test_unrelated_mlxhost_variables_are_ignored():
    parser = cli.make_parser()
    serve = parser.parse_args(["serve"]).settings_parser
    assert settings_defaults(serve, None, {"MLXHOST_SOMETHING_ELSE": "x"}) == {}


def test_help_shows_every_serve_flag_with_help_and_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "port to listen on (default: 8000)" in text
    assert "(default: 64)" in text  # --max-num-seqs
    serve = cli.make_parser().parse_args(["serve"]).settings_parser
    assert all(a.help for a in serve._actions if a.option_strings)


def test_version(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("mlxhost 0.1.0")



def test_a_bare_yaml_on_or_off_is_the_word_not_a_boolean(monkeypatch, tmp_path):
    # YAML 1.1 reads `fim: on` as true: a flag whose choices are on/off takes it as the word.
    cfg = tmp_path / "mlxhost.yaml"
    cfg.write_text("fim: on\nwarmup: off\n")
    args = _serve_args(["--config", str(cfg)], monkeypatch)
    assert (args.fim, args.warmup) == ("on", "off")
