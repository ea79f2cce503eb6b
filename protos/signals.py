"""Waiting, in a server process's main thread, for the signal that stops it."""

from __future__ import annotations

import signal
import threading


def wait_for_stop_signal(poll_seconds: float = 0.5) -> int:
    """Block until SIGINT or SIGTERM arrives; returns which. The wait wakes every
    `poll_seconds`: the kernel may hand a process's signal to any of its threads (it did
    right after a SIGCONT), and Python runs the handler in the main thread only once that
    thread runs Python again. An untimed wait never woke then, and the process served on
    until it was killed (a control plane that never resigned, an agent never deregistered)."""
    got: list[int] = []
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        got.append(signum)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    while not done.is_set():
        done.wait(poll_seconds)
    return got[0]
