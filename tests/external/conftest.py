"""The external lane: real agent CLIs (tests/external/clients.txt, installed by tools/install-agent-clis.sh) run
headless against the served demo model on 127.0.0.1. A missing CLI skips its test, except under CI=true, where
it fails: CI must not pass by skipping."""

from __future__ import annotations

import pytest
from agent_lane import RESULTS, isolated_env as make_isolated_env, start_demo_server, stop_demo_server


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    server = start_demo_server(tmp_path_factory.mktemp("server") / "serve.log")
    yield server
    stop_demo_server(server)


@pytest.fixture
def long_answer_server(tmp_path):
    """For Codex 0.171, which sends no max_output_tokens and fails a turn whose answer was cut short
    ("incomplete"): answers run to the model's end-of-text token, as on a server `mlxhost launch` starts (the
    random model's answers end after ~3k tokens on average)."""
    server = start_demo_server(tmp_path / "serve.log", default_max_tokens=32_000)
    yield server
    stop_demo_server(server)


@pytest.fixture
def isolated_env(tmp_path):
    """A home of its own for the agent (its config, sessions and history live there), and a project folder."""
    return make_isolated_env(tmp_path)


def pytest_terminal_summary(terminalreporter):
    if RESULTS:
        terminalreporter.section("agent CLIs against the demo model")
        for line in RESULTS:
            terminalreporter.write_line(line)
