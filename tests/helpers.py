"""Real components for the tests: an etcd server on free loopback ports, console
scripts of this venv, and waiting with a deadline."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.etcd import EtcdServer  # noqa: F401 - the one etcd launcher, shared with the benchmarks
from controlplane.core.index import AgentMatch

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_seconds: float = 10.0, interval_seconds: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_seconds
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        time.sleep(interval_seconds)
    raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what} (last: {last!r})")


def popen_for_ctrl_c(argv: list[str], **kwargs) -> subprocess.Popen:
    """Popen for a child that the test stops with SIGINT, as Ctrl-C would. An ignored SIGINT
    is inherited across exec, and a shell starts a script's background jobs with SIGINT
    ignored (`make test &`, a CI step run so): the child's Python would then never raise
    KeyboardInterrupt and the test would wait out its timeout. A handled signal is reset to
    the default at exec, so one is handled here while the child starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, **kwargs)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def script(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"console script {name} not installed in {BIN}")
    return str(path)


class ExternalEtcd:
    """An etcd started outside the suite (KVCP_TEST_ETCD, set by .ci/run)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def cleanup(self) -> None:
        pass


def reference_lookup(ref: dict[str, dict[bytes, int]], chain: list[bytes]) -> list[AgentMatch]:
    """The index's lookup answer by brute force: `ref` is agent -> block hash -> tier."""
    out = []
    for a, blocks in ref.items():
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        if n:
            out.append(AgentMatch(a, n, bytes(blocks[h] for h in chain[:n])))
    out.sort(key=lambda m: (-m.num_hit_blocks, sum(m.tiers), m.agent_id))
    return out
