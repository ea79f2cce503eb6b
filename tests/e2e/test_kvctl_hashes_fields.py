"""`--hashes A,,B` (a hash lost in a paste) is taken as `A,B`: the lookup, pin, move or
transfer then names a different chain (B's parent is not A), silently. `--tokens 1,,2` is
refused for exactly this reason (cli/tokens.py: "no empty field ("1,,2" is a slip)").
Bad input gets one line naming the field and exit 2, before any call is made."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import script

H = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("value", [f"{H},,{H}", f",{H}", f"{H},"])
def test_empty_hash_field_is_refused_like_an_empty_token_field(value):
    # nothing listens on port 1: input checks must answer before any call
    proc = subprocess.run(
        [script("kvctl"), "--endpoint", "127.0.0.1:1", "lookup", "--model", "demo-model", "--hashes", value],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("kvctl: --hashes:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_token_field_is_refused_baseline():
    proc = subprocess.run(
        [script("kvctl"), "--endpoint", "127.0.0.1:1", "lookup", "--model", "demo-model", "--tokens", "1,,2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "empty field" in proc.stderr, proc.stderr
