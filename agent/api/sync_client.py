"""The agent's link to the control plane: Register, then one Sync stream carrying the
full inventory first and sequence-numbered event batches after; the control plane can
ask for a resync at any time. On any failure the link backs off and starts over (a new
stream always begins with a full inventory), while the engine keeps being served."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.journal import STORED
from agent.core.mover import FAILED, PENDING, SUCCEEDED, TERMINAL, MoveOp, Mover
from agent.core.pins import AgentPin
from agent.core.vllm_events import ExternalBlocks
from protos.block_hash import split_hashes
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2
from protos.pb_enums import tier_pb
from protos.security import TLSConfig, token_metadata
from protos.security import channel as secure_channel
from protos.tier import Tier

if TYPE_CHECKING:
    from agent.dataplane import DataPlane

log = logging.getLogger(__name__)

INVENTORY_CHUNK_BLOCKS = 65536
LEADER_CHECK_SECONDS = 1.0
# pings on an idle stream so a paused or vanished control plane is noticed in seconds
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a command may carry hundreds of thousands of hashes (a policy pass over a big tier):
    # take what the control plane may send (its MAX_MESSAGE_BYTES), not gRPC's 4 MiB
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
# an operation queued behind another says so this often: the control plane fails an
# operation it has heard nothing of for a minute
QUEUED_OP_PING_SECONDS = 10.0
# the last word on an operation (SUCCEEDED / FAILED / CANCELLED) is sent again on every new
# stream while it is this recent (at most this many): an update yielded to a stream that
# then broke, or dropped from a full outbox, would leave the control plane to fail an
# operation that ran (a repeat of a final update changes nothing there)
RESEND_FINAL_SECONDS = 600.0
RESEND_FINAL_MAX = 1024
# the control plane sends a command again when the stream it went down closed before the
# agent answered (it may have come through all the same): the op ids of the latest commands
# of these kinds are kept, and a repeat is answered with what the agent knows, never run
# twice. Far more than could arrive between a command and the agent's first answer.
RUN_ONCE_KINDS = frozenset(
    {
        agent_pb2.COMMAND_KIND_MOVE,
        agent_pb2.COMMAND_KIND_COMPRESS,
        agent_pb2.COMMAND_KIND_CLEANUP,
        agent_pb2.COMMAND_KIND_TRANSFER,
        agent_pb2.COMMAND_KIND_DRAIN,
    }
)
ACCEPTED_OPS_MAX = 65536


def op_update_pb(op: MoveOp) -> agent_pb2.AgentMessage:
    return agent_pb2.AgentMessage(
        op_update=agent_pb2.OpUpdate(
            op_id=op.op_id,
            state=op.state,
            num_done_blocks=op.num_done_blocks,
            num_total_blocks=op.num_total_blocks,
            num_failed_blocks=op.num_failed_blocks,
            moved_bytes=op.moved_bytes,
            error=op.error,
            num_skipped_pinned_blocks=len(op.pinned),
            pinned_block_hashes=b"".join(h for h, _ in op.pinned),
            pinned_tiers=[t for _, t in op.pinned],
        )
    )


def tier_usage_pb(pool: BlockPool) -> list[types_pb2.TierUsage]:
    return [
        types_pb2.TierUsage(
            tier=tier_pb(u.tier),
            capacity_bytes=u.capacity_bytes,
            used_bytes=u.used_bytes,
            num_blocks=u.num_blocks,
            uncompressed_bytes=u.uncompressed_bytes,
            stored_bytes=u.stored_bytes,
            num_parked_blocks=u.num_parked_blocks,
            blocks_used_bytes=u.blocks_used_bytes,
        )
        for u in pool.usage()
    ]


class ControlPlaneLink:
    def __init__(
        self,
        agent_info: Callable[[], types_pb2.AgentInfo],
        pool: BlockPool,
        engine: KVEngineAPI,
        controlplane_address: Callable[[], str],
        stats_interval_seconds: float = 1.0,
        mover: Mover | None = None,
    ):
        self._agent_info = agent_info
        self._pool = pool
        self._engine = engine
        self._address = controlplane_address
        self.stats_interval_seconds = stats_interval_seconds
        self._mover = mover
        if mover is not None:
            mover.on_update = self._on_op_update
        self._outbox: queue.Queue[agent_pb2.AgentMessage] = queue.Queue(maxsize=10_000)
        self._final: OrderedDict[str, tuple[float, agent_pb2.AgentMessage]] = OrderedDict()
        self._final_lock = threading.Lock()
        # op ids of the RUN_ONCE_KINDS commands this process took, oldest first (handle_command's thread only)
        self._accepted: OrderedDict[str, None] = OrderedDict()
        self.repeated_commands_total = 0
        self._cleanups_running: set[str] = set()  # op ids of cleanups this agent is running (pinged RUNNING)
        self.highest_epoch = 0
        # () -> (address, epoch) etcd names as leader; lets a lower epoch through when etcd
        # itself says so (etcd was reset: its revisions started again)
        self.etcd_leader: Callable[[], tuple[str, int]] | None = None
        self.rejected_commands_total = 0
        self.etcd_resets_total = 0
        self._leader_checks = cf.ThreadPoolExecutor(1, thread_name_prefix="leader-check")
        self.session_id = uuid.uuid4().hex
        self.incarnation = uuid.uuid4().hex  # this process: a restart is another one
        self._resync = threading.Event()
        self._reconnect = threading.Event()
        self.connected = threading.Event()
        self._connected_to = ""
        self.token = ""  # agent token the control plane asks for (never logged)
        self.tls: TLSConfig | None = None  # for the control-plane channel
        # called after a pin or unpin command changed the pin table
        self.on_pins_changed: Callable[[], None] | None = None
        self.epoch = 0
        self.connections_total = 0
        self.resyncs_total = 0
        # blocks the engine holds and reports itself (agent.core.vllm_events.ExternalBlocks)
        self.external: ExternalBlocks | None = None
        self.dataplane: DataPlane | None = None  # runs TRANSFER commands, reports link stats

    def _on_op_update(self, op: MoveOp) -> None:
        if op.kind == "promote":
            return  # engine-driven, local: only its block events go up
        self._send(op_update_pb(op))

    def _send(self, msg: agent_pb2.AgentMessage) -> None:
        if msg.WhichOneof("body") == "op_update" and msg.op_update.state in TERMINAL:
            with self._final_lock:
                self._final[msg.op_update.op_id] = (time.monotonic(), msg)
                self._final.move_to_end(msg.op_update.op_id)
                while len(self._final) > RESEND_FINAL_MAX:
                    self._final.popitem(last=False)
        try:
            self._outbox.put_nowait(msg)
            self._pool.journal.wake.set()
        except queue.Full:
            log.warning("control-plane outbox full; dropping a %s", msg.WhichOneof("body"))

    def _reply(self, op_id: str, state: str, **fields) -> None:
        self._send(agent_pb2.AgentMessage(op_update=agent_pb2.OpUpdate(op_id=op_id, state=state, **fields)))

    def raise_to_pin(self, namespace: str, tier: int) -> None:
        """A namespace pin's blocks held slower than its tier go up to it (in the background,
        parents first). The control plane does this for prefix pins, whose blocks it knows;
        a namespace's blocks only the agent knows."""
        below = [h for h in self._pool.blocks_matching(namespace) if int(self._pool.tier_of(h) or 0) > tier]
        if below and self._mover is not None and tier in self._pool.store_of:
            self._mover.submit(below, Tier(tier), kind="promote")

    def _pins_changed(self) -> None:
        if self.on_pins_changed is not None:
            try:
                self.on_pins_changed()
            except OSError as exc:  # the pin stands in memory; the control plane re-sends after a restart
                log.warning("could not save the pin table: %s", exc)

    def handle_command(self, epoch: int, cmd: agent_pb2.Command) -> None:
        """Execute a leader's command; commands of an older epoch are rejected (fencing)."""
        if epoch < self.highest_epoch and not self._etcd_was_reset(self._connected_to, epoch):
            self.rejected_commands_total += 1
            log.warning("rejecting command %s from epoch %d (newest seen %d)", cmd.op_id, epoch, self.highest_epoch)
            self._reply(cmd.op_id, FAILED, error=f"stale epoch {epoch} < {self.highest_epoch}")
            return
        self.highest_epoch = epoch
        kind = cmd.kind
        if kind in RUN_ONCE_KINDS:
            if cmd.op_id in self._accepted:
                self._answer_again(cmd.op_id)
                return
            self._accepted[cmd.op_id] = None
            while len(self._accepted) > ACCEPTED_OPS_MAX:
                self._accepted.popitem(last=False)
        try:
            hashes = split_hashes(cmd.block_hashes)
        except ValueError as exc:
            self._reply(cmd.op_id, FAILED, error=str(exc))
            return
        tier = Tier(cmd.tier) if cmd.tier in (t.value for t in Tier) else None
        only_tier = Tier(cmd.only_tier) if cmd.only_tier in (t.value for t in Tier) else None
        pool = self._pool
        scoped = kind in (agent_pb2.COMMAND_KIND_MOVE, agent_pb2.COMMAND_KIND_COMPRESS, agent_pb2.COMMAND_KIND_EVICT)
        by_namespace = scoped and not hashes
        if by_namespace:  # parents before children
            hashes = pool.blocks_matching(cmd.namespace, cmd.model_id, only_tier)
        elif scoped and only_tier is not None:  # a prefix scope: only its blocks in that tier
            hashes = [h for h in hashes if pool.tier_of(h) == only_tier]
        if kind in (agent_pb2.COMMAND_KIND_MOVE, agent_pb2.COMMAND_KIND_COMPRESS):
            if self._mover is None or (kind == agent_pb2.COMMAND_KIND_MOVE and tier is None):
                self._reply(cmd.op_id, FAILED, error="move needs a tier this agent has")
                return
            is_move = kind == agent_pb2.COMMAND_KIND_MOVE
            self._mover.submit(
                hashes,
                tier if is_move else None,
                cmd.codec or None,
                kind="move" if is_move else "compress",
                op_id=cmd.op_id,
            )
        elif kind == agent_pb2.COMMAND_KIND_CANCEL:
            # a drain answers CANCELLED between two prefixes; moves and compressions in the mover
            drain = self.dataplane is not None and self.dataplane.cancel(cmd.op_id)
            if not drain and self._mover is not None:
                self._mover.cancel(cmd.op_id)
        elif kind == agent_pb2.COMMAND_KIND_EVICT:
            done, pinned = 0, []
            # leaves first: a policy's evictions come children first; a namespace's parents first
            for h in reversed(hashes) if by_namespace else hashes:
                if pool.drop(h):
                    done += 1
                elif pin_tier := pool.pin_tier_of(h):
                    pinned.append((h, pin_tier))
            self._reply(
                cmd.op_id,
                SUCCEEDED,
                num_done_blocks=done,
                num_total_blocks=len(hashes),
                num_failed_blocks=len(hashes) - done,
                pinned_block_hashes=b"".join(h for h, _ in pinned),
                pinned_tiers=[t for _, t in pinned],
            )
        elif kind == agent_pb2.COMMAND_KIND_PIN:
            with pool.lock:
                # counted on this agent's monotonic clock from the time left when sent (a
                # control plane of an older version sends only its absolute expiry)
                if cmd.ttl_seconds > 0:
                    expires = pool.pins.clock() + cmd.ttl_seconds
                elif cmd.expires_unix_seconds:
                    expires = max(pool.pins.clock() + (cmd.expires_unix_seconds - time.time()), 1e-9)
                else:
                    expires = 0.0  # until unpinned (an owner lease bounds it)
                pool.pins.add(
                    AgentPin(
                        cmd.pin_id, int(tier or Tier.CPU), expires, cmd.namespace, frozenset(hashes), cmd.pin_version
                    )
                )
            self._pins_changed()
            if not hashes and cmd.namespace:
                self.raise_to_pin(cmd.namespace, int(tier or Tier.CPU))
            self._reply(cmd.op_id, SUCCEEDED, num_done_blocks=len(hashes), num_total_blocks=len(hashes))
        elif kind == agent_pb2.COMMAND_KIND_UNPIN:
            with pool.lock:
                pool.pins.remove(cmd.pin_id)
            self._pins_changed()
            self._reply(cmd.op_id, SUCCEEDED)
        elif kind == agent_pb2.COMMAND_KIND_CLEANUP:
            self._cleanups_running.add(cmd.op_id)  # said RUNNING by the pings while it runs
            try:
                result = pool.cleanup(cmd.older_than_seconds, cmd.namespace or None, cmd.model_id, cmd.dry_run)
                if not cmd.dry_run:
                    pool.record_frees()  # in the disk's dead log before SUCCEEDED: a crash then keeps them gone
            finally:
                self._cleanups_running.discard(cmd.op_id)
            self._reply(
                cmd.op_id,
                SUCCEEDED,
                num_done_blocks=result.num_blocks,
                num_total_blocks=result.num_blocks,
                num_skipped_pinned_blocks=result.num_skipped_pinned_blocks,
                freed=[
                    types_pb2.TierUsage(tier=tier_pb(t), num_blocks=n, used_bytes=b)
                    for t, (n, b) in result.freed.items()
                ],
            )
        elif kind == agent_pb2.COMMAND_KIND_TRANSFER and self.dataplane is not None:
            self.dataplane.run_command(
                cmd.op_id, cmd.model_id, hashes, cmd.peer_agent_id, cmd.deadline_seconds, self._reply
            )
        elif kind == agent_pb2.COMMAND_KIND_DRAIN and self.dataplane is not None:
            self.dataplane.run_drain(
                cmd.op_id,
                cmd.model_id,
                list(cmd.peer_agent_ids),
                list(cmd.peer_free_bytes),
                cmd.deadline_seconds,
                self._reply,
                list(cmd.peer_fill_limit_bytes),
            )
        else:
            self._reply(cmd.op_id, FAILED, error=f"unknown command kind {kind}")

    def _answer_again(self, op_id: str) -> None:
        """A command for an operation this agent has already: its final answer again, or
        where it stands (a move or compression in the mover); a transfer or drain still
        running reports on its own. Nothing runs a second time."""
        self.repeated_commands_total += 1
        with self._final_lock:
            final = self._final.get(op_id)
        op = self._mover.get(op_id) if final is None and self._mover is not None else None
        log.info("command for operation %s came again; answered, not run again", op_id)
        if final is not None:
            self._send(final[1])
        elif op is not None:
            self._send(op_update_pb(op))

    def request_reconnect(self) -> None:
        self._reconnect.set()
        self._pool.journal.wake.set()

    # ---- messages -------------------------------------------------------------------
    def _inventory_messages(self, generation: list[int] | None = None):
        """The inventory as chunks; `generation[0]` is set to its journal generation (the
        events after it are that stream's to send)."""
        with self._pool.lock:  # the engine's external blocks (vLLM events) share the pool's journal
            seq, groups = self._pool.inventory()
            if generation is not None:
                generation[0] = self._pool.journal.generation
            if self.external is not None:
                groups = list(groups) + self.external.inventory_groups()
        chunk: list[agent_pb2.BlockGroup] = []
        size = 0
        index = 0
        for g in groups:
            n = len(g.block_hashes) // 16
            for start in range(0, n, INVENTORY_CHUNK_BLOCKS):
                end = min(n, start + INVENTORY_CHUNK_BLOCKS)
                chunk.append(
                    agent_pb2.BlockGroup(
                        model_id=g.model_id,
                        tier=tier_pb(g.tier),
                        block_hashes=g.block_hashes[start * 16 : end * 16],
                        parent_hashes=g.parent_hashes[start * 16 : end * 16],
                    )
                )
                size += end - start
                if size >= INVENTORY_CHUNK_BLOCKS:
                    yield agent_pb2.AgentMessage(
                        inventory=agent_pb2.Inventory(seq=seq, chunk_index=index, groups=chunk)
                    )
                    chunk, size, index = [], 0, index + 1
        yield agent_pb2.AgentMessage(
            inventory=agent_pb2.Inventory(seq=seq, chunk_index=index, last_chunk=True, groups=chunk)
        )

    def _stats_message(self) -> agent_pb2.AgentMessage:
        e = self._engine
        with self._pool.lock:  # movers add to it
            moved_bytes = sum((getattr(self._pool, "moved_bytes_total", None) or {}).values())
        return agent_pb2.AgentMessage(
            stats=agent_pb2.AgentStats(
                tiers=tier_usage_pb(self._pool),
                namespaces=[
                    agent_pb2.NamespaceUsage(namespace=ns, num_blocks=n, uncompressed_bytes=b)
                    for ns, (n, b) in self._pool.namespace_usage().items()
                ],
                lookups_total=e.lookups_total,
                lookup_tokens_total=e.lookup_tokens_total,
                lookup_hit_tokens_total=e.lookup_hit_tokens_total,
                dataplane=self.dataplane.stats() if self.dataplane is not None else None,
                tier_moved_bytes_total=moved_bytes,
            )
        )

    def _outgoing(self, stop: threading.Event, done: threading.Event, finished: threading.Event | None = None):
        """The stream's messages; `finished` is set when this stream has no more (its
        call is then cancelled: a stream's own event, so a replaced stream ending late
        never cancels the call of the one that replaced it)."""
        agent_id = self._agent_info().agent_id
        with self._pool.lock:
            self._pool.pins.expire()  # the control plane re-sends what still holds
            held = [agent_pb2.HeldPin(pin_id=p.pin_id, version=p.version) for p in self._pool.pins.pins.values()]
        yield agent_pb2.AgentMessage(
            hello=agent_pb2.Hello(
                agent_id=agent_id,
                session_id=self.session_id,
                pins=held,
                incarnation=self.incarnation,
                runs_commands_once=True,  # (RUN_ONCE_KINDS: a repeat is answered, not run)
            )
        )
        # a stream replaced by a new one (its call dead) may run on a moment, past its loop's
        # check: it drains nothing once the new stream's inventory was taken, so no batch
        # after that inventory is lost with it (the new stream sends them)
        generation = [0]
        yield from self._inventory_messages(generation)
        yield from self._recent_final_updates()
        yield self._stats_message()
        next_stats = time.monotonic() + self.stats_interval_seconds
        next_queued_ping = time.monotonic() + QUEUED_OP_PING_SECONDS
        next_leader_check = time.monotonic() + LEADER_CHECK_SECONDS
        wake = self._pool.journal.wake
        moved: cf.Future | None = None  # the leader check in flight (it reads etcd)
        while not (stop.is_set() or done.is_set() or self._reconnect.is_set()):
            if generation[0] != self._pool.journal.generation:
                break  # a newer stream's inventory: this one is replaced (nor may it take a resync's)
            # etcd is read off this loop: a slow or unreachable etcd (each read waits for
            # its timeout) held back the block events behind it, and lookups went stale
            if moved is not None and moved.done():
                if moved.result():
                    break
                moved = None
            if moved is None and time.monotonic() >= next_leader_check:
                next_leader_check = time.monotonic() + LEADER_CHECK_SECONDS
                try:
                    moved = self._leader_checks.submit(self._leader_moved)
                except RuntimeError:  # the link is stopping (its pool shut down): so is this stream
                    break
            if self._resync.is_set():
                self._resync.clear()
                self.resyncs_total += 1
                yield from self._inventory_messages(generation)
                continue
            for batch in self._pool.drain_events(generation=generation[0]):
                kind = agent_pb2.BLOCK_EVENT_KIND_STORED if batch.kind == STORED else agent_pb2.BLOCK_EVENT_KIND_REMOVED
                yield agent_pb2.AgentMessage(
                    events=agent_pb2.BlockEventBatch(
                        seq=batch.seq,
                        kind=kind,
                        groups=[
                            agent_pb2.BlockGroup(
                                model_id=g.model_id,
                                tier=tier_pb(g.tier),
                                block_hashes=bytes(g.block_hashes),
                                parent_hashes=bytes(g.parent_hashes),
                            )
                            for g in batch.groups
                        ],
                    )
                )
            for notice in self._pool.drain_notices():
                yield agent_pb2.AgentMessage(
                    notice=agent_pb2.Notice(kind=notice.kind, message=notice.message, unix_seconds=notice.unix_seconds)
                )
            while True:
                try:
                    yield self._outbox.get_nowait()
                except queue.Empty:
                    break
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + self.stats_interval_seconds
                yield self._stats_message()
            if now >= next_queued_ping:
                next_queued_ping = now + QUEUED_OP_PING_SECONDS
                yield from self._queued_op_pings()
            wake.wait(min(0.05, max(next_stats - now, 0.001)))
        if finished is not None:
            finished.set()

    def _recent_final_updates(self) -> list[agent_pb2.AgentMessage]:
        """The final updates of the last RESEND_FINAL_SECONDS, oldest first."""
        horizon = time.monotonic() - RESEND_FINAL_SECONDS
        with self._final_lock:
            while self._final and next(iter(self._final.values()))[0] < horizon:
                self._final.popitem(last=False)
            return [msg for _, msg in self._final.values()]

    def _queued_op_pings(self):
        """A PENDING update for each control-plane operation still queued behind another,
        and a RUNNING one for a cleanup still under way: the control plane would otherwise
        fail it for silence (and let the next cleanup of its scope in), then see it run."""
        for op_id in list(self._cleanups_running):
            yield agent_pb2.AgentMessage(op_update=agent_pb2.OpUpdate(op_id=op_id, state="RUNNING"))
        if self._mover is None:
            return
        for op in self._mover.ops():
            if op.state == PENDING and op.kind != "promote":
                yield op_update_pb(op)

    def _leader_moved(self) -> bool:
        """True when etcd names another leader than the one we stream to (a failover
        we would otherwise only notice when the old leader's stream breaks)."""
        try:
            now = self._address()
        except Exception as exc:  # noqa: BLE001 - etcd away: keep the stream we have
            log.debug("reading the leader key from etcd failed: %s", exc, exc_info=True)
            return False
        if now and now != self._connected_to:
            log.info("leader moved from %s to %s; reconnecting", self._connected_to, now)
            return True
        return False

    def _etcd_was_reset(self, address: str, epoch: int) -> bool:
        """A leader whose epoch is below one seen before is deposed, unless etcd names it
        now with that very epoch: within one etcd history a newer leader's key always has
        a higher create revision, so etcd lost its data (restored from an old snapshot,
        or a new empty etcd) and the epochs started again. The fence starts again too."""
        if self.etcd_leader is None:
            return False
        try:
            named, named_epoch = self.etcd_leader()
        except Exception as exc:  # noqa: BLE001 - etcd away: keep the fence
            log.debug("reading the leader key from etcd failed: %s", exc, exc_info=True)
            return False
        if named != address or named_epoch != epoch:
            return False
        log.warning(
            "etcd names %s leader with epoch %d, below the %d seen before: etcd's history was reset "
            "(data lost or restored); following it",
            address,
            epoch,
            self.highest_epoch,
        )
        self.etcd_resets_total += 1
        return True

    # ---- connection loop ------------------------------------------------------------
    def run_once(self, stop: threading.Event) -> None:
        """Connect, register and stream until the stream breaks or `stop` is set."""
        address = self._address()
        if not address:
            raise ConnectionError("no control-plane leader known yet")
        with secure_channel(address, self.tls, options=KEEPALIVE_OPTIONS) as channel:
            self._connected_to = address
            stub = agent_pb2_grpc.AgentServiceStub(channel)
            auth = token_metadata(self.token)
            reply = stub.Register(agent_pb2.RegisterRequest(agent=self._agent_info()), timeout=5, metadata=auth)
            self.epoch = reply.epoch
            if reply.epoch < self.highest_epoch and not self._etcd_was_reset(address, reply.epoch):
                raise ConnectionError(
                    f"control plane at {address} has epoch {reply.epoch} < {self.highest_epoch}: a deposed leader"
                )
            self.highest_epoch = reply.epoch
            self._reconnect.clear()
            self._resync.clear()
            # every stream is its own session: the control plane tells a late teardown or
            # a late message of the previous stream from this one by it
            self.session_id = uuid.uuid4().hex
            done, finished = threading.Event(), threading.Event()
            self.connections_total += 1
            log.info("connected to control plane %s (epoch %d)", address, reply.epoch)
            self.connected.set()
            call = stub.Sync(self._outgoing(stop, done, finished), metadata=auth)
            # when our side is done (reconnect, leader moved, stop), cancel the call: a
            # paused or dead leader would otherwise keep the response side open forever
            watchdog = threading.Thread(target=self._cancel_when_done, args=(call, done, stop, finished), daemon=True)
            watchdog.start()
            try:
                for msg in call:
                    body = msg.WhichOneof("body")
                    if body == "resync":
                        log.info("control plane asks for a resync: %s", msg.resync.reason)
                        self._resync.set()
                        self._pool.journal.wake.set()
                    elif body == "command":
                        self.handle_command(msg.epoch, msg.command)
            finally:
                done.set()
                self.connected.clear()

    def _cancel_when_done(self, call, done: threading.Event, stop: threading.Event, finished: threading.Event) -> None:
        while not done.wait(0.1):
            if stop.is_set() or self._reconnect.is_set() or finished.is_set():
                call.cancel()
                return

    def run_forever(self, stop: threading.Event) -> None:
        backoff = 0.2
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.run_once(stop)
            except grpc.RpcError as exc:
                if not stop.is_set():
                    log.warning("control-plane link down: %s %s", exc.code(), exc.details())
            except Exception as exc:  # noqa: BLE001 - keep retrying; the engine is still served
                if not stop.is_set():
                    log.warning("control-plane link down: %s", exc)
            if time.monotonic() - started > 5:
                backoff = 0.2
            stop.wait(backoff)
            backoff = min(backoff * 2, 5.0)
        self._leader_checks.shutdown(wait=False)  # a check stuck on etcd ends with its call's timeout
