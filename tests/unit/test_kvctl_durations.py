"""kvctl's own checks of what a user types, before anything is sent: durations (--ttl,
--timeout, --older-than) and tier names. Run through click as a user would; a bad value
is refused with a sentence naming the option, and no control plane is asked (the
endpoint given is not listening)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli.main import main, parse_duration
from protos.tier import Tier

NOWHERE = "127.0.0.1:9"  # nothing listens: a call that got this far would say it cannot connect


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("500ms", 0.5),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        ("30M", 1800.0),  # any case
        (" 2H ", 7200.0),
    ],
)
def test_durations_in_every_unit(text, seconds):
    assert parse_duration(text, "--ttl") == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-5s", "1e3s", "5 s", "5sec", "", "1w"])
def test_a_duration_that_does_not_parse_names_the_option(text, capsys):
    with pytest.raises(SystemExit) as info:
        parse_duration(text, "--older-than")
    assert info.value.code == 2
    assert "--older-than:" in capsys.readouterr().err


def kvctl(*args: str):
    return CliRunner().invoke(main, ["--endpoint", NOWHERE, "--timeout", "1s", *args])


def test_kvctl_pin_refuses_a_zero_ttl_and_a_tier_it_cannot_pin_at_before_calling():
    out = kvctl("pin", "--namespace", "kb", "--ttl", "0s")
    assert out.exit_code == 2 and "--ttl: must be positive" in out.output
    out = kvctl("pin", "--namespace", "kb", "--ttl", "1h", "--tier", "remote")  # reported, never asked for
    assert out.exit_code == 2 and "--tier: unknown tier 'remote'" in out.output
    out = kvctl("pin", "--namespace", "kb", "--ttl", "1 hour")
    assert out.exit_code == 2 and "--ttl: '1 hour' is not a duration" in out.output


def test_remote_is_no_tier_a_user_may_ask_for():
    for text in ("remote", "REMOTE", " Remote "):
        with pytest.raises(ValueError, match="unknown tier"):
            Tier.parse(text)
    assert Tier.parse(" Disk ") is Tier.DISK
