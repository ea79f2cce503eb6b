"""A throwaway etcd on free loopback ports, its data and log in a directory of its own.

The test suite (tests/helpers.py) and the benchmarks that start their own cluster use
this one launcher; `pause()`/`resume()` (SIGSTOP/SIGCONT) let the chaos run take etcd
away without losing its data."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (one free_port() after another may give the same
    one twice: a chaos run's agent once got its etcd's port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _memory_dir() -> str | None:
    """/dev/shm where it is writable: a throwaway etcd's fsyncs then cost nothing, and a
    busy shared disk cannot stall it past its clients' timeouts."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class EtcdServer:
    """A real etcd on free loopback ports with its data in a temp dir (or `data_dir`)."""

    def __init__(
        self, data_dir: str | None = None, ports: tuple[int, int] | None = None, extra_args: tuple[str, ...] = ()
    ):
        """`ports`: (client, peer); fresh free ones when not given. `extra_args`: more etcd
        flags (a test's small --quota-backend-bytes)."""
        self.extra_args = extra_args
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed: run scripts/bootstrap.sh (apt-get install -y etcd-server)")
        self.port, self.peer_port = ports or free_ports(2)
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvcp-test-etcd-", dir=_memory_dir())
        self.proc: subprocess.Popen | None = None
        self.log = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "etcd.log")

    def start(self, wait_seconds: float = 20.0, command_prefix: tuple[str, ...] = ()) -> EtcdServer:
        """`command_prefix`: run etcd under a wrapper (the chaos run's `setpriv --pdeathsig`)."""
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.port}"
        os.makedirs(self.data_dir, exist_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                *command_prefix,
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
                *self.extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        from protos.etcd_keys import connect

        connect(self.endpoint, wait_seconds=wait_seconds, log=lambda m: None).close()
        return self

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused etcd would not see the SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
            self.log = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
