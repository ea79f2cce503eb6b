"""AgentService servicer: Register and the Sync stream (agent -> control plane)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from controlplane.api import convert
from controlplane.core.cluster import AgentCommand, Cluster
from protos import errors
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

FINAL_OP_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class _Applier:
    """One thread applies every stream's hello, inventory chunks and event batches, in the
    order each stream's reader hands them over (one FIFO). Readers do not wait for their
    message: they go on decoding the next while this thread applies, and only block when
    the bounded queue is full, which stops them reading and so pushes back through gRPC's
    flow control. A reply (resync) or an error goes to the stream's outbox; after an error
    the stream's later messages are dropped, as a reader that applied them itself would
    have stopped. With 64 streams the cluster lock has two contenders, this thread and the
    lookups, instead of 65, and a lookup waits for at most one batch."""

    def __init__(self, max_pending: int = 64) -> None:
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, session: dict, fn, *args) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="sync-applier", daemon=True)
                    self._thread.start()
        self._queue.put((session, fn, args))

    def wait_idle(self, session: dict) -> None:
        """Block until everything this stream submitted has been applied."""
        done = threading.Event()
        self.submit(session, None, done)
        done.wait()

    def _loop(self) -> None:
        while True:
            session, fn, args = self._queue.get()
            if fn is None:  # a wait_idle marker
                args[0].set()
                continue
            if session.get("failed"):
                continue
            try:
                reply = fn(*args)
            except errors.KvcpError as exc:
                session["failed"] = True
                session["outbox"].put(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - our bug, not the peer's: INTERNAL, logged
                log.exception("applying a sync message failed")
                session["failed"] = True
                session["outbox"].put(exc)
                continue
            if reply is not None:
                session["outbox"].put(reply)


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, cluster: Cluster, leadership, agent_key_exists=None, on_op_update=None, clock=time.time):
        self._cluster = cluster
        self._clock = clock  # the manager's: a pin's time left is taken on the clock its expiry was set by
        self._applier = _Applier()  # index updates of every stream, applied by one thread
        self._leadership = leadership
        # callable(agent_id, OpUpdate message): operation progress from agents
        self._on_op_update = on_op_update
        # callable(agent_id) -> bool; None skips the check (in-memory tests)
        self._agent_key_exists = agent_key_exists

    def _require_leader(self) -> None:
        if not self._leadership.is_leader:
            raise errors.not_leader(self._leadership.leader_address, getattr(self._leadership, "refusal", ""))

    def Register(self, request, context):
        self._require_leader()
        info = request.agent
        if not info.agent_id:
            raise errors.InvalidArgument("agent.agent_id", "must not be empty")
        if self._agent_key_exists is not None and not self._agent_key_exists(info.agent_id):
            raise errors.FailedPrecondition(
                f"agent {info.agent_id!r} has no key in etcd; register it under a lease first"
            )
        self._cluster.register(convert.agent_record_from_pb(info))
        self._cluster.dataplane.register(info.agent_id, info.role, info.transfer_engine)
        log.info("agent %s registered from %s", info.agent_id, info.address)
        return agent_pb2.RegisterResponse(epoch=self._leadership.epoch, leader_address=self._leadership.leader_address)

    def Sync(self, request_iterator, context):
        self._require_leader()
        outbox: queue.Queue = queue.Queue()
        # agent_id and session_id (str, from its Hello), outbox, and "failed" once a reply failed
        session: dict[str, Any] = {"agent_id": "", "session_id": "", "outbox": outbox}
        epoch = self._leadership.epoch

        def read() -> None:
            try:
                for msg in request_iterator:
                    if session.get("failed"):
                        return
                    kind = msg.WhichOneof("body")
                    if kind in ("hello", "events", "inventory"):
                        self._applier.submit(session, self._handle, msg, session, epoch)
                        if kind == "hello":
                            self._applier.wait_idle(session)  # what follows needs the session
                        continue
                    if kind == "op_update" and msg.op_update.state in FINAL_OP_STATES:
                        # the block events the agent sent before it are in the index first: a
                        # policy pass that sees the command answered must see what it did
                        self._applier.wait_idle(session)
                    try:
                        reply = self._handle(msg, session, epoch)
                    except errors.KvcpError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - our bug, not the peer's: INTERNAL, logged
                        outbox.put(exc)
                        return
                    if reply is not None:
                        outbox.put(reply)
            except errors.KvcpError as exc:
                session["failed"] = True  # what this stream queued is not applied after its refusal
                outbox.put(exc)
            except Exception as exc:  # noqa: BLE001 - stream broken by the peer
                log.debug("sync stream of %s ended: %s", session["agent_id"], exc)
            finally:
                self._applier.wait_idle(session)  # its replies and errors reach the outbox first
                outbox.put(None)

        reader = threading.Thread(target=read, name="sync-reader", daemon=True)
        reader.start()
        try:
            while True:
                item = outbox.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, AgentCommand):
                    if not self._leadership.is_leader:
                        # deposed since it was queued: stamped now it would carry the new
                        # leader's epoch (a follower knows it) and pass the agents' fence
                        if getattr(self._leadership, "serving_from_memory", False):
                            continue  # cut off from etcd: nothing goes out; the passes after resend
                        raise errors.not_leader(self._leadership.leader_address)
                    item = convert.command_to_pb(item, self._leadership.epoch, self._clock())
                yield item
        finally:
            # nothing this stream queued is applied after it closed (a last inventory chunk
            # would make the agent READY again with no stream): drop it, wait for the one
            # being applied, then close
            session["failed"] = True
            self._applier.wait_idle(session)
            if session["agent_id"]:
                self._cluster.stream_closed(session["agent_id"], session["session_id"])

    def _handle(self, msg: agent_pb2.AgentMessage, session: dict, epoch: int):
        kind = msg.WhichOneof("body")
        if kind == "hello":
            if session["agent_id"] and (session["agent_id"], session["session_id"]) != (
                msg.hello.agent_id,
                msg.hello.session_id,
            ):  # the first identity would stay attached to this stream after it ends
                raise errors.FailedPrecondition(
                    f"this Sync stream is {session['agent_id']!r}'s; a stream says Hello once (open another)"
                )
            held = {p.pin_id: p.version for p in msg.hello.pins}
            self._cluster.hello(
                msg.hello.agent_id,
                msg.hello.session_id,
                held,
                msg.hello.incarnation,
                runs_commands_once=msg.hello.runs_commands_once,
            )
            session["agent_id"], session["session_id"] = msg.hello.agent_id, msg.hello.session_id
            self._cluster.attach_outbox(msg.hello.agent_id, msg.hello.session_id, session["outbox"])
            return None
        agent_id = session["agent_id"]
        if not agent_id:
            raise errors.FailedPrecondition("Sync stream must start with a Hello message")
        if kind == "inventory":
            inv = msg.inventory
            reason = self._cluster.apply_inventory_chunk(
                agent_id, inv.seq, inv.chunk_index, inv.last_chunk, self._groups(inv.groups), session["session_id"]
            )
        elif kind == "events":
            ev = msg.events
            if ev.kind not in (agent_pb2.BLOCK_EVENT_KIND_STORED, agent_pb2.BLOCK_EVENT_KIND_REMOVED):
                raise errors.InvalidArgument("events.kind", f"unknown event kind {ev.kind}")
            reason = self._cluster.apply_events(
                agent_id,
                ev.seq,
                ev.kind == agent_pb2.BLOCK_EVENT_KIND_STORED,
                self._groups(ev.groups),
                session["session_id"],
            )
        elif kind == "stats":
            st = msg.stats
            self._cluster.update_stats(
                agent_id,
                [convert.tier_usage_from_pb(t) for t in st.tiers],
                st.lookups_total,
                st.lookup_tokens_total,
                st.lookup_hit_tokens_total,
                st.tier_moved_bytes_total,
                session["session_id"],  # a superseded stream's figures are refused, as its events are
            )
            self._cluster.update_namespaces(
                agent_id,
                {n.namespace: (n.num_blocks, n.uncompressed_bytes) for n in st.namespaces},
                session["session_id"],
            )
            if st.HasField("dataplane"):
                self._cluster.dataplane.update(agent_id, convert.dataplane_from_pb(st.dataplane))
            return None
        elif kind == "op_update":
            if self._on_op_update is not None:
                self._on_op_update(agent_id, msg.op_update)
            return None
        elif kind == "notice":
            # something an operator should see (corrupt_block, write_error): to the dashboard's Watch
            n = msg.notice
            self._cluster.events.publish("notice", f"{n.kind}: {n.message}", "warning", agent_id=agent_id)
            return None
        else:
            raise errors.InvalidArgument("body", "empty AgentMessage")
        if reason is not None:
            log.info("asking %s to resync: %s", agent_id, reason)
            return convert.control_resync(epoch, reason)
        return None

    @staticmethod
    def _groups(groups):
        try:
            return convert.groups_from_pb(groups)
        except ValueError as exc:
            raise errors.InvalidArgument("groups.block_hashes", str(exc)) from None
