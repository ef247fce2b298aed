"""What the tests need beyond the `test` extra, found in one place: system programs, torch and coremltools, the
agent CLIs, the real models, OpenBLAS, a CUDA GPU. A test that lacks one is skipped with the reason and the
line that installs it (`needs espeak-ng: apt-get install espeak-ng`), so a fresh `pip install -e ".[test]"`
runs the suite to the end. Under CI=true a missing thing that CI installs fails instead: CI must not pass by
skipping.

    @pytest.mark.needs("espeak-ng")      # a test or a module (pytestmark); checked before its fixtures
    need("torch", "coremltools")        # in a fixture, or at a module's top before an import that needs it
"""

from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxhost.platform import backend
from mlxhost.testing import real_models

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
_AGENT_CLIS_INSTALL = "bash tools/install-agent-clis.sh"


@dataclass(frozen=True)
class Prerequisite:
    find: Callable[[], str | None]  # where it is (a path, a module name), or None
    install: str  # the line that installs it
    ci_installs: bool = True  # .ci/run installs it: missing under CI=true is a failure


def _program(*names: str) -> Callable[[], str | None]:
    return lambda: next(filter(None, map(shutil.which, names)), None)


def _module(name: str) -> Callable[[], str | None]:
    def find():
        try:
            importlib.import_module(name)
        except ImportError:  # a module hidden as None in sys.modules raises it too
            return None
        return name
    return find


def _agent_cli(command: str) -> Callable[[], str | None]:
    def find():
        # Imported here: mlxhost.agents is the CLI's package, the other things need none of it.
        from mlxhost.agents.launch import agent_clis_prefix

        installed = agent_clis_prefix() / "bin" / command
        return str(installed) if installed.exists() else shutil.which(command)
    return find


def _real_model(name: str) -> Callable[[], str | None]:
    def find():
        path = real_models.real_model_path(name)
        return str(path) if path is not None else None
    return find


def _cuda() -> str | None:
    return "cuda" if backend.is_cuda() else None


OPTIONAL: dict[str, Prerequisite] = {
    "espeak-ng": Prerequisite(_program("espeak-ng"), "apt-get install espeak-ng"),
    "chromium": Prerequisite(_program("chromium", "chromium-browser", "google-chrome", "chrome"),
                         "apt-get install chromium chromium-driver"),
    "chromedriver": Prerequisite(_program("chromedriver"), "apt-get install chromium-driver"),
    "curl": Prerequisite(_program("curl"), "apt-get install curl"),
    # The CPU build: PyPI's default on Linux brings CUDA libraries (gigabytes) the export never uses.
    "torch": Prerequisite(_module("torch"), "pip install torch --index-url https://download.pytorch.org/whl/cpu"),
    "coremltools": Prerequisite(_module("coremltools"),
                                'pip install "coremltools>=8.0" (or pip install -e ".[coreml]")'),
    # is_file: a library hidden under /dev/null (.ci/bare) still exists.
    "openblas": Prerequisite(lambda: str(OPENBLAS) if OPENBLAS.is_file() else None,
                             "apt-get install libopenblas0-pthread"),
    # Real MCP servers from PyPI, run over stdio (the test extra installs them).
    "mcp-server-time": Prerequisite(_program("mcp-server-time"), "pip install mcp-server-time"),
    "mcp-server-git": Prerequisite(_program("mcp-server-git"), "pip install mcp-server-git"),
    # The reference MCP server from npm, pinned with the agent CLIs (tests/external/clients.txt).
    "mcp-server-everything": Prerequisite(_agent_cli("mcp-server-everything"),
                                          f"{_AGENT_CLIS_INSTALL} mcp-server-everything"),
    "cuda": Prerequisite(_cuda, 'an NVIDIA GPU and pip install -e ".[cuda]"', ci_installs=False),
    **{command: Prerequisite(_agent_cli(command), f"{_AGENT_CLIS_INSTALL} {command}")
       for command in ("claude", "codex", "opencode", "qwen", "aider", "llm")},
    **{name: Prerequisite(_real_model(name), f"python -m mlxhost.testing.real_models fetch --only {name} "
                                         f"(into ${real_models.ENV_CACHE} or the user cache dir)")
       for name in real_models.MODELS},
}


def find(name: str) -> str | None:
    """Where the optional thing `name` is (a path or a module name), or None; never skips."""
    return OPTIONAL[name].find()


def missing_reason(name: str) -> str:
    return f"needs {name}: {OPTIONAL[name].install}"


def need(*names: str) -> str:
    """Where the first of `names` is; skips the test (or the module, at its top) naming the first missing one and
    its install line, or fails under CI=true when .ci/run installs it."""
    import pytest  # optional: the test extra

    found = []
    for name in names:
        where = find(name)
        if where is None:
            why = missing_reason(name)
            if OPTIONAL[name].ci_installs and os.environ.get("CI", "").lower() == "true":
                pytest.fail(why)
            pytest.skip(why, allow_module_level=True)
        found.append(where)
    return found[0] if found else ""
