"""The package's import layers, read from the source (nothing is imported): config.py is the lowest room, lower
rooms never import higher ones, module-level imports form no cycle, and an import inside a function says why.

Imports under `if TYPE_CHECKING:` are for type checkers only and count for none of these.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "mlxhost"

# Rooms from the bottom up: nothing in a room imports a room of a later tier, at module level or inside a
# function (kv/, memory/ and multimodal/ never reach engine/; frontends/ never reaches server/).
TIERS = [
    ("kv", "memory", "multimodal", "structured", "platform", "lora", "models"),
    ("engine",),
    ("serving",),
    ("frontends",),
    ("server",),
]
LAYERS = [(f"mlxhost.{low}", f"mlxhost.{high}") for i, tier in enumerate(TIERS) for low in tier
          for later in TIERS[i + 1:] for high in later]

# Where the fixture builders of testing/ are a product feature; everywhere else product code never imports them.
TESTING_AS_PRODUCT = {
    "mlxhost.bench": "benchmarks run on fixture models (`mlxhost bench ...`)",
    "mlxhost.server.cli": "`mlxhost demo-model` builds the demo and family folders",
    "mlxhost.server.app": "`mlxhost serve` with no model serves the demo model",
    "mlxhost.server.banner": "the banner names the demo model",
    "mlxhost.models.catalog": "`mlxhost list` lists the demo model",
}


def _load_arch_report() -> ModuleType:
    """tools/arch_report.py, loaded by path (tools/ is no package): its Tarjan's algorithm finds the cycles here too."""
    spec = importlib.util.spec_from_file_location("arch_report", ROOT / "tools" / "arch_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_cycles = _load_arch_report().cycles  # strongly connected components of more than one module


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    targets: frozenset[str]  # the package's modules it loads
    in_function: bool

    def where(self) -> str:
        return f"{_path(self.module)}:{self.line}"


def _path(module: str) -> str:
    return str(_sources()[module][0].relative_to(PACKAGE.parents[1]))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, tuple[Path, str]]:
    return {_module_name(p): (p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> frozenset[str]:
    known = _sources()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        while name:  # a module's packages run first: their __init__ is imported too
            found.add(name)
            name = name.rpartition(".")[0]
    # A module's own packages are initialised before it, so importing them closes no cycle.
    return frozenset(t for t in found if t != module and not module.startswith(t + "."))


@cache
def imports() -> tuple[Import, ...]:
    found = []
    for module, (path, source) in _sources().items():
        is_package = path.name == "__init__.py"

        def walk(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    targets = _targets(child, module, is_package)
                    if targets:
                        found.append(Import(module, child.lineno, targets, in_function))
                elif isinstance(child, ast.If) and _is_type_checking(child.test):
                    for other in child.orelse:
                        walk(ast.Module(body=[other], type_ignores=[]), in_function)
                else:
                    walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        walk(ast.parse(source, str(path)), False)
    return tuple(found)


def _deepest(targets: frozenset[str]) -> set[str]:
    """The modules an import names, without the packages above them that Python imports on the way."""
    return {t for t in targets if not any(other.startswith(t + ".") for other in targets)}


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_config_imports_nothing_of_the_package():
    offenders = [f"{i.where()} imports {', '.join(sorted(i.targets))}" for i in imports() if i.module == "mlxhost.config"]
    assert not offenders, "config.py is the lowest room; it imports:\n  " + "\n  ".join(offenders)


def test_lower_rooms_do_not_import_higher_ones():
    offenders = [f"{i.where()} imports {target} ({low} is below {high})"
                 for low, high in LAYERS for i in imports() if _within(i.module, low)
                 for target in sorted(_deepest(i.targets)) if _within(target, high)]
    assert not offenders, "imports against the layers:\n  " + "\n  ".join(offenders)


def test_product_code_does_not_import_the_test_fixtures():
    offenders = [f"{i.where()} imports {target}" for i in imports()
                 if not _within(i.module, "mlxhost.testing") and not any(_within(i.module, m) for m in TESTING_AS_PRODUCT)
                 for target in sorted(_deepest(i.targets)) if _within(target, "mlxhost.testing")]
    assert not offenders, ("product code imports testing/ (a fixture builder that is a product feature is listed in "
                           "TESTING_AS_PRODUCT with why):\n  " + "\n  ".join(offenders))


def test_module_level_imports_form_no_cycle():
    graph: dict[str, set[str]] = {module: set() for module in _sources()}
    lines: dict[tuple[str, str], int] = {}
    for i in imports():
        if not i.in_function:
            graph[i.module] |= i.targets
            for target in i.targets:
                lines.setdefault((i.module, target), i.line)
    found = _cycles(graph)
    report = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b} (line {lines[a, b]})" for a in component for b in sorted(graph[a] & members)]
        report.append(f"{len(component)} modules:\n    " + "\n    ".join(edges))
    assert not found, "module-level import cycles:\n  " + "\n  ".join(report)


def _comment_lines(source: str) -> set[int]:
    """Lines carrying a comment that says something (a bare `noqa` or `type: ignore` says no why)."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        text = token.string.lstrip("#").strip()
        if token.type == tokenize.COMMENT and text and not text.startswith(("noqa", "type: ignore")):
            lines.add(token.start[0])
    return lines


def _unexplained(path: Path, source: str) -> list[int]:
    """Lines of function-level imports without a comment: on the import's lines, or on the line above the run of
    adjacent imports it belongs to, or on any line of that run (sorting may move the commented import)."""
    comments = _comment_lines(source)
    spans: dict[int, int] = {}  # first line -> last line of each function-level import
    for func in ast.walk(ast.parse(source, str(path))):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    spans[node.lineno] = node.end_lineno or node.lineno
    ends = {end: start for start, end in spans.items()}
    unexplained = []
    for start in sorted(spans):
        first, last = start, spans[start]
        while first - 1 in ends:  # adjacent imports above
            first = ends[first - 1]
        while last + 1 in spans:  # and below
            last = spans[last + 1]
        if not any(line in comments for line in range(first - 1, last + 1)):
            unexplained.append(start)
    return unexplained


def test_function_level_imports_say_why():
    offenders = [f"{path.relative_to(PACKAGE.parents[1])}:{line}" for module, (path, source) in _sources().items()
                 for line in _unexplained(path, source)]
    assert not offenders, (f"{len(offenders)} imports inside functions without a comment saying why (an optional "
                           "dependency, a heavy import kept off start-up, a real cycle); move the others to the "
                           "top of the module:\n  " + "\n  ".join(offenders))


def test_the_checks_see_what_they_look_for(tmp_path):
    source = ("def f():\n    import json\n\n\ndef g():\n    # mlx only where it runs\n    import mlx.core\n"
              "    import numpy\n\n\ndef h():\n    import os  # a cycle\n")
    assert _unexplained(tmp_path / "x.py", source) == [2]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}}) == [["c", "d", "e"], ["a", "b"]]
    assert {i.module for i in imports()} >= {"mlxhost.server.cli", "mlxhost.engine.core"}
