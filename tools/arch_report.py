"""The package's shape in numbers: largest modules, function-level imports, the module-level import cycles, and
the dicts keyed by request id in engine/ and kv/ (each is per-request state with its own owner).

usage: python tools/arch_report.py [--top 15] [--root src/mlxhost]

A report, not a gate: file size is no rule (split by responsibility, never by count); tests/test_import_layers.py
is the gate for import layers and cycles (it finds them with `cycles` below). Everything here is read from the AST;
nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections import Counter
from pathlib import Path

# Attribute names and key expressions that say "request id".
_REQUEST_NAME = re.compile(r"(^|_)(req|reqs|request|requests|rid|rids)(_|$)")
_REQUEST_KEY = re.compile(r"(^|\.)(rid|req_id|request_id)$")
_REQUEST_COMMENT = re.compile(r"#.*\b(request|req|rid)\b", re.IGNORECASE)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_internal(node: ast.stmt, package: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] == package
    return any(alias.name.split(".")[0] == package for alias in node.names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_by_level(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(module-level imports outside `if TYPE_CHECKING:`, imports inside a function body)."""
    module_level: list[ast.stmt] = []
    function_level: list[ast.stmt] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (function_level if in_function else module_level).append(child)
            elif isinstance(child, ast.If) and not in_function and _is_type_checking(child.test):
                walk(ast.Module(body=child.orelse, type_ignores=[]), in_function)
            else:
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return module_level, function_level


def imported_modules(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules an import statement loads (a `from pkg import name` loads pkg.name if it is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(root: Path, function_level: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules its module-level imports load (parents' __init__ included, as Python does);
    with `function_level`, those its functions' imports load as well (the graph once every function has run)."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        module_level, in_functions = imports_by_level(ast.parse(path.read_text(), str(path)))
        targets: set[str] = set()
        for node in module_level + (in_functions if function_level else []):
            for target in imported_modules(node, module, path.name == "__init__.py", known):
                targets.add(target)
                parent = target.rpartition(".")[0]
                while parent in known:
                    targets.add(parent)
                    parent = parent.rpartition(".")[0]
        targets.discard(module)
        # A package's __init__ runs before its submodules, so a submodule importing its own parent is no edge.
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found, key=len, reverse=True)


def _dict_annotation(annotation: ast.expr | None) -> str | None:
    """The key type's source of a dict[...] / Dict[...] / defaultdict[...] annotation, else None."""
    if isinstance(annotation, ast.Subscript):
        name = ast.unparse(annotation.value).rpartition(".")[2]
        if name in ("dict", "Dict", "defaultdict", "DefaultDict", "OrderedDict"):
            key = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
            return ast.unparse(key)
    return None


def _is_dict_value(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return True
    if isinstance(value, ast.Call):
        name = ast.unparse(value.func).rpartition(".")[2]
        if name in ("dict", "defaultdict", "OrderedDict"):
            return True
        if name == "field":  # dataclasses.field(default_factory=dict)
            return any(k.arg == "default_factory" and ast.unparse(k.value) in ("dict", "defaultdict")
                       for k in value.keywords)
    return False


def request_keyed_dicts(path: Path) -> list[str]:
    """Dict attributes of classes in `path` that are keyed by request id.

    A dict attribute (annotated dict[...] or assigned a dict) counts when it is subscripted with a request-id
    expression (rid, req_id, request_id, x.request_id), or its key type is str and its name or its line's comment
    speaks of requests.
    """
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for cls in ast.walk(ast.parse(source, str(path))):
        if not isinstance(cls, ast.ClassDef):
            continue
        dicts: dict[str, tuple[str | None, int]] = {}  # attribute -> (key type, line)
        keyed_by_request: set[str] = set()
        for node in ast.walk(cls):
            target = annotation = value = None
            if isinstance(node, ast.AnnAssign):
                target, annotation, value = node.target, node.annotation, node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            if target is not None:
                name = None
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    name = target.attr
                elif isinstance(target, ast.Name) and node in cls.body:
                    name = target.id
                key = _dict_annotation(annotation)
                if name and (key is not None or _is_dict_value(value)) and name not in dicts:
                    dicts[name] = (key, node.lineno)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if ast.unparse(node.value.value) == "self" and _REQUEST_KEY.search(ast.unparse(node.slice)):
                    keyed_by_request.add(node.value.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                # self.x.get(rid) / .pop(rid) / .setdefault(rid, ...)
                owner = node.func.value
                if (node.func.attr in ("get", "pop", "setdefault") and isinstance(owner, ast.Attribute)
                        and ast.unparse(owner.value) == "self" and _REQUEST_KEY.search(ast.unparse(node.args[0]))):
                    keyed_by_request.add(owner.attr)
        for name, (key, line) in sorted(dicts.items(), key=lambda item: item[1][1]):
            spoken = _REQUEST_NAME.search(name.strip("_")) or _REQUEST_COMMENT.search(lines[line - 1])
            if name in keyed_by_request or (key == "str" and spoken):
                found.append(f"{cls.name}.{name}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="src/mlxhost", help="the package folder (default: src/mlxhost)")
    parser.add_argument("--top", type=int, default=15, help="rows in each list (default: 15)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    paths = sorted(root.rglob("*.py"))

    sizes: list[tuple[int, str]] = []
    function_imports: Counter[str] = Counter()
    num_module_level = num_internal = 0
    for path in paths:
        text = path.read_text()
        sizes.append((len(text.splitlines()), str(path.relative_to(root))))
        module_level, function_level = imports_by_level(ast.parse(text, str(path)))
        num_module_level += len(module_level)
        num_internal += sum(1 for node in function_level if _is_internal(node, root.name))
        if function_level:
            function_imports[str(path.relative_to(root))] = len(function_level)

    sizes.sort(reverse=True)
    print(f"{len(paths)} modules, {sum(n for n, _ in sizes)} lines")
    print("\nlargest modules (lines):")
    for lines, name in sizes[: args.top]:
        print(f"  {lines:6d}  {name}")

    num_function_level = sum(function_imports.values())
    share = num_function_level / max(1, num_function_level + num_module_level)
    print(f"\nimports: {num_module_level} module-level, {num_function_level} function-level ({share:.0%}), "
          f"in {len(function_imports)} files; {num_internal} of them of the package itself; most:")
    for name, count in function_imports.most_common(args.top):
        print(f"  {count:6d}  {name}")

    for title, function_level in (("module-level imports", False), ("with function-level imports", True)):
        found = cycles(import_graph(root, function_level))
        print(f"\nimport cycles, {title}: {len(found)}" + (f" (largest: {len(found[0])} modules)" if found else ""))
        for component in found:
            print(f"  {len(component):4d}: {', '.join(component[:8])}{' ...' if len(component) > 8 else ''}")

    print("\nrequest-keyed dicts (engine/, kv/):")
    total = 0
    for room in ("engine", "kv"):
        for path in sorted((root / room).rglob("*.py")):
            for name in request_keyed_dicts(path):
                total += 1
                print(f"  {path.relative_to(root)}: {name}")
    print(f"  total: {total}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
