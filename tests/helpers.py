"""Real components for the tests: an etcd server on free loopback ports, console
scripts of this venv, and waiting with a deadline."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def script(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"console script {name} not installed in {BIN}")
    return str(path)


class EtcdServer:
    """A real etcd on free loopback ports with its data in a temp dir."""

    def __init__(self, data_dir: str | None = None):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed: run scripts/bootstrap.sh (apt-get install -y etcd-server)")
        self.port = free_port()
        self.peer_port = free_port()
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvcp-test-etcd-")
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> EtcdServer:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name",
                "test",
                "--data-dir",
                os.path.join(self.data_dir, "data"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"test={peer}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        from protos.etcd_keys import connect

        connect(self.endpoint, wait_seconds=20, log=lambda m: None).close()
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class ExternalEtcd:
    """An etcd started outside the suite (KVCP_TEST_ETCD, set by .ci/run)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def cleanup(self) -> None:
        pass
