"""The Transfer Engine adapter: one-sided writes from this agent's registered memory into
a peer's registered memory, behind a small interface so the rest of the data plane does
not care which engine (or none) is there.

`MooncakeEngine` wraps the Mooncake Transfer Engine (`mooncake-transfer-engine-non-cuda`
on CPU machines, RDMA/CUDA builds on GPU clusters). Peers find each other by the
engine's P2P handshake (`P2PHANDSHAKE`, the default: the agent publishes the engine's
session id in its own etcd key) or through a metadata server the engine supports
(`etcd://host:port`). A write names source and destination addresses; both sides must
have registered the memory (the receiver's CPU slab; the sender's slab, and any bounce
buffer for blocks outside it).

`NoEngine` stands in when the engine cannot start (library missing, no device): the
agent then hands off over the gRPC fallback only and says why once, in its log and in
`AgentInfo.transfer_engine_status`.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)

# The engine's handshake listener is a thread waiting in accept() on the engine's port with
# a 1 s timeout (SO_RCVTIMEO), and the engine's destructor joins that thread with the GIL
# held: freeing an engine stalled every thread of the process for up to a second. A short
# timeout on that socket bounds the stall. An accept already waiting when it is set keeps
# its 1 s, so an engine closed younger than that is freed once that second has passed.
HANDSHAKE_ACCEPT_TIMEOUT_SECONDS = 0.05
ENGINE_FIRST_ACCEPT_SECONDS = 1.0


def shorten_accept_timeout(port: int, seconds: float) -> bool:
    """Set the receive timeout (which bounds accept()) of this process's listening TCP
    socket on `port`, found through /proc/self/fd. False where there is none (or no /proc)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    for name in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it leaves the engine's
        except (OSError, ValueError):
            continue
        with s:
            try:
                if (
                    s.family in (socket.AF_INET, socket.AF_INET6)
                    and s.type == socket.SOCK_STREAM
                    and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and s.getsockname()[1] == port
                ):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                    return True
            except OSError:
                continue
    return False


def _free_later(engine, delay_seconds: float) -> None:
    """Drop this reference to `engine` after `delay_seconds`, from a thread of its own."""
    box = [engine]
    del engine

    def run() -> None:
        time.sleep(delay_seconds)
        box.clear()  # the engine's destructor runs here, unless a pending write still holds it

    threading.Thread(target=run, name="mooncake-free", daemon=True).start()


class TransferFailed(Exception):
    """A write did not complete (peer gone, address rejected, engine timeout)."""


class TransferTimedOut(TransferFailed):
    """A write given up on, or that the engine timed out, without the engine saying it
    ended: it may still land in the destination's pages."""


class TransferBackend(Protocol):
    name: str  # "mooncake", or "" for none
    available: bool
    status: str  # why not available, or a short description
    endpoint: str  # the session id peers address writes to
    protocol: str

    def register(self, address: int, num_bytes: int) -> None: ...
    def unregister(self, address: int) -> None: ...
    def write(self, endpoint: str, pieces: Sequence[tuple[int, int, int]]) -> None: ...
    def submit(self, endpoint: str, pieces: Sequence[tuple[int, int, int]]) -> PendingWrite: ...
    def close(self) -> None: ...


class PendingWrite:
    """Writes handed to the engine without waiting: one engine transfer per piece.
    `poll()` is False while any is on the wire, True once all landed, and raises
    TransferFailed once all have ended and one of them failed (never earlier: until then
    the engine may still read the source pages). A write given up after the timeout, or
    one the engine timed out, has not said it ended: that is TransferTimedOut (whoever
    reserved the destination must keep its pages from other blocks for a while)."""

    def __init__(self, check, num_bytes: int, endpoint: str, timeout_seconds: float, abandon=None):
        self._check = check  # transfer id -> 1 landed, 0 on the wire, < 0 failed or timed out
        # callable(ids): transfers given up while the engine still holds them (their batch
        # ids are freed by the engine only when a later check sees them end)
        self._abandon = abandon
        self.num_bytes = num_bytes
        self.endpoint = endpoint
        self.ids: list[int] = []
        self.error = ""
        self.timed_out = False  # a piece given up on or timed out: it may still land
        # as the engine's own blocking write: its timeout plus a second per GiB, then given up
        self._give_up_at = time.monotonic() + timeout_seconds + num_bytes / (1 << 30)

    def poll(self) -> bool:
        if self.ids and time.monotonic() > self._give_up_at:
            self.error = self.error or f"engine write of {self.num_bytes} B to {self.endpoint} never completed"
            self._given_up(self.ids)
            self.ids = []
            self.timed_out = True
        still = []
        for t in self.ids:
            rc = self._check(t)
            if rc == 0:
                still.append(t)
            elif rc < 0:
                if rc == -2:  # timed out, still the engine's: it frees the id once it ends
                    self._given_up([t])
                self.timed_out = self.timed_out or rc == -2
                if not self.error:
                    self.error = f"engine write of {self.num_bytes} B to {self.endpoint} " + (
                        "timed out" if rc == -2 else f"failed (rc {rc})"
                    )
        self.ids = still
        if still:
            return False
        if self.error:
            raise (TransferTimedOut if self.timed_out else TransferFailed)(self.error)
        return True

    def _given_up(self, ids: list[int]) -> None:
        if self._abandon is not None and ids:
            self._abandon(list(ids))


class NoEngine:
    name = ""
    available = False
    endpoint = ""
    protocol = ""

    def __init__(self, status: str):
        self.status = status

    def register(self, address: int, num_bytes: int) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def write(self, endpoint: str, pieces) -> None:
        raise TransferFailed(f"no transfer engine here: {self.status}")

    def submit(self, endpoint: str, pieces) -> PendingWrite:
        raise TransferFailed(f"no transfer engine here: {self.status}")

    def close(self) -> None:
        pass


class MooncakeEngine:
    """The Mooncake Transfer Engine of this process (one per agent)."""

    name = "mooncake"

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        metadata_server: str = "P2PHANDSHAKE",
        device_name: str = "",
        timeout_seconds: int = 5,
    ):
        # read by the engine when it is constructed: its own per-write timeout (at least
        # 5 s, plus 1 s per GiB), and quieter logs
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(timeout_seconds))))
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self.timeout_seconds = int(os.environ["MC_TRANSFER_TIMEOUT"])
        from mooncake.engine import TransferEngine  # ImportError/OSError: see open_engine

        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferFailed(
                f"TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}, {device_name!r}) "
                f"returned {rc}"
                + (" (are those RDMA devices on this host? ibv_devices lists them)" if device_name else "")
            )
        self._first_accept_ends = time.monotonic() + ENGINE_FIRST_ACCEPT_SECONDS
        shorten_accept_timeout(self._engine.get_rpc_port(), HANDSHAKE_ACCEPT_TIMEOUT_SECONDS)
        self.protocol = protocol
        self.endpoint = f"{hostname}:{self._engine.get_rpc_port()}"
        self.available = True
        self.status = f"mooncake {protocol} at {self.endpoint}" + (f" on {device_name}" if device_name else "")
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        # writes given up (timed out) that the engine still holds: checked again before
        # each submit, as the engine frees a transfer's batch id only when a check sees
        # it end (completed or failed)
        self._abandoned: list[int] = []

    def _live(self):
        engine = self._engine
        if engine is None:
            raise TransferFailed("the transfer engine is closed")
        return engine

    def register(self, address: int, num_bytes: int) -> None:
        rc = self._live().register_memory(address, num_bytes)
        if rc != 0:
            raise TransferFailed(f"register_memory({address:#x}, {num_bytes}) returned {rc}")
        with self._lock:
            self._registered[address] = num_bytes

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is None:
                return
            engine = self._engine
        if engine is not None:
            engine.unregister_memory(address)

    def write(self, endpoint: str, pieces: Sequence[tuple[int, int, int]]) -> None:
        """Blocking write of [(src_address, dst_address, length)] to `endpoint`, in one
        engine batch. The engine releases the GIL while it works."""
        if not pieces:
            return
        engine = self._live()
        srcs = [p[0] for p in pieces]
        dsts = [p[1] for p in pieces]
        lens = [p[2] for p in pieces]
        if len(pieces) == 1:
            rc = engine.transfer_sync_write(endpoint, srcs[0], dsts[0], lens[0])
        else:
            rc = engine.batch_transfer_sync_write(endpoint, srcs, dsts, lens)
        if rc != 0:
            raise TransferFailed(f"engine write of {sum(lens)} B to {endpoint} failed (rc {rc})")

    def submit(self, endpoint: str, pieces: Sequence[tuple[int, int, int]]) -> PendingWrite:
        """Hand [(src_address, dst_address, length)] to the engine and return at once.
        Several submitted writes travel side by side (the engine spreads them over its
        connections and worker threads) where one blocking write keeps one at a time and
        spins a core polling for it. A piece the engine refuses to take fails the write
        once the pieces it took have ended."""
        engine = self._live()
        self.reap()
        w = PendingWrite(
            engine.transfer_check_status, sum(p[2] for p in pieces), endpoint, self.timeout_seconds, self._abandon
        )
        for src, dst, n in pieces:
            t = engine.transfer_submit_write(endpoint, src, dst, n)
            if t <= 0:  # -1 (or a null batch): not taken, nothing of it is on the wire
                w.error = f"engine refused a write of {n} B to {endpoint} (rc {t})"
                break
            w.ids.append(t)
        return w

    def _abandon(self, ids: list[int]) -> None:
        with self._lock:
            self._abandoned.extend(ids)

    def reap(self) -> int:
        """Check the writes given up earlier once more: each that has ended is freed by
        the engine and forgotten here. Returns how many the engine still holds."""
        with self._lock:
            ids, self._abandoned = self._abandoned, []
            engine = self._engine
        if not ids or engine is None:
            return 0
        left = [t for t in ids if engine.transfer_check_status(t) in (0, -2)]
        with self._lock:
            self._abandoned.extend(left)
            return len(self._abandoned)

    def close(self) -> None:
        """Unregister the memory and free the engine: its port and threads end with the
        agent, not whenever the garbage collector reaches this object (a write still being
        polled keeps it until that write is dropped)."""
        with self._lock:
            addresses = list(self._registered)
            self._registered.clear()
            engine, self._engine = self._engine, None
        if engine is None:
            return
        for a in addresses:
            try:
                engine.unregister_memory(a)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        young = self._first_accept_ends - time.monotonic()
        if young > 0:
            _free_later(engine, young + HANDSHAKE_ACCEPT_TIMEOUT_SECONDS)


def open_engine(
    kind: str = "mooncake",
    hostname: str = "127.0.0.1",
    protocol: str = "tcp",
    metadata_server: str = "P2PHANDSHAKE",
    device_name: str = "",
    timeout_seconds: int = 5,
    reason: str = "",
) -> TransferBackend:
    """The engine to use, or NoEngine with the reason (never raises). `reason`: why it is
    off, for kind none chosen by the agent rather than asked for."""
    if kind in ("", "none", "off"):
        return NoEngine(reason or "disabled by configuration (--transfer-engine none)")
    if kind != "mooncake":
        return NoEngine(f"unknown transfer engine {kind!r} (known: mooncake, none)")
    try:
        return MooncakeEngine(hostname, protocol, metadata_server, device_name, timeout_seconds)
    except ImportError as exc:
        why = (
            f"the Mooncake Transfer Engine does not import ({exc}); install mooncake-transfer-engine-non-cuda "
            "and the Debian packages libibverbs1 librdmacm1 libnuma1"
        )
    except (OSError, TransferFailed, RuntimeError) as exc:
        why = f"the Mooncake Transfer Engine did not start: {exc}"
    return NoEngine(why)
