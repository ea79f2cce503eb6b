"""Translation between protobuf messages and controlplane.core values (one place)."""

from __future__ import annotations

from controlplane.core import cluster as core
from protos.kvcp.v1 import admin_pb2, agent_pb2, types_pb2
from protos.tier import Tier


def tier_usage_from_pb(t: types_pb2.TierUsage) -> core.TierUsage:
    return core.TierUsage(Tier(t.tier), t.capacity_bytes, t.used_bytes, t.num_blocks)


def tier_usage_to_pb(t: core.TierUsage) -> types_pb2.TierUsage:
    return types_pb2.TierUsage(
        tier=int(t.tier), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, num_blocks=t.num_blocks
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
    )


def groups_from_pb(groups) -> list[core.BlockGroup]:
    out = []
    for g in groups:
        if g.tier not in (t.value for t in Tier):
            from protos.errors import InvalidArgument

            raise InvalidArgument("groups.tier", f"unknown tier value {g.tier}")
        out.append(core.BlockGroup(g.model_id, Tier(g.tier), g.block_hashes))
    return out


def agent_status_to_pb(rec: core.AgentRecord, num_blocks: int) -> admin_pb2.AgentStatus:
    return admin_pb2.AgentStatus(
        info=types_pb2.AgentInfo(
            agent_id=rec.agent_id,
            address=rec.address,
            models=[model_to_pb(m) for m in rec.models],
            tiers=[tier_usage_to_pb(t) for t in rec.tiers],
            metrics_address=rec.metrics_address,
        ),
        state=int(rec.state),
        num_blocks=num_blocks,
        last_seen_unix_seconds=rec.last_seen_unix_seconds,
        lookups_total=rec.lookups_total,
        lookup_tokens_total=rec.lookup_tokens_total,
        lookup_hit_tokens_total=rec.lookup_hit_tokens_total,
    )


def lookup_to_pb(r: core.LookupResult) -> admin_pb2.LookupResponse:
    return admin_pb2.LookupResponse(
        model_id=r.model_id,
        num_tokens=r.num_tokens,
        num_blocks=r.num_blocks,
        best_agent_id=r.best_agent_id,
        agents=[
            admin_pb2.AgentMatch(
                agent_id=m.agent_id,
                num_hit_blocks=m.num_hit_blocks,
                num_hit_tokens=m.num_hit_blocks * r.block_size,
                tiers=m.tiers,
            )
            for m in r.matches
        ],
        possibly_stale=r.possibly_stale,
    )


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
    )


def control_resync(epoch: int, reason: str) -> agent_pb2.ControlMessage:
    return agent_pb2.ControlMessage(epoch=epoch, resync=agent_pb2.ResyncRequest(reason=reason))
