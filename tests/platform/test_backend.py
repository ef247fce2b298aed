"""Backend-dependent defaults: the prefill step size `mlxhost serve` uses when none is given."""

from __future__ import annotations

import mlxhost.platform.backend as backend
import mlxhost.server.cli as cli
import mlxhost.server.serve_command as serve_command


def test_prefill_step_size_is_2048_on_cuda_and_512_elsewhere(monkeypatch):
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    assert backend.default_prefill_step_size() == 2048
    monkeypatch.setattr(backend, "is_cuda", lambda: False)
    assert backend.default_prefill_step_size() == 512


def test_serve_takes_the_backend_default_unless_a_size_is_given(monkeypatch):
    monkeypatch.setattr(serve_command, "default_prefill_step_size", lambda: 2048)
    parser = cli.make_parser()
    assert serve_command._engine_config(parser.parse_args(["serve", "m"])).prefill_step_size == 2048
    assert serve_command._engine_config(parser.parse_args(["serve", "m", "--prefill-step-size", "256"])).prefill_step_size == 256
