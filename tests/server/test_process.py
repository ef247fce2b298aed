"""The serving process's environment knobs (process.py): a bad one is reported before anything loads."""

import pytest

from mlxhost.server import cli, process


@pytest.mark.parametrize("value, seconds", [(None, None), ("", None), ("1", 0.001), ("0.5", 0.0005)])
def test_switch_interval_from_the_environment(value, seconds):
    environ = {} if value is None else {process.SWITCH_INTERVAL_ENV: value}
    assert process.switch_interval_s(environ) == seconds


@pytest.mark.parametrize("value", ["0", "-1", "fast", "nan", "inf"])
def test_a_bad_switch_interval_stops_serve_with_a_message(value, monkeypatch, capsys):
    monkeypatch.setenv(process.SWITCH_INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=process.SWITCH_INTERVAL_ENV):
        process.switch_interval_s()
    # before the port is taken and the model loads: the folder does not even exist
    assert cli.main(["serve", "/nonexistent/model", "--port", "0"]) == 2
    assert process.SWITCH_INTERVAL_ENV in capsys.readouterr().err
