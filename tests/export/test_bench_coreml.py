"""`mlxhost bench coreml`: its plan and package reading work anywhere; running needs macOS."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mlxhost.bench.coreml import plan
from mlxhost.server.cli import main


def test_plan_leaves_room_for_the_extend_steps():
    assert plan(2048, [256, 512, 1024, 2048, 4096], 100) == [(256, 156), (512, 412), (1024, 924), (2048, 1948)]
    assert plan(64, [32, 64], 100) == []


@pytest.mark.skipif(sys.platform == "darwin", reason="the message is for systems without Core ML")
def test_other_systems_get_a_clear_message_and_a_non_zero_exit(tmp_path, capsys):
    assert main(["bench", "coreml", str(tmp_path / "model.mlpackage")]) == 2
    err = capsys.readouterr().err
    assert "needs macOS" in err and "export coreml" in err


@pytest.mark.needs("torch", "coremltools")
def test_package_limits_read_from_the_spec(int4_package):
    import coremltools as ct

    from mlxhost.bench.coreml import package_limits
    from tests.export.conftest import CONTEXT

    assert package_limits(ct.models.MLModel(str(int4_package), skip_model_load=True)) == (CONTEXT, np.float16)
