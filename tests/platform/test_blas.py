"""The system OpenBLAS for MLX's CPU wheel (platform/blas.py)."""

import subprocess
import sys

import pytest

from mlxhost.platform import blas


def test_off_by_the_environment():
    choice = blas.use_system_blas({blas.ENV: "0"})
    assert choice.loaded is None and not choice.slow


def test_a_preload_is_left_as_it_is():
    choice = blas.use_system_blas({"LD_PRELOAD": "/x/libopenblas.so.0"})
    assert choice.loaded == "/x/libopenblas.so.0" and not choice.slow


def test_too_late_once_mlx_is_imported():
    import mlx.core  # noqa: F401  (the point: symbols are bound already)

    choice = blas.use_system_blas({})
    assert choice.loaded is None and not choice.slow


def test_candidates_name_the_debian_pthread_build_first():
    assert blas.candidates("x86_64")[0] == "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas.candidates("arm64")[0].startswith("/usr/lib/aarch64-linux-gnu/")


_PROBE = """
import sys
sys.modules.pop("mlx.core", None)
from mlxhost.platform.blas import use_system_blas
choice = use_system_blas({%s})
import mlx.core
print(choice.loaded, choice.slow, "|", choice.reason)
"""


def _probe(environ: str) -> str:
    return subprocess.run([sys.executable, "-c", _PROBE % environ], capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_a_file_that_is_no_library_keeps_mlx_blas_and_says_so(tmp_path):
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"")  # what a bind-mounted /dev/null looks like to the loader
    out = _probe(f"{blas.ENV!r}: {str(fake)!r}")
    assert out.startswith("None True |") and "could be loaded" in out


def test_one_asks_for_the_search_not_for_a_file_named_1():
    # Taken as a path, "1" sent the loader after a library called "1" and the search never ran.
    out = _probe(f"{blas.ENV!r}: '1'")
    # The search ran: a library it found is loaded, or its candidates are named, or none exists here.
    assert "could be loaded (1:" not in out
    assert "libopenblas" in out or "no OpenBLAS on this machine" in out


@pytest.mark.needs("openblas")
def test_the_system_openblas_is_loaded_before_mlx():
    out = _probe("")
    assert "openblas" in out.split("|")[0] and "False" in out
