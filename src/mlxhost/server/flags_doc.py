"""docs/flags.md's tables, written from the argparse parsers so that the page cannot drift from the code.

    python -m mlxhost.server.flags_doc           # rewrite the tables between the markers in docs/flags.md
    python -m mlxhost.server.flags_doc --check   # exit 1 when a table is stale (tests/server/test_flags_doc.py)

Each table row is a flag's invocation, its default and its help text: a better table is a better help text.
The prose around the markers is kept as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mlxhost.server.cli import make_parser
from mlxhost.server.settings import ArgumentParser

# The commands whose flags the page lists; demo-model, export and bench are listed by their --help alone.
COMMANDS = ("serve", "launch", "pull", "list", "convert")
DOC = Path(__file__).resolve().parents[3] / "docs" / "flags.md"  # the checkout's docs (editable install)
_MARK = "<!-- flags of `mlxhost {}` (written by python -m mlxhost.server.flags_doc from the help texts) -->"
_END = "<!-- end of flags of `mlxhost {}` -->"


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """COMMANDS' parsers, from the parser `mlxhost` itself uses."""
    parser = make_parser(with_bench=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def split_default(help_text: str) -> tuple[str, str]:
    """(help without its default, the default) from "... (default: X)" or "... (repeatable; default: X)"; X may
    hold parentheses of its own. The default is "" when the help names none."""
    at = help_text.find("default: ")
    if at < 1 or not (help_text[at - 1] == "(" or help_text[at - 2:at] == "; "):
        return help_text, ""
    depth, end = 0, len(help_text)
    for i in range(at, len(help_text)):
        depth += {"(": 1, ")": -1}.get(help_text[i], 0)
        if depth < 0:
            end = i
            break
    default = help_text[at + len("default: "):end]
    if help_text[at - 1] == "(":  # the whole parenthesis goes
        return (help_text[:at - 1].rstrip() + " " + help_text[end + 1:].lstrip()).strip(), default
    return help_text[:at - 2] + help_text[end:], default


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is False or value in ([], "", argparse.SUPPRESS) or \
            isinstance(action, argparse._StoreTrueAction):  # a switch: "False" would read as the feature's state
        return ""
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"`{value}`"


def _cell(text: str) -> str:
    """Help text as a table cell: one line, no column break, and outside `code` no HTML tag (MLXHOST_<FLAG>) or
    emphasis (`*.example.com`)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "\\<").replace("*", "\\*")
    return "`".join(parts)


def rows(actions: list[argparse.Action], prog: str) -> list[tuple[str, str, str]]:
    """(flag as --help shows it, default, meaning) for each of `actions` that --help shows."""
    formatter = argparse.HelpFormatter(prog)  # the plain one: help as written, no default appended
    out = []
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.help == argparse.SUPPRESS:
            continue
        meaning, default = split_default(formatter._expand_help(action) if action.help else "")
        invocation = formatter._format_action_invocation(action)
        out.append((f"`{invocation}`", default or _default(action), meaning))
    return out


def table(actions: list[argparse.Action], prog: str) -> str:
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    lines += [f"| {_cell(flag)} | {_cell(default)} | {_cell(meaning)} |"
              for flag, default, meaning in rows(actions, prog)]
    return "\n".join(lines)


def section(command: str, parser: argparse.ArgumentParser) -> str:
    """The marked block of one command: the ungrouped arguments, then a titled table per argument group."""
    untitled = ("positional arguments", "options")  # argparse's own two groups
    groups = [("", [a for g in parser._action_groups if g.title in untitled for a in g._group_actions])]
    groups += [(g.title, g._group_actions) for g in parser._action_groups if g.title not in untitled]
    parts = [(f"**{title}**\n\n" if title else "") + table(actions, parser.prog)
             for title, actions in groups if rows(actions, parser.prog)]
    return "\n".join([_MARK.format(command), "", "\n\n".join(parts), "", _END.format(command)])


def render(text: str, parsers: dict[str, argparse.ArgumentParser]) -> str:
    """`text` with each command's marked block rewritten; ValueError names a command whose markers are missing."""
    for command, parser in parsers.items():
        found = re.search(re.escape(_MARK.format(command)) + r".*?" + re.escape(_END.format(command)), text,
                          re.DOTALL)
        if found is None:
            raise ValueError(f"no markers for `mlxhost {command}`: add the lines\n{_MARK.format(command)}\n"
                             f"{_END.format(command)}")
        text = text[:found.start()] + section(command, parser) + text[found.end():]
    return text


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m mlxhost.server.flags_doc", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether the page is current (exit 1 when not)")
    p.add_argument("--path", type=Path, default=DOC, help="the page (default: docs/flags.md of this checkout)")
    args = p.parse_args(argv)
    try:
        old = args.path.read_text()
        new = render(old, command_parsers())
    except (OSError, ValueError) as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    if new == old:
        print(f"{args.path}: current")
        return 0
    if args.check:
        print(f"{args.path}: stale; run {p.prog}", file=sys.stderr)
        return 1
    args.path.write_text(new)
    print(f"{args.path}: rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
