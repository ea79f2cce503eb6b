"""AdminService servicer: what kvctl and the dashboard call."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from controlplane.api import convert
from controlplane.core import routing
from controlplane.core.cluster import Cluster
from controlplane.core.events import EVENT_KINDS
from protos import errors
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc
from protos.tier import Tier

if TYPE_CHECKING:
    from controlplane.manager import Manager

# how often an idle Watch stream checks that its client and our leadership are still there
WATCH_IDLE_CHECK_SECONDS = 1.0


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    manager: Manager | None = None  # set by the server (pins, operations, policy)
    lookup_address = ""  # this replica's lookup socket (controlplane.api.lookup_socket), if any

    def __init__(self, cluster: Cluster, leadership, lookup_duration=None, max_watch_streams: int = 32):
        self._cluster = cluster
        self._leadership = leadership
        # each Watch holds a server thread while open: past this many, new ones are refused
        # (RESOURCE_EXHAUSTED), so watchers cannot take the threads agents and calls need
        self.max_watch_streams = max_watch_streams
        self._watch_streams = 0
        self._watch_lock = threading.Lock()
        # a prometheus Histogram (controlplane.metrics); None in tests that do not measure
        self._lookup_duration = lookup_duration

    def _require_leader(self, read: bool = False) -> None:
        """Writes need the leader; reads are also answered by a leader cut off from etcd
        (from memory, flagged possibly stale), since nobody else can lead meanwhile."""
        if self._leadership.is_leader:
            return
        if getattr(self._leadership, "serving_from_memory", False):
            if read:
                return
            raise errors.EtcdUnreachable(
                "etcd is unreachable; durable changes (pin, unpin, policy, operations) are rejected until it "
                "returns; lookups are still answered from memory"
            )
        raise errors.not_leader(self._leadership.leader_address, getattr(self._leadership, "refusal", ""))

    @property
    def _stale(self) -> bool:
        return bool(getattr(self._leadership, "serving_from_memory", False))

    def ListAgents(self, request, context):
        self._require_leader(read=True)
        return admin_pb2.ListAgentsResponse(
            agents=[
                convert.agent_status_to_pb(rec, n, self._cluster.cordon_reason(rec.agent_id))
                for rec, n in self._cluster.agents()
            ]
        )

    def Lookup(self, request, context):
        return self.answer_lookup(request)

    def answer_lookup(self, request: admin_pb2.LookupRequest) -> admin_pb2.LookupResponse:
        """Lookup's answer, for gRPC and for the lookup socket alike (KvcpError on bad input)."""
        self._require_leader(read=True)
        start = time.perf_counter()
        rebuilding = self._cluster.rebuilding()
        try:
            result = self._cluster.lookup(
                request.model_id,
                token_ids=list(request.token_ids),
                block_hashes=request.block_hashes,
                extra_keys=tuple(request.extra_keys),
            )
        except errors.NotFound:
            if rebuilding and self._cluster.agents_not_registered():  # may serve it: not back yet
                raise errors.Unavailable(
                    f"model_id: no agent serving {request.model_id!r} has synced with this control plane yet "
                    "(it took over, or agents are resyncing); retry shortly"
                ) from None
            raise
        response = convert.lookup_to_pb(result)
        response.possibly_stale = self._stale or rebuilding
        if self._lookup_duration is not None:
            self._lookup_duration.observe(time.perf_counter() - start)
        return response

    def GetStats(self, request, context):
        self._require_leader(read=True)
        resp = convert.stats_to_pb(self._cluster.stats())
        resp.leader_address = self._leadership.leader_address
        resp.epoch = self._leadership.epoch
        resp.is_leader = self._leadership.is_leader
        resp.lookup_address = self.lookup_address
        if self.manager is not None:
            policy = self.manager.policy_stats()
            resp.policy_reuse_credit_turnovers = policy.reuse_credit_turnovers
            resp.policy_recent_first = policy.recent_first
            resp.policy_passes_total = policy.passes_total
        return resp

    def Watch(self, request, context):
        """Server stream of cluster events: the buffered recent ones first (when asked),
        then live ones, filtered by kind. The client going away, or the server stopping,
        closes the subscription from gRPC's callback, which wakes this loop at once, so no
        worker thread stays parked on a stream nobody reads. A read: a leader cut off from
        etcd keeps streaming what it sees."""
        self._require_leader(read=True)
        unknown = sorted(set(request.kinds) - set(EVENT_KINDS))
        if unknown:  # (a stream of a kind that never comes held a slot until the client gave up)
            raise errors.InvalidArgument(
                "kinds", f"unknown event kind {unknown[0][:80]!r} (known: {', '.join(EVENT_KINDS)})"
            )
        with self._watch_lock:
            if self._watch_streams >= self.max_watch_streams:
                raise errors.ResourceExhausted(
                    f"this control plane serves at most {self.max_watch_streams} event streams at once; "
                    "close one (a dashboard, kvctl) and retry"
                )
            self._watch_streams += 1
        try:
            yield from self._stream_events(request, context)
        finally:
            with self._watch_lock:
                self._watch_streams -= 1

    def _stream_events(self, request, context):
        sub = self._cluster.events.subscribe(tuple(set(request.kinds)), replay_recent=request.replay_recent)
        context.add_callback(sub.close)
        try:
            while context.is_active():
                event = sub.get(WATCH_IDLE_CHECK_SECONDS)
                if event is not None:
                    yield convert.event_to_pb(event)
                elif sub.closed:
                    return
                else:
                    self._require_leader(read=True)
        finally:
            sub.close()

    # ---- pins, operations, policy (controlplane.manager) -----------------------------
    def _manager(self, read: bool = False):
        self._require_leader(read)
        if self.manager is None:
            raise errors.NotConfigured("this control plane runs without etcd-backed pins and operations")
        # a new leader answers from its state only once it has read it from etcd (it loads
        # it now if the reconcile loop has not yet; etcd unreachable: UNAVAILABLE)
        self.manager.ensure_loaded()
        return self.manager

    def Pin(self, request, context):
        tier = request.min_tier or int(Tier.CPU)
        if tier not in (int(Tier.GPU), int(Tier.CPU), int(Tier.DISK)):
            raise errors.InvalidArgument("min_tier", "must be gpu, cpu or disk")
        pin = self._manager().pin(
            convert.scope_from_pb(request.scope),
            Tier(tier),
            request.ttl_seconds,
            request.owner,
            request.owner_lease_id,
            request.pin_id,
        )
        return convert.pin_to_pb(pin)

    def Unpin(self, request, context):
        if not request.pin_id:
            raise errors.InvalidArgument("pin_id", "must not be empty")
        return convert.pin_to_pb(self._manager().unpin(request.pin_id))

    def ListPins(self, request, context):
        return admin_pb2.ListPinsResponse(
            pins=[convert.pin_to_pb(p) for p in self._manager(read=True).list_pins(request.namespace)],
            possibly_stale=self._stale,
        )

    def Move(self, request, context):
        if request.to_tier not in (int(Tier.GPU), int(Tier.CPU), int(Tier.DISK)):
            raise errors.InvalidArgument("to_tier", "must be gpu, cpu or disk")
        op = self._manager().move(convert.scope_from_pb(request.scope), Tier(request.to_tier), request.codec)
        return convert.op_to_pb(op)

    def Compress(self, request, context):
        if request.tier and request.tier not in (int(Tier.GPU), int(Tier.CPU), int(Tier.DISK)):
            raise errors.InvalidArgument("tier", "must be gpu, cpu or disk")
        op = self._manager().compress(
            convert.scope_from_pb(request.scope), request.codec, Tier(request.tier) if request.tier else None
        )
        return convert.op_to_pb(op)

    def Cleanup(self, request, context):
        op = self._manager().cleanup(
            request.older_than_seconds, request.namespace, request.agent_id, request.model_id, request.dry_run
        )
        return convert.op_to_pb(op)

    def Transfer(self, request, context):
        op = self._manager().transfer(
            convert.scope_from_pb(request.scope), request.from_agent_id, request.to_agent_id, request.deadline_seconds
        )
        return convert.op_to_pb(op)

    def Drain(self, request, context):
        op = self._manager().drain(
            request.agent_id,
            tuple(request.to_agent_ids),
            request.model_id,
            request.deadline_seconds,
            request.reason,
        )
        return convert.op_to_pb(op)

    def Route(self, request, context):
        self._require_leader(read=True)  # from memory, as lookups are, while etcd is away
        decision = routing.route_request(
            self._cluster,
            request.model_id,
            token_ids=list(request.token_ids),
            block_hashes=request.block_hashes,
            extra_keys=tuple(request.extra_keys),
            role=request.role,
            prefill_agent_id=request.prefill_agent_id,
            # pins as this replica knows them now (Route answers from memory)
            pinned=self.manager.pinned_blocks if self.manager is not None else None,
        )
        response = convert.route_to_pb(decision)
        response.possibly_stale = self._stale or self._cluster.rebuilding()
        return response

    def GetOperation(self, request, context):
        if not request.op_id:
            raise errors.InvalidArgument("op_id", "must not be empty")
        return convert.op_to_pb(self._manager(read=True).get_op(request.op_id))

    def ListOperations(self, request, context):
        return admin_pb2.ListOperationsResponse(
            operations=[
                convert.op_to_pb(o) for o in self._manager(read=True).list_ops(min(request.max_operations or 100, 1000))
            ]
        )

    def CancelOperation(self, request, context):
        if not request.op_id:
            raise errors.InvalidArgument("op_id", "must not be empty")
        return convert.op_to_pb(self._manager().cancel_op(request.op_id))

    def GetPolicy(self, request, context):
        values, revision = self._manager(read=True).get_policy()
        return admin_pb2.Policy(values=values, revision=revision)

    def SetPolicy(self, request, context):
        if not request.values:
            raise errors.InvalidArgument("values", "give at least one key=value")
        manager = self._manager()
        values = manager.set_policy(dict(request.values))
        return admin_pb2.Policy(values=values, revision=manager.policy_revision)
