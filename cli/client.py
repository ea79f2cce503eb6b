"""ControlPlaneClient: the one client facade of the admin API. kvctl and the dashboard
call these methods and get plain values back; neither builds gRPC requests by hand.

Errors come back as `ClientError` with a sentence for the person at the terminal. A
follower replica answers FAILED_PRECONDITION with the leader's address in trailing
metadata; the facade follows it once, transparently."""

from __future__ import annotations

import errno
import socket
import ssl
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from protos.block_hash import BLOCK_HASH_BYTES, MAX_PROMPT_TOKENS
from protos.etcd_keys import CORDON_POLICY_PREFIX, POLICY_ENTRY_REMOVED
from protos.grpc_errors import LEADER_METADATA_KEY, error_kind_of
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, types_pb2
from protos.lookup_wire import HEADER_BYTES, MAX_FRAME_BYTES, MAX_REPLY_BYTES, frame, split_address
from protos.pb_enums import tier_pb
from protos.security import TLSConfig, client_ssl_context, token_metadata
from protos.security import channel as secure_channel
from protos.tier import Tier

DEFAULT_ENDPOINT = "127.0.0.1:50051"

AGENT_STATES = {
    types_pb2.AGENT_STATE_READY: "ready",
    types_pb2.AGENT_STATE_SYNCING: "syncing",
    types_pb2.AGENT_STATE_DISCONNECTED: "disconnected",
}


class ClientError(Exception):
    """A failed admin call; `code` is the gRPC status code name (e.g. 'INVALID_ARGUMENT'),
    `kind` the control plane's error kind when it answered (`EtcdUnreachable`,
    `NotConfigured`, ...: protos.errors class names), '' when it did not (no connection)."""

    def __init__(self, code: str, message: str, kind: str = ""):
        super().__init__(message)
        self.code = code
        self.kind = kind


PIN_RETRIES = 3
# answers to a poll that say "not now" rather than "no": a failover or an etcd blip
WAIT_RETRY_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION"})
# ... asked again from the start of a wait only this long (a failover takes an election
# TTL or two); once the operation was seen, until the wait's own time is up
FIRST_ANSWER_SECONDS = 15.0


def _not_connected(exc: grpc.RpcError) -> bool:
    """gRPC's own UNAVAILABLE for a replica it could not connect to (the call never left;
    a connection reset mid-call is not this: the replica may have acted on it)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (
        "failed to connect" in details or "refused" in details or _unresolved(details)
    )


def _unresolved(details: str) -> bool:
    """gRPC could not resolve the replica's host name ("errors resolving HOST: ...", "DNS
    resolution failed"): a retired host or a typo, skipped like a replica that refuses."""
    details = details.lower()
    return "resolving" in details or "resolution failed" in details


def _not_leader(exc: grpc.RpcError) -> bool:
    """A follower's refusal (it names the leader in trailing metadata, maybe none:
    UNAVAILABLE, no leader reachable at the moment)."""
    codes = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
    return exc.code() in codes and any(k == LEADER_METADATA_KEY for k, _ in (exc.trailing_metadata() or ()))


def _cut_off_from_etcd(exc: grpc.RpcError) -> bool:
    """The replica refused the change because it cannot reach etcd (nothing applied)."""
    return error_kind_of(exc) == "EtcdUnreachable"


def _refused_by_etcd(exc: ClientError) -> bool:
    """Did the control plane refuse the change because etcd is unreachable (not applied)?
    Its etcd client refuses every call for a second after one timed out, so a busy etcd's
    one slow answer refuses the changes that come just after it."""
    return exc.kind == "EtcdUnreachable"


def _outcome_lost(exc: ClientError) -> bool:
    """Did the call end without a definite answer (it may have been applied)?"""
    return exc.code in ("UNKNOWN", "DEADLINE_EXCEEDED") or (
        exc.code == "UNAVAILABLE" and str(exc).startswith("cannot reach")  # our own sentence (_error)
    )


def reachable_lookup_address(address: str, admin_endpoint: str) -> str:
    """The leader's lookup socket as a client reaches it: one bound to every interface
    (0.0.0.0, ::) is at the host its admin API was reached at; a Unix path, on this host."""
    if not address or address.startswith("unix:"):
        return address
    host, _, port = address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return address
    admin_host = admin_endpoint.rpartition(":")[0] or "127.0.0.1"
    return f"{admin_host}:{port}"


class LookupSocketUnreachable(ClientError):
    """UNAVAILABLE from the lookup socket itself: nothing listens there, or the connection
    broke (again, once reconnected), so no replica answered."""


class LookupSocket:
    """The client end of the lookup socket (controlplane.api.lookup_socket): one
    connection, frames in order, reconnected once when it broke (a lookup is a read)."""

    def __init__(self, endpoint: str, token: str = "", timeout_seconds: float = 5.0, tls: TLSConfig | None = None):
        """`tls`: the CA of the control plane's certificate (TCP only; ours for mTLS)."""
        self.endpoint = endpoint
        self._family, self._where = split_address(endpoint)
        self._ssl = client_ssl_context(tls) if self._family != socket.AF_UNIX else None
        self._token = token
        self._timeout_seconds = timeout_seconds
        self._sock: socket.socket | None = None
        self._kernel_timeouts = True  # SO_RCVTIMEO / SO_SNDTIMEO taken (see _set_timeouts)
        self._next_id = 0
        self.answered = False  # a reply came from this endpoint once (it is, or was, a lookup socket)
        self._lock = threading.Lock()
        self._buf = bytearray(1 << 16)  # replies are read into this, header and body at once

    def _connect(self, timeout_seconds: float, cut_short: bool) -> socket.socket:
        """A connection made within `timeout_seconds`, what is left of the call's time. One
        that cannot be made in it is UNAVAILABLE when it had the call's whole timeout (nothing
        there takes connections: a router tries another replica), and DEADLINE_EXCEEDED, as a
        slow answer is, when the call had spent part of it already (`cut_short`: queued behind
        other calls, or on a connection found dropped): that says only that the call's time is
        spent."""
        deadline = time.monotonic() + timeout_seconds
        sock: socket.socket  # set by the loop, which ends connected or raises
        while True:
            sock = socket.socket(self._family, socket.SOCK_STREAM)
            sock.settimeout(timeout_seconds)
            try:
                sock.connect(self._where)
                break
            except OSError as exc:
                sock.close()
                # a Unix socket whose accept backlog is full refuses at once (EAGAIN) where
                # TCP would wait: a burst of clients, not a missing server; wait as TCP does
                busy = exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)
                if busy and time.monotonic() < deadline:
                    time.sleep(0.005)
                    continue
                if cut_short and (busy or isinstance(exc, TimeoutError)):
                    raise self._out_of_time("connecting") from None
                if busy:
                    raise LookupSocketUnreachable(
                        "UNAVAILABLE",
                        f"the lookup socket at {self.endpoint} is busy (its accept queue stayed full for "
                        f"{self._timeout_seconds:g} s); try again",
                    ) from None
                raise LookupSocketUnreachable(
                    "UNAVAILABLE",
                    f"cannot reach the lookup socket at {self.endpoint} ({exc.strerror or exc}); "
                    "is kvcp-controlplane running with --lookup-listen?",
                ) from None
        if self._family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:
            try:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._where[0])
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                if cut_short and isinstance(exc, TimeoutError):
                    raise self._out_of_time("in its TLS handshake") from None
                raise LookupSocketUnreachable("UNAVAILABLE", f"lookup socket {self.endpoint}: TLS: {exc}") from None
        self._set_timeouts(sock, self._timeout_seconds)
        return sock

    def _cut_short(self, seconds_left: float) -> bool:
        """Whether a call has less than its whole timeout left (it waited, or tried once)."""
        return seconds_left < self._timeout_seconds - 0.001

    def _out_of_time(self, doing: str = "") -> ClientError:
        """DEADLINE_EXCEEDED: the call's time ran out (`doing` says where, when not waiting
        for the answer)."""
        where = f" (its time ran out {doing})" if doing else ""
        return ClientError(
            "DEADLINE_EXCEEDED", f"lookup socket {self.endpoint}: no answer in {self._timeout_seconds:g}s{where}"
        )

    def _set_timeouts(self, sock: socket.socket, seconds: float) -> None:
        """Connected: blocking calls with the kernel's own timeouts, so that a send and a
        receive are one system call each, not a poll() and then the call (~20-50 us a
        lookup here); where the kernel does not take them, Python's timeout stays."""
        if self._kernel_timeouts:
            try:
                whole, frac = divmod(max(seconds, 0.001), 1.0)
                tv = struct.pack("ll", int(whole), int(frac * 1e6))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
                sock.settimeout(None)
                return
            except (OSError, struct.error):
                self._kernel_timeouts = False
        sock.settimeout(max(seconds, 0.001))

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, request: admin_pb2.LookupRequest) -> admin_pb2.LookupResponse:
        """One lookup, answered or refused within the timeout: threads sharing this socket
        queue for it, and the wait counts against each call's time (N threads behind a
        silent replica each waited out all the calls before; then each its own whole
        timeout on top)."""
        deadline = time.monotonic() + self._timeout_seconds
        if not self._lock.acquire(timeout=self._timeout_seconds):
            raise ClientError(
                "DEADLINE_EXCEEDED",
                f"lookup socket {self.endpoint}: no answer in {self._timeout_seconds:g}s "
                "(the lookups before this one on the connection took that long)",
            )
        shortened: socket.socket | None = None  # the connection's timeouts cut to what is left
        try:
            framing = time.monotonic()
            self._next_id += 1
            request_id = self._next_id
            body = admin_pb2.LookupFrame(request=request, token=self._token, request_id=request_id).SerializeToString()
            if len(body) > MAX_FRAME_BYTES:  # the server would refuse it and close while this still sends
                raise ClientError(
                    "INVALID_ARGUMENT",
                    f"token_ids: a lookup of {len(request.token_ids)} tokens is {len(body)} bytes, over the lookup "
                    f"socket's frame of {MAX_FRAME_BYTES} bytes (a lookup takes at most {MAX_PROMPT_TOKENS} tokens)",
                )
            out = frame(body)
            # the call's own work, not time spent elsewhere (a long prompt's frame: milliseconds)
            framed_seconds = time.monotonic() - framing
            for attempt in (0, 1):
                fresh = self._sock is None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._out_of_time()
                if self._sock is None:  # fresh
                    self._sock = self._connect(left, self._cut_short(left + framed_seconds))
                    left = deadline - time.monotonic()  # the connection took some of it
                    if left <= 0:
                        raise self._out_of_time("connecting")
                if self._cut_short(left):  # (one system call each way; most calls waited for nothing)
                    shortened = self._sock
                    self._set_timeouts(shortened, left)
                try:
                    self._sock.sendall(out)
                    reply = admin_pb2.LookupFrameReply.FromString(self._read_frame())
                    self.answered = True
                    break
                except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    self._drop()  # a late reply would answer the next call: start afresh
                    raise self._out_of_time() from None
                except (OSError, EOFError, DecodeError) as exc:
                    self._drop()
                    if fresh or attempt:  # a new connection failing is not a stale one
                        raise LookupSocketUnreachable(
                            "UNAVAILABLE", f"lookup socket {self.endpoint}: {exc or 'closed'}"
                        ) from None
        finally:
            if shortened is not None and shortened is self._sock:
                self._set_timeouts(shortened, self._timeout_seconds)
            self._lock.release()
        if reply.code:  # a follower names the leader (its admin API address): kind NotLeader
            raise ClientError(reply.code, reply.message, "NotLeader" if reply.leader_address else "")
        if reply.request_id != request_id:
            raise ClientError("INTERNAL", f"lookup socket {self.endpoint}: reply out of order")
        return reply.response

    def _read_frame(self) -> bytes:
        """One reply frame's body: usually a single receive brings header and body."""
        buf = self._buf
        got = self._receive(buf, 0, HEADER_BYTES)
        size = int.from_bytes(buf[:HEADER_BYTES], "little")
        if size > MAX_REPLY_BYTES:
            raise EOFError(f"a reply frame of {size} bytes (not a kvcp lookup socket?)")
        end = HEADER_BYTES + size
        if end > len(buf):
            grown = bytearray(end)
            grown[:got] = buf[:got]
            buf = grown
        if got > end:  # one request in flight: nothing may follow its reply
            raise EOFError("bytes after the reply frame (not a kvcp lookup socket?)")
        self._receive(buf, got, end)
        return bytes(buf[HEADER_BYTES:end])

    def _receive(self, buf: bytearray, got: int, at_least: int) -> int:
        """Receive into buf[got:] until it holds `at_least` bytes; returns how many it holds."""
        view = memoryview(buf)
        assert self._sock is not None  # read by call(), on the connection it just wrote to
        while got < at_least:
            k = self._sock.recv_into(view[got:])
            if not k:
                raise EOFError("the control plane closed the connection")
            got += k
        return got


@dataclass(frozen=True)
class TierView:
    tier: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    uncompressed_bytes: int = 0  # what the tier's blocks would take raw
    stored_bytes: int = 0  # what they take as stored (less when compressed)
    num_parked_blocks: int = 0  # recovered after a restart, waiting for their prefix (in used_bytes)


@dataclass(frozen=True)
class AgentView:
    agent_id: str
    address: str
    state: str
    num_blocks: int
    tiers: list[TierView]
    models: list[str]
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    last_seen_unix_seconds: float
    transfer_engine: str = ""  # "mooncake" when its engine is up
    transfer_engine_status: str = ""  # the engine's endpoint, or why it is off
    shm_handoff: bool = False  # same-host handoffs through its shared-memory slab
    cordon_reason: str = ""  # non-empty: cordoned (kvctl cordon): routers are not sent there

    @property
    def handoff_paths(self) -> list[str]:
        """The paths a handoff to or from it can take, in the order they are tried."""
        return [
            p for p, up in (("shm", self.shm_handoff), ("engine", bool(self.transfer_engine)), ("grpc", True)) if up
        ]

    @property
    def hit_ratio(self) -> float:
        return self.lookup_hit_tokens_total / self.lookup_tokens_total if self.lookup_tokens_total else 0.0


@dataclass(frozen=True)
class AgentMatchView:
    agent_id: str
    num_hit_blocks: int
    num_hit_tokens: int
    tiers: list[str]


@dataclass(frozen=True)
class LookupView:
    model_id: str
    num_tokens: int
    num_blocks: int
    best_agent_id: str
    agents: list[AgentMatchView]
    possibly_stale: bool = False


@dataclass(frozen=True)
class StatsView:
    num_agents: int
    num_blocks: int
    num_block_replicas: int
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    resyncs_total: int
    events_total: int
    leader_address: str
    epoch: int
    is_leader: bool
    tiers: list[TierView] = field(default_factory=list)
    models: list[dict] = field(default_factory=list)
    lookup_address: str = ""  # the replica's lookup socket, "" when it has none
    # the tier policy's latest pass: the reuse credit it used, whether it evicted most
    # recently used first (loops larger than the cache), and how many passes ran
    policy_reuse_credit_turnovers: float = 0.0
    policy_recent_first: bool = False
    policy_passes_total: int = 0
    tier_moved_bytes_total: int = 0  # bytes the agents moved between their tiers (since each started)

    @property
    def hit_ratio(self) -> float:
        return self.lookup_hit_tokens_total / self.lookup_tokens_total if self.lookup_tokens_total else 0.0


class PinList(list):
    """Pins as listed; `possibly_stale`: a replica cut off from etcd answered from memory
    (pins made since, through the leader that replaced it, may be missing)."""

    possibly_stale: bool = False


@dataclass(frozen=True)
class PinView:
    pin_id: str
    namespace: str
    model_id: str
    min_tier: str
    num_blocks: int
    pinned_bytes: int
    whole_namespace: bool
    agent_id: str
    owner: str
    created_unix_seconds: float
    expires_unix_seconds: float  # 0: no TTL (tied to the owner's lease)

    def ttl_left_seconds(self, now: float) -> float | None:
        return max(0.0, self.expires_unix_seconds - now) if self.expires_unix_seconds else None


@dataclass(frozen=True)
class AgentProgressView:
    agent_id: str
    state: str
    num_done_blocks: int
    num_total_blocks: int
    num_failed_blocks: int
    error: str
    result: str = ""


@dataclass(frozen=True)
class OperationView:
    op_id: str
    kind: str
    state: str  # PENDING | RUNNING | SUCCEEDED | FAILED | CANCELLED
    progress: float  # 0..1
    num_done_blocks: int
    num_total_blocks: int
    num_failed_blocks: int
    num_skipped_pinned_blocks: int  # left in place: a pin holds them
    moved_bytes: int
    freed: list[TierView]
    error: str
    created_unix_seconds: float
    updated_unix_seconds: float
    params: dict[str, str]
    agents: list[AgentProgressView]
    dry_run: bool
    result: str = ""  # what it came to, in words (a transfer: the path taken)

    @property
    def finished(self) -> bool:
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass(frozen=True)
class RouteCandidateView:
    agent_id: str
    estimated_seconds: float  # prefill: compute + queue; decode: handoff + queue (lower is better)
    num_cached_blocks: int
    num_active_handoffs: float  # handoffs arriving, sending or queued to send (a count)
    free_bytes: int
    link_bytes_per_second: float
    transfer_seconds: float
    behind: bool
    note: str


@dataclass(frozen=True)
class RouteView:
    role: str
    agent_id: str
    address: str
    prefill_agent_id: str
    decode_agent_id: str
    disaggregate: bool
    num_cached_tokens: int
    transfer_seconds: float
    saved_seconds: float
    reason: str
    backpressure: bool
    candidates: list[RouteCandidateView]
    possibly_stale: bool = False  # answered from memory (etcd away) or while agents resync


@dataclass(frozen=True)
class EventView:
    seq: int
    unix_seconds: float
    kind: str
    severity: str
    agent_id: str
    op_id: str
    pin_id: str
    message: str


def _scope(model_id="", token_ids=None, block_hashes=b"", extra_keys=(), namespace="", agent_id=""):
    return admin_pb2.Scope(
        model_id=model_id,
        token_ids=token_ids or [],
        block_hashes=block_hashes,
        extra_keys=list(extra_keys),
        namespace=namespace,
        agent_id=agent_id,
    )


def _pin_view(p) -> PinView:
    whole = not p.scope.token_ids and not p.scope.block_hashes
    return PinView(
        p.pin_id,
        p.namespace,
        p.scope.model_id,
        _tier_name(p.min_tier),
        p.num_blocks,
        p.pinned_bytes,
        whole,
        p.scope.agent_id,
        p.owner,
        p.created_unix_seconds,
        p.expires_unix_seconds,
    )


def _op_view(o) -> OperationView:
    return OperationView(
        op_id=o.op_id,
        kind=o.kind,
        state=admin_pb2.OperationState.Name(o.state).removeprefix("OPERATION_STATE_"),
        progress=o.progress,
        num_done_blocks=o.num_done_blocks,
        num_total_blocks=o.num_total_blocks,
        num_failed_blocks=o.num_failed_blocks,
        num_skipped_pinned_blocks=o.num_skipped_pinned_blocks,
        moved_bytes=o.moved_bytes,
        freed=_tiers(o.freed),
        error=o.error,
        created_unix_seconds=o.created_unix_seconds,
        updated_unix_seconds=o.updated_unix_seconds,
        params=dict(o.params),
        agents=[
            AgentProgressView(
                a.agent_id, a.state, a.num_done_blocks, a.num_total_blocks, a.num_failed_blocks, a.error, a.result
            )
            for a in o.agents
        ],
        dry_run=o.dry_run,
        result=o.result,
    )


def _tier_name(value: int) -> str:
    try:
        return Tier(value).label
    except ValueError:
        return f"tier{value}"


def _tiers(tiers) -> list[TierView]:
    return [
        TierView(
            _tier_name(t.tier),
            t.capacity_bytes,
            t.used_bytes,
            t.num_blocks,
            t.uncompressed_bytes,
            t.stored_bytes,
            t.num_parked_blocks,
        )
        for t in tiers
    ]


class ControlPlaneClient:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_seconds: float = 5.0,
        token: str = "",
        tls: TLSConfig | None = None,
        lookup_endpoint: str = "",
    ):
        """`endpoint`: HOST:PORT of a control-plane replica, or several, comma separated
        (a call that cannot connect to one goes to the next: with every replica listed, a
        dead leader's successor is found); `token`: bearer token for the admin API
        (viewer or operator); `tls`: the CA that signed the control plane's certificate
        (and ours, for mTLS); `lookup_endpoint`: the leader's lookup socket (HOST:PORT or
        unix:PATH), which lookup() then uses instead of gRPC."""
        self._metadata = token_metadata(token)
        self._tls = tls
        self._endpoints = [e.strip() for e in endpoint.split(",") if e.strip()] or [DEFAULT_ENDPOINT]
        self.endpoint = self._endpoints[0]
        self.timeout_seconds = timeout_seconds
        self._token = token
        self._lookups = LookupSocket(lookup_endpoint, token, timeout_seconds, tls) if lookup_endpoint else None
        self._lookups_moving = threading.Lock()
        self._connect(self.endpoint)

    @property
    def lookup_endpoint(self) -> str:
        """The lookup socket lookup() uses now ('' when it uses gRPC)."""
        return self._lookups.endpoint if self._lookups is not None else ""

    def _socket_lookup(self, request: admin_pb2.LookupRequest) -> admin_pb2.LookupResponse:
        """A lookup over the socket; when that socket's replica does not lead, or answered
        once and cannot be reached now (a leader change), the leader's socket is asked of
        the admin API (which follows the leader across `endpoint`'s replicas) and the
        lookup asked there, once."""
        lookups = self._lookups
        assert lookups is not None
        try:
            return lookups.call(request)
        except ClientError as exc:
            # gone after it answered (a leader that died): an address that never answered
            # is a wrong one, said so rather than silently replaced
            gone = isinstance(exc, LookupSocketUnreachable) and lookups.answered
            if exc.kind != "NotLeader" and not gone:
                raise
            with self._lookups_moving:  # threads sharing this client move it once
                if self._lookups is lookups:
                    try:
                        address = self._call("GetStats", admin_pb2.GetStatsRequest()).lookup_address
                    except ClientError:
                        raise exc from None  # the socket's own answer says more
                    address = reachable_lookup_address(address, self.endpoint)
                    if not address or address == lookups.endpoint:
                        raise
                    self._lookups = LookupSocket(address, self._token, self.timeout_seconds, self._tls)
                    lookups.close()
                moved = self._lookups
            assert moved is not None  # set in __init__, and only ever replaced
            return moved.call(request)

    def _connect(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel = secure_channel(endpoint, self._tls)
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)

    def use_endpoint(self, endpoint: str) -> None:
        """Talk to `endpoint` from now on (e.g. the leader another client already found),
        with the same token and TLS; it joins the replicas tried when one cannot be reached."""
        if endpoint and endpoint not in self._endpoints:
            self._endpoints.append(endpoint)
        if endpoint and endpoint != self.endpoint:
            self._channel.close()
            self._connect(endpoint)

    def _use_next_endpoint(self) -> None:
        """Move on to the replica after this one in the list given (round robin)."""
        i = self._endpoints.index(self.endpoint) if self.endpoint in self._endpoints else -1
        self.use_endpoint(self._endpoints[(i + 1) % len(self._endpoints)])

    def _leader_of(self, exc: grpc.RpcError) -> str:
        """The leader a follower named in its FAILED_PRECONDITION answer, if not us."""
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return ""
        leader = dict(exc.trailing_metadata() or ()).get(LEADER_METADATA_KEY, "")
        return leader if leader != self.endpoint else ""

    def close(self) -> None:
        self._channel.close()
        if self._lookups is not None:
            self._lookups.close()

    def __enter__(self) -> ControlPlaneClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _change(self, method: str, request):
        """A change that may be asked again without harm (unpin, cancel, policy set): one
        the control plane refused because etcd was unreachable is asked again after 0.25,
        0.5 and 1 s (etcd never saw it); after that the refusal is the answer."""
        for delay_seconds in (0.25, 0.5, 1.0):
            try:
                return self._call(method, request)
            except ClientError as exc:
                if not _refused_by_etcd(exc):
                    raise
            time.sleep(delay_seconds)
        return self._call(method, request)

    def _call(self, method: str, request, follow: bool = True):
        tried = {self.endpoint}
        named_by = ""  # the replica that named the leader being asked
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout_seconds, metadata=self._metadata)
            except grpc.RpcError as exc:
                leader = self._leader_of(exc) if follow else ""
                if leader:
                    follow = False
                    named_by = self.endpoint
                    self.use_endpoint(leader)
                    tried.add(leader)
                    continue
                # never reached this replica, or it is not the leader and names none
                # other (or, stale, itself), or it is cut off from etcd (a leader that lost
                # etcd alone while another was elected): the call was not applied; another
                # replica may take it
                error = self._error(exc)  # naming the replica asked, not the one moved on to
                if _not_connected(exc) or _not_leader(exc) or _cut_off_from_etcd(exc):
                    other = next((e for e in self._endpoints if e not in tried), "")
                    if other:
                        tried.add(other)
                        self.use_endpoint(other)
                        continue
                elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and len(self._endpoints) > 1:
                    # it may have been applied there, so it is not sent again; the next call
                    # starts at another replica (a paused leader's successor, say)
                    self._use_next_endpoint()
                if named_by and _not_connected(exc):
                    # not "start a control plane": one answered, naming a leader that is gone
                    error = ClientError(
                        error.code,
                        f"the control plane at {named_by} names {self.endpoint} as its leader, which cannot be "
                        "reached: it may have just died and a new leader not been elected yet; retry in a few seconds",
                    )
                raise error from None

    def _error(self, exc: grpc.RpcError) -> ClientError:
        code = exc.code()
        details = exc.details() or ""
        # the control plane's own UNAVAILABLE (etcd unreachable, no leader, ...) is its answer,
        # naming its kind; gRPC's own (no connection) is ours to explain
        kind = error_kind_of(exc)
        answered = bool(kind)
        if not answered and code == grpc.StatusCode.DEADLINE_EXCEEDED:
            # a slow answer or no route: either way a change asked for may have been made
            return ClientError(
                code.name,
                f"no answer from the kvcp control plane at {self.endpoint} within {self.timeout_seconds:g} s "
                "(deadline_exceeded): it is unreachable or busy (a longer --timeout?); a change asked for may "
                "still have been made: kvctl ops / kvctl pins list them",
            )
        if not answered and code == grpc.StatusCode.UNAVAILABLE and _unresolved(details):
            return ClientError(
                code.name,
                f"cannot reach the kvcp control plane at {self.endpoint}: its host name does not resolve; "
                "check --endpoint / KVCTL_ENDPOINT",
            )
        if not answered and code == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
            return ClientError(
                code.name,
                f"cannot reach the kvcp control plane at {self.endpoint} ({code.name.lower()}); "
                "start one with `make demo` or `kvcp-controlplane`, or pass --endpoint / KVCTL_ENDPOINT",
            )
        if not answered and code == grpc.StatusCode.UNIMPLEMENTED:
            return ClientError(
                code.name,
                f"{self.endpoint} does not serve the kvcp admin API ({details or 'method not found'}): "
                "an agent's or another service's port? give the control plane's address (--endpoint)",
            )
        return ClientError(code.name, exc.details() or code.name, kind)

    # ---- calls ----------------------------------------------------------------------
    def list_agents(self) -> list[AgentView]:
        resp = self._call("ListAgents", admin_pb2.ListAgentsRequest())
        return [
            AgentView(
                agent_id=a.info.agent_id,
                address=a.info.address,
                state=AGENT_STATES.get(a.state, "unknown"),
                num_blocks=a.num_blocks,
                tiers=_tiers(a.info.tiers),
                models=[m.model_id for m in a.info.models],
                lookups_total=a.lookups_total,
                lookup_tokens_total=a.lookup_tokens_total,
                lookup_hit_tokens_total=a.lookup_hit_tokens_total,
                last_seen_unix_seconds=a.last_seen_unix_seconds,
                transfer_engine=a.info.transfer_engine,
                transfer_engine_status=a.info.transfer_engine_status,
                shm_handoff=bool(a.info.shm_path),
                cordon_reason=a.cordon_reason,
            )
            for a in resp.agents
        ]

    def lookup(
        self,
        model_id: str,
        token_ids: list[int] | None = None,
        block_hashes: bytes = b"",
        extra_keys: tuple[str, ...] = (),
    ) -> LookupView:
        if block_hashes and len(block_hashes) % BLOCK_HASH_BYTES:
            raise ClientError(
                "INVALID_ARGUMENT",
                f"block hashes must be {BLOCK_HASH_BYTES} bytes each ({2 * BLOCK_HASH_BYTES} hex digits)",
            )
        request = admin_pb2.LookupRequest(
            model_id=model_id, token_ids=token_ids or [], block_hashes=block_hashes, extra_keys=list(extra_keys)
        )
        resp = self._socket_lookup(request) if self._lookups is not None else self._call("Lookup", request)
        return LookupView(
            model_id=resp.model_id,
            num_tokens=resp.num_tokens,
            num_blocks=resp.num_blocks,
            best_agent_id=resp.best_agent_id,
            agents=[
                AgentMatchView(m.agent_id, m.num_hit_blocks, m.num_hit_tokens, [_tier_name(t) for t in m.tiers])
                for m in resp.agents
            ],
            possibly_stale=resp.possibly_stale,
        )

    def stats(self) -> StatsView:
        s = self._call("GetStats", admin_pb2.GetStatsRequest())
        return StatsView(
            num_agents=s.num_agents,
            num_blocks=s.num_blocks,
            num_block_replicas=s.num_block_replicas,
            lookups_total=s.lookups_total,
            lookup_tokens_total=s.lookup_tokens_total,
            lookup_hit_tokens_total=s.lookup_hit_tokens_total,
            resyncs_total=s.resyncs_total,
            events_total=s.events_total,
            leader_address=s.leader_address,
            epoch=s.epoch,
            is_leader=s.is_leader,
            lookup_address=s.lookup_address,
            policy_reuse_credit_turnovers=s.policy_reuse_credit_turnovers,
            policy_recent_first=s.policy_recent_first,
            policy_passes_total=s.policy_passes_total,
            tier_moved_bytes_total=s.tier_moved_bytes_total,
            tiers=_tiers(s.tiers),
            models=[
                {
                    "model_id": m.model_id,
                    "block_size": m.block_size,
                    "num_layers": m.num_layers,
                    "num_kv_heads": m.num_kv_heads,
                    "head_dim": m.head_dim,
                    "dtype": m.dtype,
                }
                for m in s.models
            ],
        )

    # ---- pins -----------------------------------------------------------------------
    def pin(
        self,
        model_id: str = "",
        token_ids: list[int] | None = None,
        block_hashes: bytes = b"",
        extra_keys: tuple[str, ...] = (),
        namespace: str = "",
        agent_id: str = "",
        min_tier: str = "cpu",
        ttl_seconds: float = 0.0,
        owner: str = "",
        owner_lease_id: int = 0,
        pin_id: str = "",
        retries: int = PIN_RETRIES,
    ) -> PinView:
        """Pin under `pin_id` (empty: an id chosen here), so that a call whose answer was
        lost (UNKNOWN, DEADLINE_EXCEEDED, the connection dropped) is retried, up to
        `retries` times (through a control plane that says etcd is away meanwhile), without
        making a second pin: the control plane answers a retry with the pin the first try
        made."""
        try:
            tier = int(Tier.parse(min_tier))
        except ValueError as exc:
            raise ClientError("INVALID_ARGUMENT", f"min_tier: {exc}") from None
        req = admin_pb2.PinRequest(
            scope=_scope(model_id, token_ids, block_hashes, extra_keys, namespace, agent_id),
            min_tier=tier_pb(tier),
            ttl_seconds=ttl_seconds,
            owner=owner,
            owner_lease_id=owner_lease_id,
            pin_id=pin_id or uuid.uuid4().hex[:12],
        )
        lost = False  # a try may have made the pin: until an answer says, keep asking
        for attempt in range(retries + 1):
            try:
                return _pin_view(self._call("Pin", req))
            except ClientError as exc:
                lost = lost or _outcome_lost(exc)
                if lost and attempt < retries and (_outcome_lost(exc) or exc.code == "UNAVAILABLE"):
                    time.sleep(0.25 * 2**attempt)
                    continue
                if lost:
                    raise ClientError(
                        exc.code,
                        f"{exc}; pin {req.pin_id!r} may have been made: run the same pin with "
                        f"--pin-id {req.pin_id} to retry it safely",
                    ) from None
                raise
        raise AssertionError("unreachable")

    def unpin(self, pin_id: str) -> PinView:
        return _pin_view(self._change("Unpin", admin_pb2.UnpinRequest(pin_id=pin_id)))

    def list_pins(self, namespace: str = "") -> PinList:
        resp = self._call("ListPins", admin_pb2.ListPinsRequest(namespace=namespace))
        pins = PinList(_pin_view(p) for p in resp.pins)
        pins.possibly_stale = resp.possibly_stale
        return pins

    # ---- operations -----------------------------------------------------------------
    def move(
        self,
        to_tier: str,
        model_id: str = "",
        token_ids=None,
        block_hashes: bytes = b"",
        extra_keys=(),
        namespace: str = "",
        agent_id: str = "",
        codec: str = "",
    ) -> OperationView:
        try:
            tier = int(Tier.parse(to_tier))
        except ValueError as exc:
            raise ClientError("INVALID_ARGUMENT", f"to_tier: {exc}") from None
        req = admin_pb2.MoveRequest(
            scope=_scope(model_id, token_ids, block_hashes, extra_keys, namespace, agent_id),
            to_tier=tier_pb(tier),
            codec=codec,
        )
        return _op_view(self._call("Move", req))

    def cleanup(
        self,
        older_than_seconds: float = 0.0,
        namespace: str = "",
        agent_id: str = "",
        model_id: str = "",
        dry_run: bool = False,
    ) -> OperationView:
        req = admin_pb2.CleanupRequest(
            older_than_seconds=older_than_seconds,
            namespace=namespace,
            agent_id=agent_id,
            model_id=model_id,
            dry_run=dry_run,
        )
        return _op_view(self._call("Cleanup", req))

    def compress(
        self,
        codec: str,
        model_id: str = "",
        token_ids=None,
        block_hashes: bytes = b"",
        extra_keys=(),
        namespace: str = "",
        agent_id: str = "",
        tier: str = "",
    ) -> OperationView:
        try:
            tier_value = int(Tier.parse(tier)) if tier else 0
        except ValueError as exc:
            raise ClientError("INVALID_ARGUMENT", f"tier: {exc}") from None
        req = admin_pb2.CompressRequest(
            scope=_scope(model_id, token_ids, block_hashes, extra_keys, namespace, agent_id),
            codec=codec,
            tier=tier_pb(tier_value),
        )
        return _op_view(self._call("Compress", req))

    def transfer(
        self,
        model_id: str,
        from_agent_id: str,
        to_agent_id: str,
        token_ids=None,
        block_hashes: bytes = b"",
        extra_keys=(),
        deadline_seconds: float = 0.0,
    ) -> OperationView:
        """Hand a prefix from one agent to another (operation kind "transfer")."""
        req = admin_pb2.TransferRequest(
            scope=_scope(model_id, token_ids, block_hashes, extra_keys),
            from_agent_id=from_agent_id,
            to_agent_id=to_agent_id,
            deadline_seconds=deadline_seconds,
        )
        return _op_view(self._call("Transfer", req))

    def drain(
        self,
        agent_id: str,
        to_agent_ids=(),
        model_id: str = "",
        deadline_seconds: float = 0.0,
        reason: str = "",
    ) -> OperationView:
        """Cordon an agent and hand every prefix it holds to agents in rotation (operation
        kind "drain")."""
        req = admin_pb2.DrainRequest(
            agent_id=agent_id,
            to_agent_ids=list(to_agent_ids),
            model_id=model_id,
            deadline_seconds=deadline_seconds,
            reason=reason,
        )
        return _op_view(self._call("Drain", req))

    def route(
        self,
        model_id: str,
        token_ids=None,
        block_hashes: bytes = b"",
        extra_keys=(),
        role: str = "",
        prefill_agent_id: str = "",
    ) -> RouteView:
        """Where a router sends a request: the prefill agent, the decode agent, split or not."""
        r = self._call(
            "Route",
            admin_pb2.RouteRequest(
                model_id=model_id,
                token_ids=token_ids or [],
                block_hashes=block_hashes,
                extra_keys=list(extra_keys),
                role=role,
                prefill_agent_id=prefill_agent_id,
            ),
        )
        return RouteView(
            r.role,
            r.agent_id,
            r.address,
            r.prefill_agent_id,
            r.decode_agent_id,
            r.disaggregate,
            r.num_cached_tokens,
            r.transfer_seconds,
            r.saved_seconds,
            r.reason,
            r.backpressure,
            [
                RouteCandidateView(
                    c.agent_id,
                    c.estimated_seconds,
                    c.num_cached_blocks,
                    c.num_active_handoffs,
                    c.free_bytes,
                    c.link_bytes_per_second,
                    c.transfer_seconds,
                    c.behind,
                    c.note,
                )
                for c in r.candidates
            ],
            r.possibly_stale,
        )

    def get_operation(self, op_id: str) -> OperationView:
        return _op_view(self._call("GetOperation", admin_pb2.GetOperationRequest(op_id=op_id)))

    def list_operations(self, max_operations: int = 100) -> list[OperationView]:
        resp = self._call("ListOperations", admin_pb2.ListOperationsRequest(max_operations=max_operations))
        return [_op_view(o) for o in resp.operations]

    def cancel_operation(self, op_id: str) -> OperationView:
        return _op_view(self._change("CancelOperation", admin_pb2.CancelOperationRequest(op_id=op_id)))

    def wait_operation(
        self, op_id: str, timeout_seconds: float = 300.0, on_progress=None, until_finished: bool = True
    ) -> OperationView:
        """Poll an operation until it finishes or `timeout_seconds` pass; `on_progress(op)`
        is called on every poll. The last view comes back either way: a caller tells the
        two apart by `op.finished`. A poll the control plane could not answer (a failover:
        the leader gone or paused, a replica not leading yet, etcd away) is asked again,
        of the next replica given, until the time is up (reading is always safe).
        `until_finished=False`: the first answer, however the operation stands."""
        start = time.monotonic()
        deadline = start + timeout_seconds
        answered = False
        while True:
            asked = self.endpoint
            try:
                op = self.get_operation(op_id)
                answered = True
            except ClientError as exc:
                now = time.monotonic()
                if (
                    exc.code not in WAIT_RETRY_CODES
                    or now >= deadline
                    or exc.kind == "NotConfigured"  # its lasting answer
                    or (not answered and now - start >= FIRST_ANSWER_SECONDS)  # a wrong address, say
                ):
                    raise
                if self.endpoint == asked:  # (a call that timed out has moved on already)
                    self._use_next_endpoint()
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            if on_progress:
                on_progress(op)
            left = deadline - time.monotonic()
            if op.finished or left <= 0 or not until_finished:
                return op
            time.sleep(min(0.2, left))

    # ---- policy ---------------------------------------------------------------------
    def get_policy(self) -> dict[str, str]:
        return dict(self._call("GetPolicy", admin_pb2.GetPolicyRequest()).values)

    def set_policy(self, values: dict[str, str]) -> dict[str, str]:
        return dict(self._change("SetPolicy", admin_pb2.SetPolicyRequest(values=values)).values)

    def cordon(self, agent_id: str, reason: str) -> str:
        """No new work for the agent (Lookup and Route leave it out) until uncordoned: the
        policy key cordon.<agent_id>, durable in etcd. Returns the reason stored."""
        key = CORDON_POLICY_PREFIX + agent_id
        return self.set_policy({key: reason}).get(key, "")

    def uncordon(self, agent_id: str) -> bool:
        """Back in rotation. Returns whether it was cordoned."""
        key = CORDON_POLICY_PREFIX + agent_id
        was = key in self.get_policy()
        self.set_policy({key: POLICY_ENTRY_REMOVED[-1]})
        return was

    # ---- watch ----------------------------------------------------------------------
    def watch(self, kinds: tuple[str, ...] = (), replay_recent: bool = True):
        """Iterator of EventView from the control plane's Watch stream (no deadline).
        A follower's FAILED_PRECONDITION is followed to the leader it names, once, as for
        unary calls. Raises ClientError when the stream breaks; callers reconnect."""
        request = admin_pb2.WatchRequest(kinds=list(kinds), replay_recent=replay_recent)
        follow = True
        while True:
            try:
                for e in self._stub.Watch(request, metadata=self._metadata):
                    yield EventView(e.seq, e.unix_seconds, e.kind, e.severity, e.agent_id, e.op_id, e.pin_id, e.message)
                return
            except grpc.RpcError as exc:
                leader = self._leader_of(exc) if follow else ""
                if not leader:
                    raise self._error(exc) from None
                follow = False
                self.use_endpoint(leader)
