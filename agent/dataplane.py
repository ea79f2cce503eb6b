"""The agent's data plane: prefill -> decode handoff of a prefix's KV blocks to a peer.

Receiving, it keeps reservations (agent.core.handoff.Reservations) of pages in its
CPU slab, which is registered with the Transfer Engine so a peer can write into it.
Sending, it runs each handoff through its paths, within the caller's deadline:

0. **shm** (a peer on this host whose CPU slab is a memfd, agent.store.shm): Reserve ->
   the blocks copied straight into the reserved pages of the peer's slab, mapped here
   (one memcpy per run: no socket, no engine) -> Commit, which verifies every block.
1. **engine**: Reserve on the peer (gRPC) -> one-sided engine writes of each block's
   stored payload from this agent's CPU slab straight into the reserved pages (no
   staging copy; blocks elsewhere, on disk or in the GPU tier, are first read into one
   host bounce buffer per batch, registered with the engine once: the GPU slab is not
   registered) -> Commit with an xxh3 checksum per block. Chunks
   are verified by the peer while the next chunk is on the wire; the last Commit
   makes the whole prefix visible at once.
2. **grpc**: the same reservation filled by a chunked client stream (Push), for when
   the engine fails or is not there.
3. **recompute**: every path failed or the deadline came: the answer says so, with
   the reasons, and the destination engine recomputes the prefix.

Each path is retried with exponential backoff; a busy receiver (too many handoffs
arriving) is waited for, which is how handoffs queue instead of overrunning a decode
agent. Per-link limits (concurrent transfers, bytes per second) apply on the sender,
and each link's achieved throughput is measured and reported to the control plane
(AgentStats.dataplane), which routes by it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from agent.core.block_pool import BlockPool
from agent.core.blocks import BlockMeta
from agent.core.drain import DrainPlan, drain_chains
from agent.core.handoff import (
    ENGINE,
    GRPC,
    PATHS,
    PRESENT,
    RECOMPUTE,
    SHM,
    TRANSFERRED,
    HandoffResult,
    Links,
    Reservations,
    RetryPolicy,
)
from agent.handoff_paths import HandoffPaths, PathError, Peer, Stalled
from agent.store.memory_tier import paged_bytes
from agent.store.shm import PeerSlab, host_id, own_start_ticks, process_alive
from agent.store.transfer_engine import TransferBackend, TransferFailed, TransferTimedOut
from protos import errors, etcd_keys, security
from protos.grpc_errors import error_kind_of
from protos.kv_format import MAX_HANDOFF_DEADLINE_SECONDS
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2
from protos.namespaces import check_namespace
from protos.pb_enums import tier_pb
from protos.tier import Tier

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def transfer_result(r: HandoffResult) -> str:
    """A handoff that landed, in words for its operation: the path and what it cost."""
    if r.outcome == PRESENT:
        return f"{r.num_blocks} blocks already on the destination"
    said = f"via {r.path} in {r.seconds:.2f}s"
    if r.reason:  # the paths that failed or were skipped before this one
        said += f" ({r.attempts} attempts: {r.reason})" if r.attempts > 1 else f" ({r.reason})"
    return said


class PrefixNotHeld(errors.FailedPrecondition):
    """A handoff's source holds no block of the prefix (a drain takes it as a prefix dropped
    there meanwhile, not as the destination failing)."""


def cordoned(agent_id: str, why: str, since: str = "") -> errors.FailedPrecondition:
    """The refusal of a handoff to a cordoned agent: at its start, or at a retry once the
    record read again says it was cordoned since (`since`: how far the handoff got)."""
    return errors.FailedPrecondition(
        f"destination_agent_id: agent {agent_id} is cordoned ({why}){since}; "
        f"kvctl uncordon {agent_id} first, or hand off to another agent"
    )


@dataclass
class DataPlaneConfig:
    deadline_seconds: float = 10.0  # default answer time of a handoff
    rpc_timeout_seconds: float = 3.0  # one control RPC to a peer (Reserve, Commit, Abort)
    chunk_bytes: int = 8 << 20  # engine writes go in batches of about this much, each verified once it landed
    engine_window: int = 4  # engine batches on the wire at once (they travel side by side)
    # the receiver verifies batches that landed while later ones travel (on threads of lower
    # priority: they take the cycles the transfer leaves), so the last Commit hashes the last
    # window; a verify goes once its landed batches reach this much (or a quarter of the
    # handoff, or one batch; agent.core.handoff.LandedGroups), one at a time per handoff
    verify_while_sending: bool = True
    engine_verify_group_bytes: int = 32 << 20
    # threads copying one shm handoff side by side (one core's copy is bound by its own
    # cache misses: two copy about twice as fast)
    shm_copy_threads: int = max(1, min(4, os.cpu_count() or 1))
    # a shm handoff larger than this is verified by the peer in groups (each while the next
    # is copied, its bytes still in cache); a smaller one by its one Commit
    shm_verify_group_bytes: int = 16 << 20
    grpc_chunk_bytes: int = 1 << 20  # fallback stream message size
    stall_min_bytes_per_second: float = 20e6  # slower than this (plus 2 s) is a stall
    link_max_concurrent: int = 2
    link_bytes_per_second: float = 0.0  # 0: unlimited
    max_inbound: int = 8
    quarantine_seconds: float = 0.0  # 0: the engine's timeout + 2 s
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # how long a drain goes on trying, in all, the destinations that refused its blocks past
    # their drop line (Route's handoffs took the room), for the chains they left: their room
    # frees as the tier policy's passes drop blocks, a cleanup runs or decodes end, within
    # seconds (the policy passes every few; Route's handoffs are held 2 s), so half a minute
    # covers a few of each and keeps a rolling upgrade's step short. 0: no retry
    drain_full_wait_seconds: float = 30.0


PEER_CACHE_SECONDS = 2.0  # a peer's etcd record is read again after this long
PEER_REFRESH_WAIT_SECONDS = 1.0  # a retry waits at most this long (and half its time left) for the peer's record
PEER_LAPSE_GRACE_SECONDS = 10.0  # a peer whose key vanished is still tried at its last address this long
PEER_SLAB_IDLE_SECONDS = 60.0  # a peer's mapped slab unused this long is let go (it may be gone)
LINK_FORGET_IDLE_SECONDS = 60.0  # a link unused this long to a peer etcd no longer names is forgotten
DEPARTED_CHECK_SECONDS = 30.0  # how often idle links' peers are looked up in etcd
TRANSFER_HEARTBEAT_SECONDS = 5.0  # a control-plane transfer says RUNNING this often while it runs


def _rpc_error(exc: grpc.RpcError, what: str) -> PathError:
    code = exc.code()
    details = exc.details() or code.name
    if error_kind_of(exc) == errors.FillLimitReached.__name__:  # a drain's blocks past the destination's line
        return PathError(f"{what}: {details}", permanent=True, full=True)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return PathError(f"{what}: destination busy ({details})", busy=True)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return PathError(f"{what}: {details}", path_off=True)
    if code in (grpc.StatusCode.NOT_FOUND,) or (code == grpc.StatusCode.FAILED_PRECONDITION and what == "reserve"):
        return PathError(f"{what}: {details}", permanent=True)
    if code == grpc.StatusCode.UNAVAILABLE:
        return PathError(f"{what}: destination unreachable ({details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PathError(f"{what}: no answer in time")
    return PathError(f"{what}: {code.name.lower()}: {details}")


class DataPlane(HandoffPaths):
    def __init__(
        self,
        agent_id: str,
        pool: BlockPool,
        engine: TransferBackend,
        config: DataPlaneConfig | None = None,
        peer_info=None,
        metrics=None,
        cordons=None,
    ):
        self.agent_id = agent_id
        self.pool = pool
        self.engine = engine
        self.config = config or DataPlaneConfig()
        self.tier = Tier.CPU if Tier.CPU in pool.store_of else pool.top.tier
        quarantine = self.config.quarantine_seconds or (getattr(engine, "timeout_seconds", 5) + 2.0)
        self.reservations = Reservations(
            pool, self.tier, self.config.max_inbound, quarantine, writer_alive=process_alive, agent_id=agent_id
        )
        self.store = self.reservations.store  # pool.store_of[self.tier]: a slab (Reservations refuses others)
        self.links = Links(self.config.link_max_concurrent, self.config.link_bytes_per_second)
        self._peer_info = peer_info  # callable(agent_id) -> AgentInfo | None (etcd)
        self._cordons = cordons  # callable() -> {agent id: reason} of the cordoned agents (etcd's policy)
        self.metrics = metrics  # agent.metrics.AgentMetrics (record_transfer), optional
        self._peers: dict[str, tuple[float, Peer]] = {}  # agent id -> (when etcd last named it, its record)
        self._etcd_failed_at = -math.inf  # monotonic time of the last etcd read that failed
        self._channels: dict[str, grpc.Channel] = {}
        self._channel_users: dict[grpc.Channel, int] = {}  # handoffs on each channel now
        self._aborts: set = set()  # Abort calls still on the wire (a call nobody holds is cancelled)
        self.aborts_retried_total = 0
        self._lock = threading.Lock()
        # one writer thread per handoff on the engine path (it holds it while the handoff runs)
        self._writers = cf.ThreadPoolExecutor(max_workers=16, thread_name_prefix="te-write")
        self.copier = cf.ThreadPoolExecutor(
            max_workers=max(1, self.config.shm_copy_threads - 1), thread_name_prefix="shm-copy"
        )
        self._rng = random.Random()
        self._closing = False  # close() began: executors refuse work, handoffs under way end
        self._refresher = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="peer-read")
        self._refreshing: dict[str, cf.Future] = {}  # agent id -> its record's read under way
        self._drains: dict[str, threading.Event] = {}  # drain op id -> its cancel flag
        self._drain_wake = threading.Condition(self._lock)  # a cancel or close(): drains waiting for room stop
        self._departed_check: cf.Future | None = None  # _forget_departed_peers under way (sweep thread only)
        self.tls: security.TLSConfig | None = None  # this agent's: peers' listeners use the same
        self.token = ""  # the agent token, which peers' DataPlane listeners ask for
        self.shared = getattr(self.store, "shared_slab", None)  # agent.store.shm.SharedSlab, or None
        self._peer_slabs: dict[str, tuple[PeerSlab, float]] = {}  # agent id -> (mapped slab, last used)
        self._shm_refused: dict[tuple, float] = {}  # slab key -> monotonic time to try it again
        self.registered = False
        if engine.available:
            slab = self.store.slab
            try:
                engine.register(slab.data_ptr(), slab.numel())
                self.registered = True
            except TransferFailed as exc:
                log.warning("cannot register the %s slab with the transfer engine: %s", self.tier.label, exc)

    # ---- what the agent publishes -------------------------------------------------
    @property
    def engine_up(self) -> bool:
        return self.engine.available and self.registered

    @property
    def shm_up(self) -> bool:
        return self.shared is not None

    def fill_info(self, info: types_pb2.AgentInfo) -> None:
        info.transfer_engine = self.engine.name if self.engine_up else ""
        info.transfer_endpoint = self.engine.endpoint if self.engine_up else ""
        info.transfer_protocol = self.engine.protocol if self.engine_up else ""
        reachable = self.engine_up or self.shm_up
        info.transfer_buffer_address = self.store.slab.data_ptr() if reachable else 0
        info.transfer_buffer_bytes = self.store.slab.numel() if reachable else 0
        info.transfer_engine_status = self.engine.status
        if self.shared is not None:
            info.shm_path, info.shm_inode, info.shm_host_id = self.shared.path, self.shared.inode, host_id()
        info.handoff_page_bytes = self.store.page_bytes  # what a drain into this agent charges a block

    def stats(self) -> agent_pb2.DataPlaneStats:
        links = self.links.all()
        return agent_pb2.DataPlaneStats(
            links=[
                agent_pb2.LinkStats(
                    peer_agent_id=link.peer_agent_id,
                    throughput_bytes_per_second=link.throughput_bytes_per_second,
                    latency_seconds=link.latency_seconds,
                    num_inflight_transfers=link.inflight,
                    num_queued_transfers=link.queued,
                    transfers_total=link.transfers_total,
                    failures_total=link.failures_total,
                    bytes_total=link.bytes_total,
                    last_path=link.last_path,
                    last_unix_seconds=link.last_unix_seconds,
                )
                for link in links
            ],
            num_inbound_handoffs=self.reservations.open_count(),
            reserved_bytes=self.reservations.reserved_bytes(),
            handoff_free_bytes=max(0, self.pool.reclaimable_bytes(self.tier)),
            handoff_capacity_bytes=self.store.capacity_bytes,
            num_outbound_inflight_handoffs=sum(link.inflight for link in links),
            num_outbound_queued_handoffs=sum(link.queued for link in links),
            max_inbound_handoffs=self.reservations.max_inbound,
            handoff_tier=tier_pb(self.tier),
        )

    # ---- receiving ----------------------------------------------------------------
    def reserve(self, request: agent_pb2.ReserveRequest) -> agent_pb2.ReserveResponse:
        if request.path and request.path not in PATHS:
            raise errors.InvalidArgument("path", f"unknown path {request.path[:40]!r}; expected {', '.join(PATHS)}")
        if request.ttl_seconds < 0:  # (it became 0.1 s quietly)
            raise errors.InvalidArgument("ttl_seconds", f"must not be negative, got {request.ttl_seconds}")
        if request.path == ENGINE and not self.engine_up:
            raise errors.InvalidArgument("path", f"this agent takes no engine writes: {self.engine.status}")
        if request.path == SHM and not self.shm_up:
            raise errors.InvalidArgument("path", "this agent's slab is not in shared memory (--no-shm-handoff or CUDA)")
        hashes = _split(request.block_hashes, "block_hashes")
        if not hashes:
            raise errors.InvalidArgument("block_hashes", "give at least one block")
        for ns in {request.namespace, *request.namespaces} - {""}:
            check_namespace(ns, "namespaces")
        r = self.reservations.reserve(
            request.model_id,
            hashes,
            list(request.stored_bytes),
            list(request.codecs),
            list(request.namespaces) or request.namespace,
            request.ttl_seconds or self.config.deadline_seconds,
            request.source_agent_id,
            # a same-host sender copies into the pages itself: they wait for it, not a timer
            (request.writer_pid, request.writer_start_ticks) if request.path == SHM and request.writer_pid else None,
            request.reservation_id,
            request.fill_limit_bytes,
        )
        slots = self.reservations.slots(r)
        return agent_pb2.ReserveResponse(
            reservation_id=r.reservation_id,
            num_present_blocks=r.num_present,
            slots=agent_pb2.BlockSlots(addresses=[a for a, _ in slots], lengths=[n for _, n in slots]),
            transfer_endpoint=self.engine.endpoint if self.engine_up else "",
            expires_unix_seconds=time.time() + (r.expires_monotonic - time.monotonic()),
        )

    def push(self, chunks) -> agent_pb2.PushResponse:
        """Fallback path: a client stream of chunks written into a reservation's pages."""
        r = None
        received = 0
        try:
            for chunk in chunks:
                if r is None:
                    if not chunk.reservation_id:
                        raise errors.InvalidArgument("reservation_id", "must not be empty")
                    r = self.reservations.attach_writer(chunk.reservation_id)
                if chunk.data:
                    self.reservations.write(r, chunk.block_index, chunk.offset, chunk.data)
                    received += len(chunk.data)
        finally:
            if r is not None:
                self.reservations.detach_writer(r)
        return agent_pb2.PushResponse(received_bytes=received)

    def commit(self, request: agent_pb2.CommitRequest) -> agent_pb2.CommitResponse:
        checks = list(request.checksums)
        if request.last:
            r = self.reservations.commit(request.reservation_id, request.first_block, checks)
        else:
            r = self.reservations.verify(request.reservation_id, request.first_block, checks)
        return agent_pb2.CommitResponse(
            num_committed_blocks=(r.num_blocks - r.num_present) if request.last else 0,
            num_present_blocks=r.num_present,
        )

    def abort(self, request: agent_pb2.AbortRequest) -> None:
        if not request.reservation_id:
            raise errors.InvalidArgument("reservation_id", "must not be empty")
        if self.reservations.abort(request.reservation_id, request.writes_quiesced):
            log.info("handoff reservation %s aborted: %s", request.reservation_id, request.reason or "no reason")

    def run_forever(self, stop: threading.Event) -> None:
        next_departed_check = time.monotonic() + DEPARTED_CHECK_SECONDS
        while not stop.is_set():
            try:
                n = self.reservations.run_once()
                if n:
                    log.warning("%d handoff reservation(s) expired before their commit; pages quarantined", n)
                self._forget_idle_peer_slabs()
                if time.monotonic() >= next_departed_check:
                    next_departed_check = time.monotonic() + DEPARTED_CHECK_SECONDS
                    self._check_departed_peers()
            except Exception:  # noqa: BLE001 - keep sweeping
                log.exception("reservation sweep failed")
            stop.wait(0.2)

    def _check_departed_peers(self) -> None:
        """Starts `_forget_departed_peers` on the peer-read executor unless one is still
        under way: it reads etcd, and an etcd stall must not hold up the reservation sweep
        (an expired reservation's pages wait on it)."""
        if self._departed_check is not None and not self._departed_check.done():
            return
        try:
            check = self._refresher.submit(self._forget_departed_peers)
        except RuntimeError:  # the agent is stopping
            return
        check.add_done_callback(_log_failure)
        self._departed_check = check

    def _forget_departed_peers(self) -> None:
        """A link (its fitted throughput, its two metric series, its line in every stats
        report) and the channel to a peer that left: forgotten once the link has been idle
        LINK_FORGET_IDLE_SECONDS and etcd no longer names the peer. Agents that come back
        under new ids (pods of a rollout) would otherwise grow them without end."""
        if self._peer_info is None:
            return
        cutoff = time.time() - LINK_FORGET_IDLE_SECONDS
        for link in self.links.all():
            if link.inflight or link.queued or link.last_unix_seconds > cutoff:
                continue
            try:
                registered = self._peer_info(link.peer_agent_id) is not None
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: nothing is known gone
                log.debug("cannot tell which peers left (%s)", exc)
                return
            if registered or not self.links.forget(link.peer_agent_id):
                continue
            with self._lock:
                cached = self._peers.pop(link.peer_agent_id, None)
            if cached is not None:
                self._drop_channel(cached[1].address)
            log.info("forgot the link to %s: it left the cluster", link.peer_agent_id)

    def _forget_idle_peer_slabs(self, now: float | None = None) -> None:
        """A mapped peer slab keeps the peer's memory alive even after it exits: let go of
        one unused for a while (a handoff still copying holds its own reference)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for agent_id, (_, used) in list(self._peer_slabs.items()):
                if now - used > PEER_SLAB_IDLE_SECONDS:
                    del self._peer_slabs[agent_id]
            for key, until in list(self._shm_refused.items()):
                if now >= until:
                    del self._shm_refused[key]

    def close(self) -> None:
        self._closing = True
        with self._drain_wake:
            self._drain_wake.notify_all()
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._refresher.shutdown(wait=False, cancel_futures=True)
        self.copier.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._peer_slabs.clear()
        for ch in channels:
            ch.close()
        self.engine.close()

    def run_command(self, op_id: str, model_id: str, hashes: list[bytes], peer_agent_id: str, deadline_seconds, reply):
        """A control-plane TRANSFER: hand off in the background, reporting the operation's
        progress through `reply(op_id, state, **OpUpdate fields)`."""

        def beat(done: threading.Event) -> None:
            # a handoff may rightly take longer than the control plane's silence timeout
            # (a long deadline over a slow or limited link): say it is alive meanwhile
            while not done.wait(TRANSFER_HEARTBEAT_SECONDS):
                reply(op_id, "RUNNING", num_total_blocks=len(hashes))

        def run() -> None:
            reply(op_id, "RUNNING", num_total_blocks=len(hashes))
            done = threading.Event()
            threading.Thread(target=beat, args=(done,), name=f"transfer {op_id} beat", daemon=True).start()
            try:
                r = self.handoff(model_id, hashes, peer_agent_id, deadline_seconds)
            except errors.KvcpError as exc:
                reply(op_id, "FAILED", num_total_blocks=len(hashes), num_failed_blocks=len(hashes), error=str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the operation gets its answer whatever went wrong
                log.exception("transfer %s failed", op_id)
                reply(
                    op_id,
                    "FAILED",
                    num_total_blocks=len(hashes),
                    num_failed_blocks=len(hashes),
                    error=f"internal error on the agent ({type(exc).__name__}: {exc}); its log has the trace",
                )
                return
            finally:
                done.set()
            if r.outcome == RECOMPUTE:
                reply(
                    op_id,
                    "FAILED",
                    num_total_blocks=len(hashes),
                    num_failed_blocks=len(hashes),
                    error=f"recompute: {r.reason}",
                )
                return
            missing = len(hashes) - r.num_blocks
            reply(
                op_id,
                "SUCCEEDED",
                num_done_blocks=r.num_blocks,
                num_total_blocks=len(hashes),
                num_failed_blocks=missing,
                moved_bytes=r.sent_bytes,
                error=f"this agent holds only {r.num_blocks} leading blocks of {len(hashes)}" if missing else "",
                result=transfer_result(r),
            )

        threading.Thread(target=run, name=f"transfer {op_id}", daemon=True).start()

    def run_drain(
        self,
        op_id: str,
        model_id: str,
        destinations: list[str],
        free_bytes: list[int],
        deadline_seconds,
        reply,
        fill_limit_bytes: list[int] | None = None,
    ) -> None:
        """A control-plane DRAIN (kvctl drain): hand every prefix held here (of `model_id`,
        or every model) to the destinations, in the background (agent.core.drain says in
        which order and to whom), reporting progress through `reply`; `cancel(op_id)`
        stops it between two prefixes. The blocks stay here too. `fill_limit_bytes`: each
        destination's drop line, which its Reserves hold the drain's blocks to as its tiers
        stand then (none: a control plane that did not say; the room alone holds them)."""
        cancelled = threading.Event()
        with self._lock:
            self._drains[op_id] = cancelled

        def run() -> None:
            try:
                self._drain(
                    op_id, model_id, destinations, free_bytes, deadline_seconds, reply, cancelled, fill_limit_bytes
                )
            except Exception as exc:  # noqa: BLE001 - the operation gets its answer whatever went wrong
                log.exception("drain %s failed", op_id)
                reply(op_id, "FAILED", error=f"internal error on the agent ({type(exc).__name__}: {exc}); see its log")
            finally:
                with self._lock:
                    self._drains.pop(op_id, None)

        threading.Thread(target=run, name=f"drain {op_id}", daemon=True).start()

    def cancel(self, op_id: str) -> bool:
        """Stop a drain between two prefixes (it answers CANCELLED); False: none runs."""
        with self._drain_wake:
            flag = self._drains.get(op_id)
            if flag is not None:
                flag.set()
                self._drain_wake.notify_all()  # one waiting for room stops waiting
        return flag is not None

    def _drain_stopped(self, cancelled: threading.Event, seconds: float) -> bool:
        """Wait up to `seconds`, ending at once on a cancel or close(); True: one came."""
        with self._drain_wake:
            return self._drain_wake.wait_for(lambda: cancelled.is_set() or self._closing, max(0.0, seconds))

    def _drain(
        self, op_id, model_id, destinations, free_bytes, deadline_seconds, reply, cancelled, fill_limit_bytes=None
    ) -> None:
        from agent.drain_run import DrainRun  # (here, not above: it imports this module)

        with self.pool.lock:  # (a copy of the references: the walk runs without the engine's lock)
            held = list(self.pool.blocks.values())
            pinned = frozenset(m.block_hash for m in held if self.pool.pin_tier(m))
        chains = drain_chains(held, model_id, pinned)
        # a destination is charged the pages a block takes in its own slab, not its payload
        # (an int8 block took 18 % more) nor this agent's pages (another --page-size)
        serves, page_bytes = self._destinations_of(destinations)
        own = self.store.footprint

        def footprint(destination: str, num_bytes: int) -> int:
            page = page_bytes.get(destination)  # (an older agent does not say: charged as here)
            return paged_bytes(num_bytes, page) if page else own(num_bytes)

        plan = DrainPlan(list(destinations), list(free_bytes), serves, footprint)
        DrainRun(self, op_id, destinations, chains, plan, fill_limit_bytes, deadline_seconds, reply, cancelled).run()

    def _destinations_of(self, agent_ids) -> tuple[dict[str, frozenset[str]], dict[str, int]]:
        """The models each agent registered and the page of its handoff slab, where its
        record says (a drain sends a chain only to agents serving its model: one that does
        not would fail it, and be given up for the chains of the models it does serve; and
        charges each the pages a block takes there)."""
        models, pages = {}, {}
        for a in agent_ids:
            try:
                peer = self.peer(a)
            except errors.KvcpError:
                continue  # its handoffs say why
            if peer.model_ids is not None:
                models[a] = peer.model_ids
            if peer.page_bytes:
                pages[a] = peer.page_bytes
        return models, pages

    # ---- peers ----------------------------------------------------------------------
    def peer(self, agent_id: str, refresh: bool = False) -> Peer:
        now = time.monotonic()
        with self._lock:
            cached = self._peers.get(agent_id)
        if cached is not None and not refresh and now - cached[0] < PEER_CACHE_SECONDS:
            return cached[1]
        if cached is not None and now - self._etcd_failed_at < PEER_CACHE_SECONDS:
            return cached[1]  # etcd failed a moment ago: no handoff waits out its timeout again
        try:
            info = self._peer_info(agent_id) if self._peer_info is not None else None
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: the last address seen still serves
            self._etcd_failed_at = time.monotonic()
            if cached is None:
                raise errors.Unavailable(f"destination_agent_id: cannot read {agent_id!r} from etcd: {exc}") from exc
            log.debug("etcd unreachable (%s): handing off to %s at its last known address", exc, agent_id)
            return cached[1]
        if info is None:
            # a key gone a moment ago is most often a lease that lapsed in an etcd stall while the
            # agent lives on and registers again: its last address is tried (a dead one answers
            # "recompute" at the handoff's deadline); an agent never seen, or gone longer, is
            # unknown, and forgotten (an etcd outage later must not bring its address back)
            if cached is not None and now - cached[0] < PEER_LAPSE_GRACE_SECONDS:
                return cached[1]
            with self._lock:
                self._peers.pop(agent_id, None)
            raise errors.NotFound(f"destination_agent_id: no agent {agent_id!r} is registered")
        p = Peer(
            agent_id,
            info.address,
            info.transfer_engine,
            info.transfer_endpoint,
            info.shm_path,
            info.shm_host_id,
            info.shm_inode,
            info.transfer_buffer_address,
            info.transfer_buffer_bytes,
            self._cordon_of(agent_id, cached[1] if cached is not None else None),
            frozenset(m.model_id for m in info.models) if info.models else None,
            info.handoff_page_bytes,
        )
        with self._lock:
            self._peers[agent_id] = (now, p)
        return p

    def _cordon_of(self, agent_id: str, known: Peer | None) -> str:
        """Why etcd's policy says the peer is cordoned ("": it is not); read with the peer's
        record, so it is as fresh as the peer's address (PEER_CACHE_SECONDS). A policy that
        cannot be read keeps what was known."""
        if self._cordons is None:
            return ""
        try:
            return self._cordons().get(agent_id, "")
        except Exception as exc:  # noqa: BLE001 - etcd away: the last word stands
            log.debug("cannot read the cordons from etcd (%s)", exc)
            return known.cordoned if known is not None else ""

    def _stub(self, address: str) -> tuple[agent_pb2_grpc.DataPlaneStub, grpc.Channel]:
        """A stub on the peer's channel, which stays open until `_let_go(channel)`: a
        handoff that made it anew (`_drop_channel`) must not close it under another one."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = security.channel(
                    address,
                    self.tls,
                    options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ],
                    token=self.token,
                )
            self._channel_users[ch] = self._channel_users.get(ch, 0) + 1
        return agent_pb2_grpc.DataPlaneStub(ch), ch

    def _let_go(self, ch: grpc.Channel) -> None:
        with self._lock:
            users = self._channel_users[ch] = self._channel_users[ch] - 1
            retired = users == 0 and ch not in self._channels.values()
            if users == 0:
                del self._channel_users[ch]
        if retired:
            self._close_later(ch)

    @staticmethod
    def _close_later(ch: grpc.Channel) -> None:
        """Closed a second later, so an Abort still on it (0.5 s at most) arrives instead of
        being cancelled with the channel."""
        closer = threading.Timer(1.0, ch.close)
        closer.daemon = True
        closer.start()

    def _drop_channel(self, address: str) -> None:
        """Forget a peer's channel: the next attempt makes a new one; this one is closed
        once no handoff uses it."""
        with self._lock:
            ch = self._channels.pop(address, None)
            in_use = ch is not None and self._channel_users.get(ch, 0) > 0
        if ch is not None and not in_use:
            self._close_later(ch)

    # ---- sending --------------------------------------------------------------------
    def handoff(
        self,
        model_id: str,
        block_hashes: list[bytes],
        destination_agent_id: str,
        deadline_seconds: float = 0.0,
        namespace: str = "",
        paths: tuple[str, ...] = (),
        fill_limit_bytes: int = 0,
    ) -> HandoffResult:
        """Send the leading blocks of `block_hashes` held here to the destination; the
        answer comes within the deadline: transferred, present, or recompute (with why).
        Raises InvalidArgument / NotFound for bad input (unknown agent or model, a
        prefix this agent does not hold). `fill_limit_bytes` (a drain's): the destination
        takes the blocks only while its tiers stay within it, else FillLimitReached."""
        if not 0 <= deadline_seconds <= MAX_HANDOFF_DEADLINE_SECONDS:  # also NaN (a huge one overflowed timeouts)
            raise errors.InvalidArgument(
                "deadline_seconds", f"must be in [0, {MAX_HANDOFF_DEADLINE_SECONDS:g}] seconds, got {deadline_seconds}"
            )
        start = time.monotonic()
        deadline = start + (deadline_seconds or self.config.deadline_seconds)
        if model_id not in self.pool.models:
            raise errors.NotFound(f"model_id: this agent serves no model {model_id!r}")
        if destination_agent_id == self.agent_id:
            raise errors.InvalidArgument("destination_agent_id", "is this agent; a handoff goes to another one")
        if namespace:
            check_namespace(namespace, "namespace")
        for p in paths:
            if p not in PATHS:
                raise errors.InvalidArgument("paths", f"unknown path {p!r}; expected {', '.join(PATHS)}")
        peer = self._peer_by(destination_agent_id, deadline)
        if peer.cordoned:  # as the control plane's Transfer and Route: no new work for it
            raise cordoned(destination_agent_id, peer.cordoned)
        metas = self.pool.acquire_chain(block_hashes)
        if not metas:
            raise PrefixNotHeld(
                f"this agent ({self.agent_id}) holds no block of the prefix (first block {block_hashes[0].hex()[:12]})"
                if block_hashes
                else "the prefix has no full block"
            )
        try:
            link, got = self.links.acquire(destination_agent_id, deadline)
            if not got:
                result = HandoffResult(
                    RECOMPUTE,
                    seconds=time.monotonic() - start,
                    reason=f"the link to {destination_agent_id} stayed busy ({link.inflight} transfers) past the deadline",
                )
            else:
                try:
                    result = self._run(
                        peer,
                        model_id,
                        metas,
                        namespace,
                        tuple(paths) or self.config.retry.paths,
                        deadline,
                        fill_limit_bytes,
                    )
                finally:
                    link.release()
        finally:
            self.pool.release_chain(metas)
        result = HandoffResult(**{**result.__dict__, "seconds": time.monotonic() - start})
        if self.metrics is not None:  # a prefix found whole there counts too: a handoff that moved nothing
            secondary = result.outcome == TRANSFERRED and result.path != result.first_path
            self.metrics.record_transfer(
                "handoff",
                result.sent_bytes,
                result.seconds,
                ok=result.outcome in (TRANSFERRED, PRESENT) and not secondary,
                fallback="recompute" if result.outcome == RECOMPUTE else ("secondary_path" if secondary else ""),
            )
        if result.outcome == RECOMPUTE:
            log.warning("handoff to %s: recompute (%s)", destination_agent_id, result.reason)
        return result

    def _run(
        self,
        peer: Peer,
        model_id: str,
        metas: list[BlockMeta],
        namespace: str,
        paths: tuple[str, ...],
        deadline: float,
        fill_limit_bytes: int = 0,
    ) -> HandoffResult:
        policy = self.config.retry
        reasons: list[str] = []
        attempts = 0
        block_size = self.pool.models[model_id].block_size
        skipped: list[str] = []  # said only if nothing else works either
        first_path = ""
        for path in paths:
            if path == SHM and not self._shm_usable(peer):
                where = "offers no shared slab" if not peer.shm_path else "is on another host or cannot be mapped"
                skipped.append(f"shm path skipped: {peer.agent_id} {where}")
                continue
            if path == ENGINE and not self.engine_up:
                reasons.append(f"engine path skipped: {self.engine.status}")
                continue
            if path == ENGINE and not peer.engine:
                reasons.append(f"engine path skipped: {peer.agent_id} has no transfer engine")
                continue
            tries = 0
            first_path = first_path or path
            while tries < policy.attempts_per_path and time.monotonic() < deadline:
                attempts += 1
                link = self.links.get(peer.agent_id)
                t0 = time.monotonic()
                try:
                    num_present, sent, sent_bytes = self._attempt(
                        path, peer, model_id, metas, namespace, deadline, fill_limit_bytes
                    )
                except PathError as exc:
                    if exc.full:  # no room for it there, by any path: not the link's failure
                        raise errors.FillLimitReached(f"{peer.agent_id}: {exc}") from None
                    _note(reasons, f"{path}: {exc}")
                    if exc.busy:  # the destination is behind: queue (wait), do not burn an attempt
                        self._sleep(policy.busy_backoff_seconds * (0.5 + self._rng.random()), deadline)
                        peer = self._still_in_rotation(self._recent(peer, deadline), attempts, reasons)
                        continue
                    link.record(False, 0, time.monotonic() - t0, path)
                    if exc.permanent:
                        return HandoffResult(RECOMPUTE, attempts=attempts, reason="; ".join(reasons))
                    if exc.path_off:  # the next path is a new try: not into one cordoned meanwhile
                        peer = self._still_in_rotation(self._recent(peer, deadline), attempts, reasons)
                        break
                    tries += 1
                    peer = self._still_in_rotation(self._refresh(peer, deadline), attempts, reasons)
                    self._sleep(policy.backoff(tries - 1, self._rng), deadline)
                    continue
                seconds = time.monotonic() - t0
                link.record(True, sent_bytes, seconds, path)
                n = len(metas)
                return HandoffResult(
                    TRANSFERRED if sent else PRESENT,
                    path=path if sent else "",
                    num_blocks=n,
                    num_sent_blocks=sent,
                    sent_bytes=sent_bytes,
                    attempts=attempts,
                    reason="; ".join(reasons),
                    num_cached_tokens=n * block_size,
                    first_path=first_path,
                )
        if time.monotonic() >= deadline:
            reasons.append("deadline passed")
        return HandoffResult(RECOMPUTE, attempts=attempts, reason="; ".join(reasons + skipped) or "no path to try")

    @staticmethod
    def _still_in_rotation(peer: Peer, attempts: int, reasons: list[str]) -> Peer:
        """A peer cordoned since the handoff began gets no more tries (nor the next path):
        the answer is the refusal a handoff begun after the cordon gets, so an engine
        recomputes and a drain goes on to its next destination, not into one taken out of
        rotation. Nothing of the failed tries landed there (each aborted its reservation)."""
        if peer.cordoned:
            since = f" since this handoff began, {attempts} attempt(s) ago ({'; '.join(reasons)})"
            raise cordoned(peer.agent_id, peer.cordoned, since)
        return peer

    def _recent(self, peer: Peer, deadline: float) -> Peer:
        """The peer's record while a busy peer is polled: the cached one while fresh, else
        read again (as `_refresh` without a new channel); etcd not naming it keeps this one
        (a poll of a peer that went away fails on its own)."""
        with self._lock:
            cached = self._peers.get(peer.agent_id)
        if cached is not None and time.monotonic() - cached[0] < PEER_CACHE_SECONDS:
            return cached[1]
        try:
            return self._refresh(peer, deadline, retry=False)
        except errors.KvcpError:
            return peer

    def _peer_by(self, agent_id: str, deadline: float) -> Peer:
        """The peer for a handoff: from the cache while fresh; a stale record is read again
        from etcd within `_refresh`'s bound (the one known serves meanwhile); one never
        seen must be read, by the handoff's deadline (errors name it)."""
        with self._lock:
            cached = self._peers.get(agent_id)
        if cached is not None and time.monotonic() - cached[0] < PEER_CACHE_SECONDS:
            return cached[1]
        if cached is not None:
            return self._refresh(cached[1], deadline, retry=False)
        try:
            return self._read_peer(agent_id).result(timeout=max(0.0, deadline - time.monotonic()))
        except RuntimeError:
            raise errors.Unavailable("this agent is stopping") from None
        except cf.TimeoutError:
            raise errors.Unavailable(
                f"destination_agent_id: etcd did not answer where {agent_id!r} is by the handoff's deadline"
            ) from None

    def _read_peer(self, agent_id: str) -> cf.Future:
        """The peer's record read from etcd in the background (one read per peer at a time);
        the result lands in the cache either way."""
        with self._lock:
            read = self._refreshing.get(agent_id)
            if read is None or read.done():
                read = self._refresher.submit(self.peer, agent_id, True)  # RuntimeError once closed
                self._refreshing[agent_id] = read
        return read

    def _refresh(self, peer: Peer, deadline: float, retry: bool = True) -> Peer:
        """The peer's record read again, waiting for etcd at most half the time left (and
        PEER_REFRESH_WAIT_SECONDS): a stalled etcd must not eat the handoff's deadline; a
        read still under way lands in the cache for later tries. Before a retry (`retry`)
        the channel is made anew and a peer gone from etcd is tried once more at its old
        address (the attempt says what fails); else that is the handoff's error."""
        if retry:
            self._drop_channel(peer.address)
        try:
            read = self._read_peer(peer.agent_id)
        except RuntimeError:  # the agent is stopping
            return peer
        wait = min(PEER_REFRESH_WAIT_SECONDS, max(0.0, deadline - time.monotonic()) / 2)
        try:
            return read.result(timeout=wait)
        except cf.TimeoutError:
            return peer  # etcd is slow: the next attempt goes to the address known
        except errors.KvcpError:
            if not retry:
                raise
            return peer  # gone from etcd too: the next attempt fails fast and says so

    @staticmethod
    def _sleep(seconds: float, deadline: float) -> None:
        time.sleep(max(0.0, min(seconds, deadline - time.monotonic())))

    def _attempt(
        self,
        path: str,
        peer: Peer,
        model_id: str,
        metas: list[BlockMeta],
        namespace: str,
        deadline: float,
        fill_limit_bytes: int = 0,
    ) -> tuple[int, int, int]:
        """One try over one path -> (num_present, blocks sent, bytes sent); raises PathError."""
        stub, channel = self._stub(peer.address)
        try:
            return self._try_path(stub, path, peer, model_id, metas, namespace, deadline, fill_limit_bytes)
        finally:
            self._let_go(channel)

    def _try_path(
        self,
        stub,
        path: str,
        peer: Peer,
        model_id: str,
        metas: list[BlockMeta],
        namespace: str,
        deadline: float,
        fill_limit_bytes: int = 0,
    ) -> tuple[int, int, int]:
        target = self._peer_slab(peer) if path == SHM else None  # mapped before anything is reserved
        rid = uuid.uuid4().hex  # ours: a Reserve that got no answer can still be aborted

        def left(cap: float = self.config.rpc_timeout_seconds) -> float:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PathError("deadline passed")
            return min(remaining, cap)

        try:
            resp = stub.Reserve(
                agent_pb2.ReserveRequest(
                    model_id=model_id,
                    block_hashes=b"".join(m.block_hash for m in metas),
                    stored_bytes=[m.stored_bytes for m in metas],
                    codecs=[m.codec for m in metas],
                    namespace=namespace,
                    # each block keeps its own namespace unless the request names one for all
                    namespaces=[] if namespace else [m.namespace for m in metas],
                    ttl_seconds=max(0.5, deadline - time.monotonic()) + 1.0,
                    source_agent_id=self.agent_id,
                    path=path,
                    writer_pid=os.getpid() if path == SHM else 0,
                    writer_start_ticks=own_start_ticks() if path == SHM else 0,
                    reservation_id=rid,
                    fill_limit_bytes=fill_limit_bytes,
                ),
                timeout=left(),
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # it may have been made there: nothing was written
                self._abort(stub, peer.address, rid, "reserve: no answer in time", True, deadline)
            if path == SHM:
                self._drop_peer_slab(peer.agent_id)
            raise _rpc_error(exc, "reserve") from None
        p = resp.num_present_blocks
        if p >= len(metas):
            return p, 0, 0
        rid = resp.reservation_id or rid
        done = False
        try:
            if path == ENGINE:
                sent_bytes = self._send_engine(stub, peer, resp, metas, deadline, left)
            elif path == SHM:
                assert target is not None  # mapped above for this path
                sent_bytes = self._send_shm(stub, target, peer, resp, metas, deadline, left)
            else:
                sent_bytes = self._send_grpc(stub, peer, rid, metas, p, deadline, left)
            done = True
            return p, len(metas) - p, sent_bytes
        except Stalled as exc:
            self._abort(
                stub, peer.address, rid, str(exc), False, deadline
            )  # a late write may still land: quarantine its pages
            raise PathError(str(exc)) from None
        except grpc.RpcError as exc:
            # a commit that timed out may still run there; a shm copy runs in this thread: it ended
            quiesced = path == SHM or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
            self._abort(stub, peer.address, rid, f"{exc.code().name}", quiesced, deadline)
            raise _rpc_error(exc, "push/commit" if path == GRPC else "commit") from None
        except TransferTimedOut as exc:  # the engine never said it ended: it may still land
            self._abort(stub, peer.address, rid, str(exc), False, deadline)
            raise PathError(str(exc)) from None
        except TransferFailed as exc:
            self._abort(stub, peer.address, rid, str(exc), True, deadline)
            raise PathError(str(exc)) from None
        except PathError as exc:
            self._abort(stub, peer.address, rid, str(exc), True, deadline)
            raise
        except (RuntimeError, cf.CancelledError) as exc:
            if not self._closing:  # a fault on this side (a torch read of the source, say): the
                # engine still gets an answer, and the peer's pages wait out a quarantine
                log.exception("handoff attempt to %s failed on this agent", peer.agent_id)
                self._abort(stub, peer.address, rid, f"sender error: {type(exc).__name__}", False, deadline)
                raise PathError(f"this attempt failed on the sending agent ({type(exc).__name__}: {exc})") from None
            # the agent is stopping: its copy and write threads take no more work
            self._abort(stub, peer.address, rid, "the sending agent is stopping", False, deadline)
            raise PathError(f"this agent is stopping ({exc or type(exc).__name__})", permanent=True) from None
        except OSError as exc:  # reading a source block (disk): nothing of this attempt is in flight
            self._abort(stub, peer.address, rid, f"source read failed: {exc}", True, deadline)
            raise PathError(f"reading the prefix here failed ({exc})") from None
        finally:
            if path == SHM and not done:
                self._drop_peer_slab(peer.agent_id)


def _log_failure(done: cf.Future) -> None:
    """A background task's exception, logged (nobody waits on its future)."""
    if not done.cancelled() and done.exception() is not None:
        log.error("background task failed", exc_info=done.exception())


def _note(reasons: list[str], text: str) -> None:
    """Add a reason; the same one again (a busy peer polled) is counted, not repeated."""
    if reasons and (reasons[-1] == text or reasons[-1].startswith(text + " (x")):
        n = int(reasons[-1].rpartition(" (x")[2].rstrip(")")) + 1 if reasons[-1] != text else 2
        reasons[-1] = f"{text} (x{n})"
    else:
        reasons.append(text)


def _split(packed: bytes, name: str) -> list[bytes]:
    if len(packed) % 16:
        raise errors.InvalidArgument(name, f"length {len(packed)} is not a multiple of 16 bytes")
    return [packed[i : i + 16] for i in range(0, len(packed), 16)]


def etcd_peer_info(etcd):
    """AgentInfo of a peer from its etcd key (None when it is not registered)."""

    def get(agent_id: str) -> types_pb2.AgentInfo | None:
        value, _ = etcd.get(etcd_keys.agent_key(agent_id))
        if value is None:
            return None
        raw = value.decode() if isinstance(value, bytes) else value
        return json_format.Parse(raw, types_pb2.AgentInfo(), ignore_unknown_fields=True)

    return get


def etcd_cordons(etcd):
    """The cordoned agents (id -> reason) named by the policy stored in etcd."""

    def get() -> dict[str, str]:
        value, _ = etcd.get(etcd_keys.POLICY_KEY)
        if value is None:
            return {}
        stored = json.loads(value)
        return etcd_keys.cordoned_agents(stored) if isinstance(stored, dict) else {}

    return get


def result_to_pb(r: HandoffResult) -> agent_pb2.HandoffResponse:
    outcome = {
        TRANSFERRED: agent_pb2.HANDOFF_OUTCOME_TRANSFERRED,
        PRESENT: agent_pb2.HANDOFF_OUTCOME_PRESENT,
        RECOMPUTE: agent_pb2.HANDOFF_OUTCOME_RECOMPUTE,
    }[r.outcome]
    return agent_pb2.HandoffResponse(
        outcome=outcome,
        path=r.path,
        num_blocks=r.num_blocks,
        num_sent_blocks=r.num_sent_blocks,
        sent_bytes=r.sent_bytes,
        elapsed_seconds=r.seconds,
        attempts=r.attempts,
        reason=r.reason,
        num_cached_tokens=r.num_cached_tokens,
    )
