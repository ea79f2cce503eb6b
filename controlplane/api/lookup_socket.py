"""The lookup socket: AdminService.Lookup for routers, without gRPC's round trip.

A router asks for every request's cached prefix. On these hosts a Python gRPC round trip
alone costs ~1.2 ms p50 / ~2 ms p99, several times the lookup behind it; this listener
answers the same `LookupRequest` (wrapped in `LookupFrame`, answered with
`LookupFrameReply`: the protos stay the one contract), framed as a 4-byte little-endian
length and the message, over TCP (no Nagle) or a Unix socket. One thread per connection
(routers keep a few long-lived ones), replies in request order.

It calls the gRPC method's own answer function (leadership, validation, metrics), and
checks the admin tokens the same way (any role: a lookup is a read). Over TCP it speaks
TLS when the gRPC listener does (same certificate, same client-certificate rule); a Unix
socket is guarded by its file permissions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import ssl
import stat
import threading
import time
from typing import cast

from google.protobuf.message import DecodeError

from protos import errors
from protos.grpc_errors import status_code_of
from protos.kvcp.v1 import admin_pb2
from protos.lookup_wire import HEADER_BYTES, MAX_FRAME_BYTES, frame, split_address

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
LISTEN_BACKLOG = 1024  # a burst of routers connecting at once waits here (the kernel caps it at somaxconn)
HANDSHAKE_SECONDS = 10.0
# a connection silent this long is closed (clients reconnect once, transparently), so idle
# or half-sent connections cannot hold the listener's slots
IDLE_SECONDS = 120.0
# a frame, from its first byte, must arrive whole within this (a client trickling a byte
# at a time, each within the idle time, held a slot for good: 256 of them, every slot)
FRAME_SECONDS = 10.0
# with tokens, a connection whose token has not been accepted yet gets this long for its
# next frame, and one whose token is refused is closed after the answer: a caller with no
# token held a slot for the idle time, and for good by sending a bad frame within each
UNAUTHENTICATED_IDLE_SECONDS = FRAME_SECONDS
READ_CHUNK_BYTES = 1 << 16
DENIALS = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # check_token's refusals


class LookupSocketServer:
    """`answer(LookupRequest) -> LookupResponse` raises KvcpError for bad input or a
    replica that does not lead; `check_token(token) -> (code name, message) | None`."""

    def __init__(
        self,
        address: str,
        answer,
        check_token=None,
        max_connections: int = MAX_CONNECTIONS,
        on_frame=None,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self._family, self._where = split_address(address)
        self._path = self._where if isinstance(self._where, str) else ""  # unix:PATH: the socket file
        self._ssl = ssl_context if self._family != socket.AF_UNIX else None
        self._answer = answer
        self._check_token = check_token
        self._max_connections = max_connections
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.address = address
        self._on_frame = on_frame  # callable(code name, "OK" when answered): metrics

    def start(self) -> LookupSocketServer:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            if self._family == socket.AF_UNIX:
                if os.path.exists(self._path) and not _listening(self._path):
                    if not stat.S_ISSOCK(os.stat(self._path).st_mode):
                        raise OSError(f"{self._path} exists and is not a socket")
                    os.unlink(self._path)  # left by a process that died
                sock.bind(self._where)
            else:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(self._where)
                host, port = sock.getsockname()[:2]
                self.address = f"[{host}]:{port}" if self._family == socket.AF_INET6 else f"{host}:{port}"
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen for lookups on {self.address}: {exc.strerror or exc}") from None
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="lookup-accept", daemon=True).start()
        log.info("lookup socket on %s", self.address)
        return self

    def stop(self) -> None:
        self._stopped.set()
        # best effort: each of these may already be closed or gone
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self._sock.close()
            if self._family == socket.AF_UNIX:
                with contextlib.suppress(OSError):
                    os.unlink(self._path)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None  # start() sets it before it starts this loop, and nothing unsets it
        failures = 0
        while not self._stopped.is_set():
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._stopped.is_set():
                    return  # stop() closed it
                # out of file descriptors or buffers, a connection reset before it was
                # taken: the socket itself still listens, and returning left it taking
                # connections no one served until a restart
                failures += 1
                if failures == 1 or failures % 1000 == 0:
                    log.warning("lookup socket: accept failed (%s, %d times so far); retrying", exc, failures)
                self._stopped.wait(min(1.0, 0.01 * failures))
                continue
            failures = 0
            if self._family != socket.AF_UNIX:
                with contextlib.suppress(OSError):  # (a peer already gone: its reads say so)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="lookup-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: this one connection is refused
                with self._lock:
                    self._conns.discard(conn)
                self._refuse(conn, "the control plane cannot start a thread for this connection now")

    def _refuse(self, conn: socket.socket, why: str = "") -> None:
        self._counted("RESOURCE_EXHAUSTED")
        if self._ssl is not None:  # a plain-text answer would read as a TLS error: just close
            conn.close()
            return
        reply = admin_pb2.LookupFrameReply(
            code="RESOURCE_EXHAUSTED",
            message=why or f"the lookup socket serves at most {self._max_connections} connections",
        )
        with contextlib.suppress(OSError):  # the client may be gone already
            conn.sendall(frame(reply.SerializeToString()))
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        if self._ssl is not None:
            try:
                conn.settimeout(HANDSHAKE_SECONDS)
                tls_conn = self._ssl.wrap_socket(conn, server_side=True)
            except (OSError, ssl.SSLError) as exc:
                log.info("lookup socket: TLS handshake failed: %s", exc)
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                return
            with self._lock:
                self._conns.discard(conn)
                if self._stopped.is_set():
                    tls_conn.close()
                    return
                self._conns.add(tls_conn)
            conn = tls_conn
        # typeshed says IOBase for an int buffering; "rb" with buffering > 0 makes a BufferedReader
        rfile = cast(io.BufferedReader, conn.makefile("rb", buffering=READ_CHUNK_BYTES))
        authenticated = self._check_token is None
        try:
            while True:
                conn.settimeout(IDLE_SECONDS if authenticated else UNAUTHENTICATED_IDLE_SECONDS)
                first = rfile.read1(HEADER_BYTES)  # waits (idle) for the next frame to begin
                if not first:
                    return  # the client went away between frames
                deadline = time.monotonic() + FRAME_SECONDS
                rest = _read_within(conn, rfile, HEADER_BYTES - len(first), deadline)
                if rest is None:
                    return  # went away, or too slow, mid-header
                head = first + rest
                size = int.from_bytes(head, "little")
                if size > MAX_FRAME_BYTES:
                    self._counted("INVALID_ARGUMENT")
                    bad = admin_pb2.LookupFrameReply(
                        code="INVALID_ARGUMENT", message=f"frame: {size} bytes, at most {MAX_FRAME_BYTES}"
                    )
                    conn.sendall(frame(bad.SerializeToString()))
                    return  # the stream cannot be re-synchronised after a bad length
                body = _read_within(conn, rfile, size, deadline)
                if body is None:
                    return  # went away, or too slow: the frame did not arrive within FRAME_SECONDS
                reply, token_ok = self._reply(body)
                self._counted(reply.code or "OK")
                conn.sendall(frame(reply.SerializeToString()))
                if reply.code in DENIALS:
                    return  # answered, then closed: a refused caller keeps no slot
                authenticated = authenticated or token_ok
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            rfile.close()
            conn.close()

    def _counted(self, code: str) -> None:
        if self._on_frame is not None:
            self._on_frame(code)

    def handle(self, body: bytes) -> bytes:
        """One frame's bytes -> the reply's bytes."""
        reply, _ = self._reply(body)
        self._counted(reply.code or "OK")
        return reply.SerializeToString()

    def _reply(self, body: bytes) -> tuple[admin_pb2.LookupFrameReply, bool]:
        """The reply, and whether the frame's token was accepted (or none is asked for)."""
        reply = admin_pb2.LookupFrameReply()
        if self._check_token is not None:
            # the token first, the lookup not parsed: a caller without one must not make us
            # spend memory on it (8 MiB of repeated fields parse into ~128 MiB)
            head = _token_and_id(body)
            if head is None:
                reply.code, reply.message = "INVALID_ARGUMENT", "frame: not a kvcp.v1.LookupFrame message"
                return reply, False
            denial = self._check_token(head[0])
            if denial is not None:
                reply.request_id = head[1]
                reply.code, reply.message = denial
                return reply, False
        try:
            request = admin_pb2.LookupFrame.FromString(body)
        except DecodeError:
            reply.code, reply.message = "INVALID_ARGUMENT", "frame: not a kvcp.v1.LookupFrame message"
            return reply, False
        reply.request_id = request.request_id
        try:
            reply.response.CopyFrom(self._answer(request.request))
        except errors.KvcpError as exc:
            reply.code, reply.message = status_code_of(exc).name, str(exc)
            if isinstance(exc, errors.NotLeader):
                reply.leader_address = exc.leader_address
        except Exception as exc:  # noqa: BLE001 - one bad request never takes the listener down
            log.exception("internal error answering a lookup frame")
            reply.code, reply.message = "INTERNAL", f"internal error: {type(exc).__name__}"
        return reply, True


def _varint(body: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(body) or shift > 63:
            raise ValueError("truncated varint")
        b = body[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _token_and_id(body: bytes) -> tuple[str, int] | None:
    """A LookupFrame's token (field 2) and request id (field 3), its lookup (field 1)
    skipped unparsed; the last of a repeated field wins, as in protobuf. None when the
    frame's outer fields are not well formed."""
    token, request_id, pos = b"", 0, 0
    try:
        while pos < len(body):
            key, pos = _varint(body, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _varint(body, pos)
                if number == 3:
                    request_id = value & 0xFFFFFFFFFFFFFFFF
            elif wire == 2:
                n, pos = _varint(body, pos)
                if pos + n > len(body):
                    return None
                if number == 2:
                    token = body[pos : pos + n]
                pos += n
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
                if pos > len(body):
                    return None
            else:
                return None
            if number == 0:
                return None
        return token.decode("utf-8"), request_id
    except (ValueError, UnicodeDecodeError):
        return None


def _read_within(conn, rfile, size: int, deadline: float) -> bytes | None:
    """`size` bytes, read as they come (a header claiming megabytes costs nothing until
    they arrive), all before `deadline` (monotonic); None when the client goes away or is
    too slow."""
    parts, got = [], 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(min(left, IDLE_SECONDS))  # silent for the idle time: gone
        try:
            part = rfile.read1(min(READ_CHUNK_BYTES, size - got))  # what one receive brings
        except TimeoutError:
            return None
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
