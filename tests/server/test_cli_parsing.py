"""Command-line mistakes are named, never guessed: no abbreviated flags, the closest command for a mistyped one."""

from __future__ import annotations

import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server import cli, serve_command


def _fails(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_a_flag_prefix_is_not_taken_for_the_flag(monkeypatch, capsys):
    monkeypatch.setattr(serve_command, "_serve", lambda args: pytest.fail("served with an abbreviated flag"))
    monkeypatch.delenv("MLXHOST_MAX_NUM_SEQS", raising=False)
    err = _fails(["serve", "--max-num-seq", "8"], capsys)
    assert err[0] == "mlxhost serve: error: unknown flag --max-num-seq (did you mean --max-num-seqs?)"


def test_a_mistyped_command_gets_the_closest(capsys):
    assert _fails(["server"], capsys) == ["mlxhost: error: unknown command 'server'; did you mean 'serve'?",
                                          "(`mlxhost --help` lists the commands)"]
    assert _fails(["bench", "serv"], capsys)[0] == "mlxhost bench: error: unknown command 'serv'; did you mean 'serve'?"


def test_an_unknown_command_with_no_close_one_lists_them(capsys):
    err = _fails(["frobnicate"], capsys)[0]
    assert err.startswith("mlxhost: error: unknown command 'frobnicate'; the commands: serve, pull, list")


def test_names_a_registry_holds_are_checked_before_anything_loads():
    serve_command.check_registered_names(ServerConfig(engine=EngineConfig(speculative="ngram"),
                                                      tool_call_parser="hermes"))
    with pytest.raises(ValueError, match="speculative must be off, auto or one of .*ngram"):
        serve_command.check_registered_names(ServerConfig(engine=EngineConfig(speculative="nope")))
    file_model = ModelSpec(name="m", source="/m", engine=EngineConfig(speculative="nope"))
    with pytest.raises(ValueError, match="'nope'"):
        serve_command.check_registered_names(ServerConfig(models=(file_model,)))
    with pytest.raises(ValueError, match="nope"):
        serve_command.check_registered_names(ServerConfig(tool_call_parser="nope"))
