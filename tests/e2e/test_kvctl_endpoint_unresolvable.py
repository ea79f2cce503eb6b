"""README l.790 and `kvctl --help`: `--endpoint cp1:50051,cp2:50051` — "a replica that
cannot be reached is skipped" / "a call that cannot connect to one goes to the next".
A replica whose host name does not resolve (a decommissioned host, a typo) cannot be
connected to either, but the facade does not skip it: gRPC's UNAVAILABLE then reads
"errors resolving HOST: ..." / "DNS resolution failed", which `_not_connected` does not
recognise, so the whole call fails. Alone, it also bypasses the documented sentence
(README l.235) and prints gRPC's raw text without naming --endpoint."""

from __future__ import annotations

import subprocess

from tests.helpers import script

BAD = "nohost.invalid:50051"


def kvctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([script("kvctl"), *args], capture_output=True, text=True, timeout=60)


def test_unresolvable_replica_is_skipped_like_an_unreachable_one(controlplane):
    good = controlplane.address
    # an unreachable (refused) first replica is skipped: the baseline that works today
    ok = kvctl("--endpoint", f"127.0.0.1:1,{good}", "stats")
    assert ok.returncode == 0, ok.stderr
    # an unresolvable first replica must be skipped the same way
    proc = kvctl("--endpoint", f"{BAD},{good}", "stats")
    assert proc.returncode == 0, proc.stderr
    assert "leader" in proc.stdout


def test_unresolvable_endpoint_alone_gets_the_documented_sentence():
    proc = kvctl("--endpoint", BAD, "stats")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"cannot reach the kvcp control plane at {BAD}" in lines[0], lines[0]
