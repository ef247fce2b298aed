"""frontends/ is HTTP only: no module imports MLX, directly or through what it imports, and no dialect
imports another dialect (they share only common/; app.py puts them together)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mlxhost.frontends

ROOT = Path(mlxhost.frontends.__file__).parent
PACKAGE = "mlxhost.frontends"
# The MLX packages: the core and the model libraries built on it.
MLX_PACKAGES = ("mlx", "mlx_lm", "mlx_vlm", "mlx_audio", "mlx_embeddings")
MODULES = sorted(ROOT.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join((PACKAGE, *parts)).removesuffix(".__init__")


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every module an import statement anywhere in `tree` names (inside functions too), made absolute."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: against the module's own package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            names.append(target)
            # `from mlxhost.frontends import anthropic` names a package too.
            names += [f"{target}.{alias.name}" for alias in node.names]
    return names


def room(name: str) -> str | None:
    """The folder of frontends/ that module `name` lives in (a dialect or "common"); None for app.py and
    the package itself, and for modules outside frontends/."""
    parts = name.split(".")
    if parts[:2] != PACKAGE.split(".") or len(parts) < 3 or parts[2] == "app":
        return None
    return parts[2]


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    home = room(module)
    found = []
    for name in imported_names(ast.parse(source), module, is_package):
        if name.split(".")[0] in MLX_PACKAGES:
            found.append(f"{module} imports {name}")
        other = room(name)
        if home is not None and other is not None and other not in (home, "common"):
            found.append(f"{module} ({home}/) imports {name} ({other}/)")
    return found


def test_every_frontend_module_is_parsed():
    rooms = {room(module_name(p)) for p in MODULES}
    assert {"common", "openai", "anthropic", "responses", "embeddings", "admin", "ollama", "rerank",
            "audio"} <= rooms


def test_no_mlx_import_and_no_dialect_imports_another():
    found = [v for p in MODULES for v in violations(module_name(p), p.read_text(), p.name == "__init__.py")]
    assert not found, "\n".join(found)


def test_the_check_catches_what_it_forbids():
    # Each forbidden kind is found (the rule would pass on anything if the parsing missed imports).
    def check(module: str, source: str, is_package: bool = False) -> int:
        return len(violations(f"{PACKAGE}.{module}", source, is_package))

    assert check("anthropic.render", "from mlxhost.frontends.openai.render import CompletionBuilder\n") == 2
    assert check("anthropic.render", "from ..openai import render\n") == 2
    assert check("rerank", "from .. import ollama\n", is_package=True) == 1
    assert check("rerank", "from . import methods\n", is_package=True) == 0
    assert check("ollama.routes", "from mlxhost.frontends import rerank\n") == 1
    assert check("common.sse", "def f():\n    import mlx.core as mx\n") == 1
    assert check("common.gateway", "from mlxhost.frontends.openai import routes\n") == 2
    assert check("app", "from mlx_lm import load\n") == 2  # the module and the name it takes
    # Allowed: a dialect's own modules, common/, other packages; app.py wires every dialect.
    assert check("openai.routes", "from mlxhost.frontends.common.sse import sse\nfrom . import render\n"
                 "from mlxhost.engine.request import RequestOutput\n") == 0
    assert check("app", "from mlxhost.frontends.anthropic.routes import add_anthropic_routes\n") == 0


_BLOCK_MLX = """
import importlib.abc, importlib.util, pkgutil, sys

class NoMLX(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ImportError(f"frontends imported {{name}}")
        return None

sys.meta_path.insert(0, NoMLX())
import mlxhost.frontends as f
names = [m.name for m in pkgutil.walk_packages(f.__path__, f.__name__ + ".")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m.split(".")[0] in {packages!r}]
print(len(names))
"""


def test_every_frontend_module_imports_with_mlx_missing():
    """Each module imported in a fresh interpreter where importing any MLX package raises: nothing under
    frontends/ pulls MLX in at import time, through any module it imports."""
    code = _BLOCK_MLX.format(packages=MLX_PACKAGES)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == len([p for p in MODULES]) - 1  # every module but the package itself
