"""docs/flags.md's tables are the parsers' own help texts: a flag missing from the page, or a table that no longer
says what --help says, fails here (`python -m mlxhost.server.flags_doc` rewrites them)."""

from __future__ import annotations

import argparse

import pytest

from mlxhost.server import cli, flags_doc

PAGE = flags_doc.DOC.read_text()


def test_every_flag_of_the_listed_commands_is_on_the_page():
    missing = [f"{name} {flag}" for name, parser in flags_doc.command_parsers().items() for action in parser._actions
               for flag in action.option_strings if flag.startswith("--") and flag != "--help"
               and f"`{flag}" not in PAGE]
    assert not missing, f"not in docs/flags.md: {missing}; run python -m mlxhost.server.flags_doc"


def test_the_tables_are_current():
    assert flags_doc.render(PAGE, flags_doc.command_parsers()) == PAGE, \
        "docs/flags.md is stale: run python -m mlxhost.server.flags_doc"


def test_every_command_is_listed_or_left_to_its_help():
    parser = cli.make_parser(with_bench=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # A new command with flags of its own is listed on the page, or added here on purpose.
    assert set(sub.choices) == set(flags_doc.COMMANDS) | {"demo-model", "export", "bench"}


def _tiny() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x", add_help=False)
    p.add_argument("path", metavar="PATH", help="where (default: here (cwd))")
    p.add_argument("--size", type=int, default=0, metavar="N", help="how many | at most")
    p.add_argument("--flag", action="store_true", help="switch for MLXHOST_<FLAG>, hosts like *.example.com")
    p.add_argument("--key", action="append", default=[], help="a key (repeatable; default: `MLXHOST_KEY`)")
    p.add_argument("--hidden", help=argparse.SUPPRESS)
    p.add_argument_group("group").add_argument("--pct", default="50%", help="share (%(default)s, 100%%: all)")
    return p


def test_a_table_row_is_the_flag_its_default_and_its_help():
    section = flags_doc.section("x", _tiny())
    assert "| `PATH` | here (cwd) | where |" in section
    assert "| `--size N` | `0` | how many \\| at most |" in section  # a pipe must not split the row
    assert "| `--flag` |  | switch for MLXHOST_\\<FLAG>, hosts like \\*.example.com |" in section
    assert "| `--key KEY` | `MLXHOST_KEY` | a key (repeatable) |" in section
    assert "**group**" in section and "| `--pct PCT` | `50%` | share (50%, 100%: all) |" in section
    assert "--hidden" not in section


def test_render_rewrites_only_between_the_markers():
    parsers = {"x": _tiny()}
    page = "intro\n\n" + flags_doc.section("x", argparse.ArgumentParser(add_help=False)) + "\n\nafter\n"
    new = flags_doc.render(page, parsers)
    assert new.startswith("intro\n\n") and new.endswith("\n\nafter\n") and "`--size N`" in new
    assert flags_doc.render(new, parsers) == new
    with pytest.raises(ValueError, match="no markers for `mlxhost x`"):
        flags_doc.render("intro only", parsers)


def test_check_says_stale_and_writes_nothing(tmp_path, capsys):
    page = tmp_path / "flags.md"
    page.write_text(PAGE.replace("`--max-num-seqs N`", "`--max-num-seqs`"))
    before = page.read_text()
    assert flags_doc.main(["--check", "--path", str(page)]) == 1
    assert page.read_text() == before and "stale" in capsys.readouterr().err
    assert flags_doc.main(["--path", str(page)]) == 0 and page.read_text() == PAGE
    assert flags_doc.main(["--check", "--path", str(page)]) == 0
