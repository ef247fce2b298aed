"""The server and the command line never import the export's heavy dependencies; only an export does."""

from __future__ import annotations

import subprocess
import sys


def test_server_and_cli_import_neither_torch_nor_coremltools():
    code = ("import sys, mlxhost.server.app, mlxhost.server.cli\n"
            "mlxhost.server.cli.make_parser()\n"
            "print(sorted(m for m in ('torch', 'coremltools', 'mlxhost.export.wrapper') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_export_without_the_extra_names_it(monkeypatch, capsys, tmp_path):
    import importlib.util

    from mlxhost.server.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "coremltools" else real(name, *a))
    assert main(["export", "coreml", str(tmp_path), str(tmp_path / "m.mlpackage")]) == 2
    assert 'pip install "mlxhost[coreml]"' in capsys.readouterr().err
