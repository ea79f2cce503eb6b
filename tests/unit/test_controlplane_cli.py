"""`kvcp-controlplane`'s options reach the replica's configuration, and a value out of
range is refused naming the option (click's exit 2), before anything starts."""

from __future__ import annotations

import logging
import sys

import pytest
from click.testing import CliRunner

from controlplane import main as cp_main


class Started(Exception):
    pass


@pytest.fixture
def configs(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, config, log_fn=None):
            seen.append(config)

        def start(self):
            raise Started  # what the real one would serve with is all this test needs

    monkeypatch.setattr(cp_main, "ControlPlane", Recorder)
    # main() sets the process's GIL switch interval and the root logger: put back for the tests after
    interval, handlers = sys.getswitchinterval(), list(logging.getLogger().handlers)
    yield seen
    sys.setswitchinterval(interval)
    logging.getLogger().handlers[:] = handlers


def test_op_timeout_seconds_reaches_the_config(configs):
    result = CliRunner().invoke(cp_main.main, ["--op-timeout-seconds", "90", "--metrics-listen", ""])
    assert isinstance(result.exception, Started), result.output
    assert configs[0].op_timeout_seconds == 90.0


def test_op_timeout_seconds_defaults_to_a_minute(configs):
    CliRunner().invoke(cp_main.main, ["--metrics-listen", ""])
    assert configs[0].op_timeout_seconds == 60.0


@pytest.mark.parametrize("value", ["5", "-1", "soon"])
def test_an_op_timeout_out_of_range_is_refused_naming_the_option(configs, value):
    result = CliRunner().invoke(cp_main.main, ["--op-timeout-seconds", value])
    assert result.exit_code == 2 and "--op-timeout-seconds" in result.output, result.output
    assert not configs  # nothing started
