"""How a handoff's bytes go to a peer (part of agent.dataplane.DataPlane): `_send_shm`
(copied into the peer's slab mapped here, verified by the peer in groups), `_send_engine`
(one-sided Transfer Engine writes into the peer's registered slab, batches on the wire
side by side, a bounce buffer for blocks outside registered memory) and `_send_grpc` (the
fallback: a chunked client stream). Each fills a reservation the caller made on the peer
and raises PathError (or Stalled) for the caller's retries; the caller commits.

`HandoffPaths` is mixed into DataPlane, whose state (config, pool, engine, links, copy
threads, mapped peer slabs) it uses (declared below)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import torch

from agent.core.block_moves import pair_runs
from agent.core.blocks import BlockMeta
from agent.core.handoff import (
    LandedGroups,
    RunCursor,
    batches_of,
    checksum,
    slices,
)
from agent.core.tier_store import BlockUnreadable, is_file, is_slab
from agent.store.shm import PeerSlab, host_id
from agent.store.transfer_engine import TransferFailed, TransferTimedOut
from protos.kvcp.v1 import agent_pb2

if TYPE_CHECKING:
    from agent.core.block_pool import BlockPool
    from agent.core.handoff import Links
    from agent.core.tier_store import SlabStore
    from agent.dataplane import DataPlaneConfig
    from agent.store.transfer_engine import TransferBackend

log = logging.getLogger(__name__)

ENGINE_VERIFY_GROUPS = 4  # a handoff's bytes verified in about this many groups while they travel
ENGINE_POLL_SECONDS = 0.0002  # how often the writer asks the engine whether a batch landed
SHM_REFUSED_SECONDS = 60.0  # a peer slab that could not be mapped is not tried again for this long
SHM_VERIFY_GROUPS = 8  # verify groups of a large shm handoff (each group at most 4x shm_verify_group_bytes)
SHM_SLICE_BYTES = 16 << 20  # copies between checks that the reservation is still open
SHM_EXPIRY_MARGIN_SECONDS = 0.5  # no copy this close to the reservation's expiry
ABORT_CALL_SECONDS = 0.5  # an Abort's own timeout (5 s held a handoff to an unanswering peer 9 s)
# an Abort the peer did not answer in time (stalled, or a loaded machine) is sent again in
# the background, this often at most, ABORT_RETRY_SECONDS apart: a lost one held a same-host
# writer's pages for their whole long hold
ABORT_RETRIES = 4
ABORT_RETRY_SECONDS = 1.0
_ABORT_RETRY_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True)
class Peer:
    agent_id: str
    address: str
    engine: str
    endpoint: str
    shm_path: str = ""
    shm_host_id: str = ""
    shm_inode: int = 0
    buffer_address: int = 0
    buffer_bytes: int = 0
    cordoned: str = ""  # why the peer is cordoned (kvctl cordon), "" while it is in rotation
    model_ids: frozenset[str] | None = None  # the models it registered (None: not known)
    page_bytes: int = 0  # the page of the slab its handoffs land in (0: not said, an older agent)

    @property
    def same_host_shm(self) -> bool:
        """Does the peer offer its slab to agents on this host, and is this its host?"""
        return bool(self.shm_path and self.shm_host_id and self.shm_host_id == host_id() and self.buffer_bytes)


class Stalled(Exception):
    """An attempt that cannot end in time (its bytes slower than the stall floor,
    stall_min_bytes_per_second plus 2 s, or the link's bandwidth limit past the deadline):
    given up, its reservation aborted with its pages quarantined (a late write may land)."""


class PathError(Exception):
    """One attempt failed; `permanent` means no other attempt can help; `full`: the
    destination refused blocks past the fill limit the handoff gave (a drain's)."""

    def __init__(
        self, message: str, permanent: bool = False, busy: bool = False, path_off: bool = False, full: bool = False
    ):
        super().__init__(message)
        self.permanent, self.busy, self.path_off, self.full = permanent, busy, path_off, full


class HandoffPaths:
    """The paths of a handoff, mixed into DataPlane (see the module docstring)."""

    # the data plane's state the paths use (agent.dataplane.DataPlane sets it)
    config: DataPlaneConfig
    pool: BlockPool
    store: SlabStore  # the slab handoffs land in and leave from
    engine: TransferBackend
    links: Links
    copier: cf.ThreadPoolExecutor  # threads copying one shm handoff side by side
    _writers: cf.ThreadPoolExecutor  # one engine-writer thread per handoff
    _lock: threading.Lock
    _aborts: set  # Abort calls still on the wire
    aborts_retried_total: int  # Aborts sent again after the peer did not answer in time
    _closing: bool
    _peer_slabs: dict[str, tuple[PeerSlab, float]]  # agent id -> (mapped slab, last used)
    _shm_refused: dict[tuple, float]  # slab key -> monotonic time to try it again
    _stub: Callable[[str], tuple[Any, grpc.Channel]]  # a peer's stub and channel, held until _let_go
    _let_go: Callable[[grpc.Channel], None]

    def _commit_seconds(self, num_bytes: int) -> float:
        """Time for a Commit (or a verify) of `num_bytes`: one RPC's, or hashing them."""
        return max(self.config.rpc_timeout_seconds, 0.1 + num_bytes / 1e9)

    def _drop_peer_slab(self, agent_id: str) -> None:
        """A peer that failed may be gone: do not keep its memory mapped (a handoff still
        copying holds its own reference)."""
        with self._lock:
            self._peer_slabs.pop(agent_id, None)

    def _shm_key(self, peer: Peer) -> tuple:
        return (peer.shm_path, peer.shm_inode, peer.buffer_address, peer.buffer_bytes)

    def _shm_usable(self, peer: Peer) -> bool:
        """Same host, a slab offered, and not refused lately."""
        if not peer.same_host_shm:
            return False
        until = self._shm_refused.get(self._shm_key(peer))
        return until is None or time.monotonic() >= until

    def _peer_slab(self, peer: Peer) -> PeerSlab:
        """The peer's slab mapped here (cached while the peer publishes the same one)."""
        key = self._shm_key(peer)
        now = time.monotonic()
        with self._lock:
            cached = self._peer_slabs.get(peer.agent_id)
            if cached is not None and cached[0].key == key:
                self._peer_slabs[peer.agent_id] = (cached[0], now)
                return cached[0]
        try:
            slab = PeerSlab(*key)
        except (OSError, ValueError) as exc:
            with self._lock:  # another container's /proc, a vanished peer: not every handoff again
                self._shm_refused[key] = now + SHM_REFUSED_SECONDS
            raise PathError(f"cannot map {peer.agent_id}'s slab ({exc})", path_off=True) from None
        with self._lock:
            self._peer_slabs[peer.agent_id] = (slab, now)  # a replaced one goes with its last user
        return slab

    def _send_shm(self, stub, target: PeerSlab, peer: Peer, resp, metas: list[BlockMeta], deadline: float, left) -> int:
        """The blocks copied straight into the reserved pages of the peer's slab (mapped
        here), in groups the peer verifies while the next group is copied (a large
        handoff); the last Commit verifies the rest and makes the prefix visible. Copies go in
        slices, each only while the reservation is open and the deadline ahead (a copy
        after the reservation expired could land on pages given to another block, once
        their quarantine is over); a link with a bandwidth limit is paced as on the
        engine path, in slices of 0.1 s of it."""
        p = resp.num_present_blocks
        slots = list(zip(resp.slots.addresses, resp.slots.lengths, strict=True))
        wanted = sum(m.stored_bytes for m in metas[p:])
        if sum(n for _, n in slots) != wanted:
            raise PathError(f"the peer reserved {sum(n for _, n in slots)} B for {wanted} B of blocks", path_off=True)
        link = self.links.get(peer.agent_id)
        sent = 0
        # the reservation's expiry on this clock (the peer said when, in wall-clock time)
        expires = time.monotonic() + (resp.expires_unix_seconds - time.time()) - SHM_EXPIRY_MARGIN_SECONDS
        slice_bytes = SHM_SLICE_BYTES
        if link.bytes_per_second > 0:
            slice_bytes = min(slice_bytes, max(int(link.bytes_per_second * 0.1), 64 << 10))
        least = self.config.shm_verify_group_bytes  # one Commit costs more than hashing less than this
        group_bytes = min(4 * least, max(least, wanted // SHM_VERIFY_GROUPS))
        groups = [[p + j for j in g] for g in batches_of([m.stored_bytes for m in metas[p:]], group_bytes)]
        dst = RunCursor(slots)
        verifies = []  # the peer hashes each group while the next is copied (its bytes still in cache)
        bounces = []  # blocks outside the CPU slab (disk), read once; alive until copied
        sums: list[int] = []
        try:
            for k, group in enumerate(groups):
                src_runs: list[tuple[int, int]] = []
                for i in group:
                    runs, bounce = self._source_runs(metas[i])
                    if bounce is not None:
                        bounces.append(bounce)
                    src_runs += runs
                group_bytes = sum(metas[i].stored_bytes for i in group)
                pieces = pair_runs(src_runs, dst.take(group_bytes))
                target.check(pieces)
                for part in slices(pieces, slice_bytes):
                    nbytes = sum(n for _, _, n in part)
                    if not link.pace(nbytes, deadline):
                        # no retry on this path: a second try has even less time
                        raise PathError(
                            f"the link's bandwidth limit would pass the deadline for {nbytes} B", path_off=True
                        )
                    if time.monotonic() >= min(deadline, expires):
                        raise PathError("the reservation expires or the deadline passes before the copy ends")
                    sent += target.write(part, self.copier, self.config.shm_copy_threads)
                group_sums = [metas[i].checksum or checksum(self._source(metas[i])[0]) for i in group]
                sums += group_sums
                if k < len(groups) - 1:
                    request = agent_pb2.CommitRequest(
                        reservation_id=resp.reservation_id, checksums=group_sums, first_block=group[0], last=False
                    )
                    # one RPC's time, or what hashing its bytes takes: not the handoff's whole deadline
                    verifies.append(stub.Commit.future(request, timeout=left(self._commit_seconds(group_bytes))))
                _raise_failed(verifies)  # a group the peer refused (a mismatch aborted it all): stop copying
            # every verify answered before the last Commit goes: one the Commit overtook would find
            # the reservation closed, and its 'not open' would hide why the Commit failed (or a
            # verify's mismatch would trail the Commit's 'not open'); the peer hashed the last of
            # them while the last group was copied, so the wait is about a round trip
            for v in verifies:  # each within one RPC's time: a peer that stopped answering is said so
                v.result()
            # the last Commit carries every checksum: it hashes what no verify matched
            request = agent_pb2.CommitRequest(
                reservation_id=resp.reservation_id, checksums=sums, first_block=p, last=True
            )
            stub.Commit(request, timeout=left(self._commit_seconds(wanted)))
        except ValueError as exc:
            raise PathError(str(exc), path_off=True) from None
        finally:
            for v in verifies:
                v.cancel()  # one still under way when the copy stopped early: its answer is not wanted
        return sent

    def _abort(self, stub, address: str, rid: str, reason: str, quiesced: bool, deadline: float) -> None:
        """Tell the peer to let the reservation go, waiting for the answer at most 0.5 s and
        never past the handoff's deadline. The call itself goes on for up to
        ABORT_CALL_SECONDS after that (held here until it ends: a call nobody holds is
        cancelled), so the peer frees the pages now rather than after the reservation's
        TTL and quarantine. One the peer did not answer in time (stalled, or slow on a
        loaded machine) is sent again in the background, up to ABORT_RETRIES times
        ABORT_RETRY_SECONDS apart, each on the peer's channel of the moment, held while
        it is on the wire (a late Abort still frees a same-host writer's pages held past
        its reservation); the handoff never waits for those."""
        request = agent_pb2.AbortRequest(reservation_id=rid, reason=reason[:200], writes_quiesced=quiesced)
        call = self._send_abort(stub, None, address, request, ABORT_RETRIES)
        if call is None:
            return  # the peer is gone or the channel closed: its reservation expires by itself
        try:
            call.result(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        except (grpc.RpcError, grpc.FutureTimeoutError):
            pass  # the peer is gone or slow: sent again in the background, or it expires by itself

    def _send_abort(self, stub, channel, address: str, request: agent_pb2.AbortRequest, retries: int):
        """One Abort call on `stub` (`channel`: the reference taken for it, let go when the
        call ends; None: the caller's own)."""
        try:
            call = stub.Abort.future(request, timeout=ABORT_CALL_SECONDS)
        except (grpc.RpcError, ValueError):  # the peer is gone, or the channel closed (ValueError)
            if channel is not None:
                self._let_go(channel)
            return None
        with self._lock:
            self._aborts.add(call)
        call.add_done_callback(lambda c: self._abort_done(c, channel, address, request, retries))
        return call

    def _retry_abort(self, address: str, request: agent_pb2.AbortRequest, retries: int) -> None:
        if self._closing:
            return
        stub, channel = self._stub(address)  # the channel of the moment (the handoff's may be closed)
        self._send_abort(stub, channel, address, request, retries)

    def _abort_done(self, call, channel, address: str, request: agent_pb2.AbortRequest, retries: int) -> None:
        with self._lock:
            self._aborts.discard(call)
            if not (retries <= 0 or self._closing or call.cancelled() or call.code() not in _ABORT_RETRY_CODES):
                self.aborts_retried_total += 1
            else:
                retries = 0
        if channel is not None:
            self._let_go(channel)
        if retries:
            timer = threading.Timer(ABORT_RETRY_SECONDS, self._retry_abort, (address, request, retries - 1))
            timer.daemon = True
            timer.start()

    def _source(self, meta: BlockMeta) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Segments of a block's stored payload in registered memory; a block elsewhere
        (disk, or a GPU the engine cannot reach) is read into a bounce buffer once."""
        if self._in_slab(meta):
            return self.store.views(meta.handle, meta.stored_bytes), None
        try:
            bounce = self.pool.store_of[meta.tier].read(meta.handle, meta.stored_bytes).contiguous()
        except BlockUnreadable as exc:
            raise self._unreadable(meta, exc) from None
        return [bounce], bounce

    def _source_runs(self, meta: BlockMeta) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        """As _source, as (address, length) runs; no tensors for a block in the slab."""
        if self._in_slab(meta):
            return self.store.byte_runs(meta.handle, meta.stored_bytes), None
        segs, bounce = self._source(meta)
        return [(seg.data_ptr(), seg.numel()) for seg in segs], bounce

    def _batch_sources(self, batch: list[BlockMeta]) -> tuple[list[tuple[int, int]], torch.Tensor | None, dict]:
        """(address, length) runs of a batch's payloads in memory the engine may read: blocks
        in the CPU slab where they lie, the others (disk, the GPU tier) read into one bounce
        buffer for the whole batch, which the caller registers with the engine once (a
        registration per block is a memory registration per block on RDMA). Also the
        bounce's view of each block read into it, by its index in the batch."""
        away = [k for k, m in enumerate(batch) if not self._in_slab(m)]
        bounce = torch.empty(sum(batch[k].stored_bytes for k in away), dtype=torch.uint8) if away else None
        views: dict[int, torch.Tensor] = {}
        at = 0
        for k in away:
            assert bounce is not None
            meta = batch[k]
            views[k] = view = bounce[at : at + meta.stored_bytes]
            at += meta.stored_bytes
            store = self.pool.store_of[meta.tier]
            try:
                if is_slab(store):  # the GPU tier: its pages copied out one run at a time
                    done = 0
                    for seg in store.views(meta.handle, meta.stored_bytes):
                        view[done : done + seg.numel()].copy_(seg)
                        done += seg.numel()
                elif is_file(store):  # straight into the bounce, verified there
                    store.read_into(meta.handle, [view])
                else:
                    view.copy_(store.read(meta.handle, meta.stored_bytes))
            except BlockUnreadable as exc:
                raise self._unreadable(meta, exc) from None
        runs: list[tuple[int, int]] = []
        for k, meta in enumerate(batch):
            if k in views:
                runs.append((views[k].data_ptr(), meta.stored_bytes))
            else:
                runs += self.store.byte_runs(meta.handle, meta.stored_bytes)
        return runs, bounce, views

    def _in_slab(self, meta: BlockMeta) -> bool:
        store = self.pool.store_of[meta.tier]
        return store is self.store and is_slab(store)

    def _unreadable(self, meta: BlockMeta, exc: BlockUnreadable) -> OSError:
        """A source block that failed its read: a miss (removed once released, reported,
        counted), and the handoff's read error."""
        self.pool._mark_corrupt(meta, str(exc))
        return OSError(errno.EIO, str(exc))

    def _write_chain(self, endpoint: str, batches: queue.SimpleQueue, stop: threading.Event) -> None:
        """The engine writes of one handoff, from this one thread: up to `engine_window`
        batches on the wire at once (submitted without waiting, so the engine never waits
        for Python between them), each batch's future set in order once it landed. After
        a failure or `stop` the batches not yet submitted are not written (their futures
        fail); those on the wire are followed to their end."""
        failed: BaseException | None = None
        inflight: collections.deque = collections.deque()  # (PendingWrite, future), oldest first
        ended = False
        while not ended or inflight:
            while not ended and len(inflight) < max(1, self.config.engine_window):
                try:
                    item = batches.get(block=not inflight)  # nothing on the wire: wait for a batch
                except queue.Empty:
                    break
                if item is None:
                    ended = True
                    break
                pieces, fut = item
                if failed is None and stop.is_set():
                    failed = TransferFailed("the handoff stopped before this batch was written")
                if failed is not None:
                    fut.set_exception(failed)
                    continue
                try:
                    inflight.append((self.engine.submit(endpoint, pieces), fut))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting sender
                    failed = exc
                    fut.set_exception(exc)
            while inflight:
                pending, fut = inflight[0]
                try:
                    if not pending.poll():
                        break
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting sender
                    failed = failed or exc
                    fut.set_exception(exc)
                else:
                    fut.set_result(None)
                inflight.popleft()
            if inflight:
                time.sleep(ENGINE_POLL_SECONDS)

    def _send_engine(self, stub, peer: Peer, resp, metas: list[BlockMeta], deadline: float, left) -> int:
        """Engine writes of the blocks in batches of about `chunk_bytes`, back to back from
        one writer thread (the engine never waits for Python between batches); batches that
        have landed are verified by the peer in groups (a Commit that does not close, hashed
        there on background threads) while later ones travel, and the last Commit verifies
        the rest and makes the prefix visible."""
        p = resp.num_present_blocks
        endpoint = resp.transfer_endpoint or peer.endpoint
        rid = resp.reservation_id
        link = self.links.get(peer.agent_id)
        chunk_bytes = self.config.chunk_bytes
        if link.bytes_per_second > 0:  # a limited link is paced chunk by chunk: keep them small
            chunk_bytes = min(chunk_bytes, int(link.bytes_per_second * 0.1))
        chunks = [[p + j for j in b] for b in batches_of([m.stored_bytes for m in metas[p:]], chunk_bytes)]
        verifies: list[grpc.Future] = []
        wanted = sum(m.stored_bytes for m in metas[p:])
        groups = LandedGroups(
            len(chunks),
            self.config.engine_window,
            max(chunk_bytes, min(self.config.engine_verify_group_bytes, wanted // ENGINE_VERIFY_GROUPS)),
            self.config.verify_while_sending,
        )
        try:
            slots = list(zip(resp.slots.addresses, resp.slots.lengths, strict=True))
        except ValueError:
            raise PathError(
                "the peer's reservation gives addresses and lengths that do not pair", path_off=True
            ) from None
        reserved = sum(n for _, n in slots)
        if reserved != wanted:  # (before the writer starts: only the finally below stops it)
            raise PathError(f"the peer reserved {reserved} B for {wanted} B of blocks", path_off=True)
        total = 0
        bounces: list[torch.Tensor] = []
        inflight: list[tuple[int, list[int], cf.Future, int, list[int]]] = []
        futures: list[cf.Future] = []
        batches: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        stalled = False

        def finish(k: int, chunk: list[int], fut: cf.Future, nbytes: int, sums: list[int]) -> None:
            nonlocal total
            budget = nbytes / self.config.stall_min_bytes_per_second + 2.0
            try:
                fut.result(timeout=max(0.0, min(deadline - time.monotonic(), budget)))
            except cf.TimeoutError:
                raise Stalled(
                    f"engine write of {nbytes} B to {peer.agent_id} stalled "
                    f"(no completion in {min(budget, max(0.0, deadline - time.monotonic())):.1f}s)"
                ) from None
            total += nbytes
            last = k == len(chunks) - 1
            _raise_failed(verifies)  # a group the peer refused (a mismatch aborted it all): stop here
            group = groups.landed(k, chunk[0], sums, nbytes, num_pending=sum(not v.done() for v in verifies))
            if group is None:
                return
            first, sums, nbytes = group  # a verify (or the last Commit) of every landed block not verified yet
            request = agent_pb2.CommitRequest(reservation_id=rid, checksums=sums, first_block=first, last=last)
            if not last:  # one RPC's time, or what hashing its bytes takes
                verifies.append(stub.Commit.future(request, timeout=left(self._commit_seconds(nbytes))))
                return
            for v in verifies:  # each within one RPC's time (its own timeout)
                v.result()
            stub.Commit(request, timeout=left(self._commit_seconds(nbytes)))

        dst = RunCursor(slots)
        bounced: dict[int, torch.Tensor] = {}
        self._writers.submit(self._write_chain, endpoint, batches, stop)
        try:
            for k, chunk in enumerate(chunks):
                src_runs, bounce, views = self._batch_sources([metas[i] for i in chunk])
                if bounce is not None:
                    self.engine.register(bounce.data_ptr(), bounce.numel())
                    bounces.append(bounce)
                    bounced.update((chunk[j], view) for j, view in views.items())
                nbytes = sum(metas[i].stored_bytes for i in chunk)
                # one piece per stretch contiguous on both sides: blocks laid out in order
                # on both slabs go as a few large writes, not one per block
                pieces = pair_runs(src_runs, dst.take(nbytes))
                if not link.pace(nbytes, deadline):
                    raise Stalled(f"the link's bandwidth limit would pass the deadline for {nbytes} B")
                fut: cf.Future = cf.Future()
                fut.set_running_or_notify_cancel()
                futures.append(fut)
                batches.put((pieces, fut))
                # the checksum each block carries from when it was made; hashed here only
                # for a block that has none (while the engine writes)
                sums = [
                    metas[i].checksum or checksum([bounced[i]] if i in bounced else self._source(metas[i])[0])
                    for i in chunk
                ]
                inflight.append((k, chunk, fut, nbytes, sums))
                while len(inflight) > 1 and inflight[0][2].done():  # verify what landed meanwhile
                    finish(*inflight.pop(0))
            batches.put(None)
            while inflight:
                finish(*inflight.pop(0))
        except Stalled:
            stalled = True
            raise
        finally:
            stop.set()
            batches.put(None)  # the writer ends after the batches given to it (failing those not begun)
            pending = [f for f in futures if not f.done()]
            if pending and not stalled:
                # an error with writes still on the wire: let them end before the caller
                # calls the reservation quiesced; one that does not end is a stall
                _, still = cf.wait(pending, timeout=max(0.0, min(deadline - time.monotonic(), 5.0)))
                pending = list(still)
            if pending:
                # keep the source pages (and bounces) referenced until the engine lets go
                held = self.pool.acquire_chain([m.block_hash for m in metas])
                self._hold_until_done(pending, held, list(bounces))
                bounces = []
            for b in bounces:
                self.engine.unregister(b.data_ptr())
            if pending and not stalled:
                raise Stalled(f"engine writes to {peer.agent_id} did not end after an error") from None
            if not stalled and any(_may_still_land(f) for f in futures):
                # whatever error came first (another batch's failure, a verify's), a batch
                # the engine gave up on may land later: its pages go to quarantine, not free
                raise Stalled(f"an engine write to {peer.agent_id} timed out and may still land") from None
        return total

    def _hold_until_done(self, futures: list[cf.Future], held: list[BlockMeta], bounces: list[torch.Tensor]) -> None:
        left = [len(futures)]
        lock = threading.Lock()

        def done(_f) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._late_done(held, bounces)

        for f in futures:
            f.add_done_callback(done)

    def _late_done(self, held: list[BlockMeta], bounces: list[torch.Tensor]) -> None:
        self.pool.release_chain(held)
        for b in bounces:
            self.engine.unregister(b.data_ptr())

    def _send_grpc(self, stub, peer: Peer, rid: str, metas: list[BlockMeta], p: int, deadline: float, left) -> int:
        link = self.links.get(peer.agent_id)
        step = self.config.grpc_chunk_bytes
        sums: list[int] = []
        sent = [0]
        paced_out = [False]

        def chunks():
            yield agent_pb2.PushChunk(reservation_id=rid)
            for i in range(p, len(metas)):
                segs, _ = self._source(metas[i])
                sums.append(metas[i].checksum or checksum(segs))
                offset = 0
                for seg in segs:
                    for start in range(0, seg.numel(), step):
                        piece = seg[start : start + step]
                        if not link.pace(piece.numel(), deadline):
                            paced_out[0] = True
                            return
                        yield agent_pb2.PushChunk(block_index=i, offset=offset, data=piece.numpy().tobytes())
                        offset += piece.numel()
                        sent[0] += piece.numel()

        stub.Push(chunks(), timeout=max(0.01, deadline - time.monotonic()))
        if paced_out[0]:
            raise PathError("the link's bandwidth limit would pass the deadline", path_off=True)
        stub.Commit(
            agent_pb2.CommitRequest(reservation_id=rid, checksums=sums, first_block=p, last=True),
            timeout=left(self._commit_seconds(sent[0])),
        )
        return sent[0]


def _may_still_land(fut: cf.Future) -> bool:
    """A batch's future that ended with the engine not saying the write ended."""
    return fut.done() and not fut.cancelled() and isinstance(fut.exception(), TransferTimedOut)


def _raise_failed(calls: list, wait_seconds: float = 0.0) -> None:
    """Raise the error of the first of these calls that failed (waiting up to
    `wait_seconds` in all for those not finished yet)."""
    until = time.monotonic() + wait_seconds
    for call in calls:
        try:
            exc = call.exception(timeout=max(0.0, until - time.monotonic()))
        except (grpc.FutureTimeoutError, grpc.FutureCancelledError):
            continue
        if exc is not None:
            raise exc
