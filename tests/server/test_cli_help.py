"""Every flag of every `mlxhost` command (and of `python -m mlxhost.bench.hardening`) has help text
and shows its default in --help."""

from __future__ import annotations

import argparse

import pytest

from mlxhost.bench import hardening
from mlxhost.server import cli
from mlxhost.server.settings import HelpFormatter


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


ALL = list(_parsers(cli.make_parser(), "mlxhost")) + list(_parsers(hardening.make_parser(), "hardening"))
_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


@pytest.mark.parametrize("path,parser", ALL, ids=[path for path, _ in ALL])
def test_every_option_has_help_and_a_shown_default(path, parser):
    formatter = HelpFormatter(path)
    for action in parser._actions:
        if isinstance(action, _SKIP):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert (action.help or "").strip(), f"{path} {name}: no help text"
        if action.option_strings and not action.required:
            assert "default" in formatter._get_help_string(action), f"{path} {name}: no default shown"
    text = parser.format_help()  # every %(default)s and %% expands
    assert "%(" not in text


def test_bench_subcommands_are_all_walked():
    assert {p for p, _ in ALL} >= {f"mlxhost bench {n}" for n in
                                   ("serve", "engine", "compare", "prefix", "memory", "load", "multimodal",
                                    "structured", "plot")}


def test_defaults_read_as_typed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 1,2,4,8,16)" in text  # a list as typed on the command line, not [1, 2, 4, 8, 16]
    assert "--url URL base URL, e.g. http://127.0.0.1:8000[/v1] --model" in text  # required: no default
    assert "fields) (default: not set)" in text  # --no-ignore-eos: a switch, not "True"


@pytest.mark.parametrize("path,parser", ALL, ids=[path for path, _ in ALL])
def test_no_parser_takes_abbreviated_flags(path, parser):
    assert parser.allow_abbrev is False, path
