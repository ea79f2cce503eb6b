"""Translation between protobuf messages and controlplane.core values (one place)."""

from __future__ import annotations

import time

from controlplane.core import cluster as core
from controlplane.core import events
from protos.kvcp.v1 import admin_pb2, agent_pb2, types_pb2
from protos.pb_enums import agent_state_pb, tier_pb
from protos.tier import Tier


def tier_usage_from_pb(t: types_pb2.TierUsage) -> core.TierUsage:
    if t.tier not in (v.value for v in Tier):
        from protos.errors import InvalidArgument

        raise InvalidArgument("tiers.tier", f"unknown tier value {t.tier}")
    return core.TierUsage(
        Tier(t.tier),
        t.capacity_bytes,
        t.used_bytes,
        t.num_blocks,
        t.uncompressed_bytes,
        t.stored_bytes,
        t.num_parked_blocks,
        t.blocks_used_bytes,
    )


_UINT64_MAX = (1 << 64) - 1


def tier_usage_to_pb(t: core.TierUsage) -> types_pb2.TierUsage:
    # sums over agents of what agents report can exceed uint64 (a buggy or hostile agent):
    # saturate rather than fail every GetStats
    return types_pb2.TierUsage(
        tier=tier_pb(int(t.tier)),
        capacity_bytes=min(t.capacity_bytes, _UINT64_MAX),
        used_bytes=min(t.used_bytes, _UINT64_MAX),
        num_blocks=min(t.num_blocks, _UINT64_MAX),
        uncompressed_bytes=min(t.uncompressed_bytes, _UINT64_MAX),
        stored_bytes=min(t.stored_bytes, _UINT64_MAX),
        num_parked_blocks=min(t.num_parked_blocks, _UINT64_MAX),
        blocks_used_bytes=min(t.blocks_used_bytes, _UINT64_MAX),
    )


def model_from_pb(m: types_pb2.ModelSpec) -> core.ModelInfo:
    return core.ModelInfo(m.model_id, m.block_size, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype)


def model_to_pb(m: core.ModelInfo) -> types_pb2.ModelSpec:
    return types_pb2.ModelSpec(
        model_id=m.model_id,
        block_size=m.block_size,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
    )


def agent_record_from_pb(info: types_pb2.AgentInfo) -> core.AgentRecord:
    return core.AgentRecord(
        agent_id=info.agent_id,
        address=info.address,
        models=[model_from_pb(m) for m in info.models],
        tiers=[tier_usage_from_pb(t) for t in info.tiers],
        metrics_address=info.metrics_address,
        transfer_engine=info.transfer_engine,
        transfer_engine_status=info.transfer_engine_status,
        shm_handoff=bool(info.shm_path),
    )


def groups_from_pb(groups) -> list[core.BlockGroup]:
    out = []
    for g in groups:
        if g.tier not in (t.value for t in Tier):
            from protos.errors import InvalidArgument

            raise InvalidArgument("groups.tier", f"unknown tier value {g.tier}")
        out.append(core.BlockGroup(g.model_id, Tier(g.tier), g.block_hashes, g.parent_hashes))
    return out


def agent_status_to_pb(rec: core.AgentRecord, num_blocks: int, cordon_reason: str = "") -> admin_pb2.AgentStatus:
    return admin_pb2.AgentStatus(
        info=types_pb2.AgentInfo(
            agent_id=rec.agent_id,
            address=rec.address,
            models=[model_to_pb(m) for m in rec.models],
            tiers=[tier_usage_to_pb(t) for t in rec.tiers],
            metrics_address=rec.metrics_address,
            transfer_engine=rec.transfer_engine,
            transfer_engine_status=rec.transfer_engine_status,
            shm_path="shm" if rec.shm_handoff else "",  # said, not given: peers read the path from etcd
        ),
        state=agent_state_pb(int(rec.state)),
        num_blocks=num_blocks,
        last_seen_unix_seconds=rec.last_seen_unix_seconds,
        lookups_total=rec.lookups_total,
        lookup_tokens_total=rec.lookup_tokens_total,
        lookup_hit_tokens_total=rec.lookup_hit_tokens_total,
        cordon_reason=cordon_reason,
    )


def lookup_to_pb(r: core.LookupResult) -> admin_pb2.LookupResponse:
    resp = admin_pb2.LookupResponse(
        model_id=r.model_id,
        num_tokens=r.num_tokens,
        num_blocks=r.num_blocks,
        best_agent_id=r.best_agent_id,
        possibly_stale=r.possibly_stale,
    )
    add, bs = resp.agents.add, r.block_size  # in place: a lookup can match every agent
    for agent_id, n, tiers in r.holders.rows():
        add(agent_id=agent_id, num_hit_blocks=n, num_hit_tokens=n * bs, tiers=tiers)
    return resp


def stats_to_pb(s: core.ClusterStats) -> admin_pb2.GetStatsResponse:
    return admin_pb2.GetStatsResponse(
        num_agents=s.num_agents,
        num_blocks=s.num_blocks,
        num_block_replicas=s.num_block_replicas,
        lookups_total=s.lookups_total,
        lookup_tokens_total=s.lookup_tokens_total,
        lookup_hit_tokens_total=s.lookup_hit_tokens_total,
        tiers=[tier_usage_to_pb(t) for t in s.tiers],
        models=[model_to_pb(m) for m in s.models],
        resyncs_total=s.resyncs_total,
        events_total=s.events_total,
        tier_moved_bytes_total=s.tier_moved_bytes_total,
    )


def control_resync(epoch: int, reason: str) -> agent_pb2.ControlMessage:
    return agent_pb2.ControlMessage(epoch=epoch, resync=agent_pb2.ResyncRequest(reason=reason))


def event_to_pb(e: events.Event) -> admin_pb2.ClusterEvent:
    return admin_pb2.ClusterEvent(
        seq=e.seq,
        unix_seconds=e.unix_seconds,
        kind=e.kind,
        severity=e.severity,
        agent_id=e.agent_id,
        op_id=e.op_id,
        pin_id=e.pin_id,
        message=e.message,
    )


_COMMAND_KINDS = {
    "move": agent_pb2.COMMAND_KIND_MOVE,
    "evict": agent_pb2.COMMAND_KIND_EVICT,
    "compress": agent_pb2.COMMAND_KIND_COMPRESS,
    "pin": agent_pb2.COMMAND_KIND_PIN,
    "unpin": agent_pb2.COMMAND_KIND_UNPIN,
    "cancel": agent_pb2.COMMAND_KIND_CANCEL,
    "cleanup": agent_pb2.COMMAND_KIND_CLEANUP,
    "transfer": agent_pb2.COMMAND_KIND_TRANSFER,
    "drain": agent_pb2.COMMAND_KIND_DRAIN,
}


def command_to_pb(c: core.AgentCommand, epoch: int, now: float | None = None) -> agent_pb2.ControlMessage:
    """`now`: the sender's clock when the message leaves (a pin's time left is taken then)."""
    now = time.time() if now is None else now
    ttl = max(c.expires_unix_seconds - now, 1e-6) if c.expires_unix_seconds else 0.0
    # a cleanup sent late drops no block used since its commands first went out: the
    # agent counts back from its own clock, so the wait is added to the idle time asked
    late_seconds = max(now - c.older_than_from_unix_seconds, 0.0) if c.older_than_from_unix_seconds else 0.0
    return agent_pb2.ControlMessage(
        epoch=epoch,
        command=agent_pb2.Command(
            op_id=c.op_id,
            kind=_COMMAND_KINDS[c.kind],
            block_hashes=c.block_hashes,
            tier=tier_pb(c.tier),
            codec=c.codec,
            namespace=c.namespace,
            model_id=c.model_id,
            older_than_seconds=c.older_than_seconds + late_seconds,
            dry_run=c.dry_run,
            only_tier=tier_pb(c.only_tier),
            pin_id=c.pin_id,
            pin_version=c.pin_version,
            expires_unix_seconds=c.expires_unix_seconds,
            peer_agent_id=c.peer_agent_id,
            peer_agent_ids=list(c.peer_agent_ids),
            peer_free_bytes=list(c.peer_free_bytes),
            peer_fill_limit_bytes=list(c.peer_fill_limit_bytes),
            deadline_seconds=c.deadline_seconds,
            ttl_seconds=ttl if c.kind == "pin" else 0.0,
        ),
    )


def scope_from_pb(s: admin_pb2.Scope):
    from controlplane.core.scope import Scope

    return Scope(
        model_id=s.model_id,
        token_ids=tuple(s.token_ids),
        block_hashes=s.block_hashes,
        extra_keys=tuple(s.extra_keys),
        namespace=s.namespace,
        agent_id=s.agent_id,
    )


def pin_to_pb(p) -> admin_pb2.PinInfo:
    return admin_pb2.PinInfo(
        pin_id=p.pin_id,
        namespace=p.namespace,
        scope=admin_pb2.Scope(
            model_id=p.model_id, block_hashes=p.block_hashes, namespace=p.namespace, agent_id=p.agent_id
        ),
        min_tier=tier_pb(int(p.min_tier)),
        created_unix_seconds=p.created_unix_seconds,
        expires_unix_seconds=p.expires_unix_seconds,
        owner=p.owner,
        owner_lease_id=p.owner_lease_id,
        num_blocks=p.num_blocks,
        pinned_bytes=min(p.pinned_bytes, (1 << 64) - 1),  # an answer, whatever a stored pin says
    )


_OP_STATES = {
    "PENDING": admin_pb2.OPERATION_STATE_PENDING,
    "RUNNING": admin_pb2.OPERATION_STATE_RUNNING,
    "SUCCEEDED": admin_pb2.OPERATION_STATE_SUCCEEDED,
    "FAILED": admin_pb2.OPERATION_STATE_FAILED,
    "CANCELLED": admin_pb2.OPERATION_STATE_CANCELLED,
}


def op_to_pb(op) -> admin_pb2.Operation:
    return admin_pb2.Operation(
        op_id=op.op_id,
        kind=op.kind,
        state=_OP_STATES[op.state],
        progress=op.progress,
        num_done_blocks=op.num_done_blocks,
        num_total_blocks=op.num_total_blocks,
        num_failed_blocks=op.num_failed_blocks,
        num_skipped_pinned_blocks=op.num_skipped_pinned_blocks,
        moved_bytes=op.moved_bytes,
        freed=[
            types_pb2.TierUsage(tier=tier_pb(int(t)), num_blocks=n, used_bytes=b) for t, (n, b) in op.freed().items()
        ],
        error=op.error,
        created_unix_seconds=op.created_unix_seconds,
        updated_unix_seconds=op.updated_unix_seconds,
        params=op.params,
        agents=[
            admin_pb2.AgentProgress(
                agent_id=p.agent_id,
                state=p.state,
                num_done_blocks=p.num_done_blocks,
                num_total_blocks=p.num_total_blocks,
                num_failed_blocks=p.num_failed_blocks,
                error=p.error,
                result=p.result,
            )
            for p in op.parts.values()
        ],
        dry_run=op.dry_run,
        result=op.result,
    )


def dataplane_from_pb(d: agent_pb2.DataPlaneStats):
    from controlplane.core.routing import DataPlaneView, LinkView

    return DataPlaneView(
        handoff_free_bytes=d.handoff_free_bytes,
        handoff_capacity_bytes=d.handoff_capacity_bytes,
        inbound_reservations=d.num_inbound_handoffs,
        max_inbound=d.max_inbound_handoffs or 8,
        handoff_tier=d.handoff_tier,
        outbound_inflight=d.num_outbound_inflight_handoffs,
        outbound_queued=d.num_outbound_queued_handoffs,
        links={
            link.peer_agent_id: LinkView(
                link.peer_agent_id,
                link.throughput_bytes_per_second,
                link.num_inflight_transfers,
                link.num_queued_transfers,
                link.latency_seconds,
            )
            for link in d.links
        },
    )


def route_to_pb(r) -> admin_pb2.RouteResponse:
    return admin_pb2.RouteResponse(
        role=r.role,
        agent_id=r.agent_id,
        address=getattr(r, "address", ""),
        prefill_agent_id=r.prefill_agent_id,
        decode_agent_id=r.decode_agent_id,
        disaggregate=r.disaggregate,
        num_cached_tokens=r.num_cached_tokens,
        transfer_seconds=r.transfer_seconds,
        saved_seconds=r.saved_seconds,
        reason=r.reason,
        candidates=[
            admin_pb2.RouteCandidate(
                agent_id=c.agent_id,
                estimated_seconds=c.score,
                num_cached_blocks=c.num_cached_blocks,
                num_active_handoffs=c.load,
                free_bytes=c.free_bytes,
                link_bytes_per_second=c.link_bytes_per_second,
                transfer_seconds=c.transfer_seconds,
                behind=c.behind,
                note=c.note,
            )
            for c in r.candidates
        ],
        backpressure=r.backpressure,
    )
