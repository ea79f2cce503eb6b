"""kvcp-controlplane and kvcp-agent wait in their main thread for SIGINT/SIGTERM
(protos.signals.wait_for_stop_signal). The kernel may hand a process's signal to any of
its threads, and Python runs the handler in the main thread only: an untimed wait there
never woke, and a control plane SIGTERMed right after a SIGCONT served on until killed
(a test's teardown waited its 10 s for it in 4 runs of 9)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO, wait_for

CHILD = """
import threading, time
from protos.signals import wait_for_stop_signal
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
print("stopped by", wait_for_stop_signal(), flush=True)
"""


def _mask(pid: int, tid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/task/{tid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill and /proc are Linux's")
def test_a_sigterm_handed_to_another_thread_stops_the_process():
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("no tgkill in this libc (glibc 2.30+ has it)")
    term = 1 << (signal.SIGTERM - 1)
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        pid = proc.pid
        wait_for(lambda: _mask(pid, pid, "SigCgt") & term, 10, 0.01, "the SIGTERM handler installed")
        # a thread other than the main one, not blocking SIGTERM: the signal is its to take
        other = next(
            int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid and not _mask(pid, int(t), "SigBlk") & term
        )
        assert tgkill(pid, other, signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
        out, _ = proc.communicate(timeout=10)
        assert out == f"stopped by {int(signal.SIGTERM)}\n" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
