"""Prometheus metrics of one agent. Every series carries `agent_id` (one value per
process), so dashboards break down by agent without relabelling.

Block-pool and engine values are read when Prometheus scrapes (`AgentCollector` calls
`BlockPool.usage()` and reads the pool's and engine's plain counters), so storing and
loading KV pays nothing for metrics. What happens outside `core` is measured where it
happens: etcd requests (`protos.metrics.InstrumentedEtcd`), RPC status codes (an
interceptor), and transfers between agents (`record_transfer()`, for the data plane).

The pool's counters are plain ints or dicts keyed by tier, tier pair or (tier, reason):
`evictions_total`, `demotions_total`, `promotions_total`, `moved_bytes_total`,
`corrupt_blocks_total`, `move_failures_total`, `gpu_codec_blocks_total`. A count without a reason is reported as
reason "capacity" (the local safety net is the only cause today); a feature that adds a
cause keys its count by (tier, reason) and shows up without a change here."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from agent.core.tier_store import is_slab
from agent.store import memory_tier
from protos.metrics import (
    DURATION_BUCKETS_SECONDS,
    BuildInfoCollector,
    EtcdMetrics,
    RpcMetricsInterceptor,
)
from protos.tier import Tier

if TYPE_CHECKING:
    from agent.dataplane import DataPlane

log = logging.getLogger(__name__)

MEMORY_AND_DISK = (Tier.GPU, Tier.CPU, Tier.DISK)
TRANSFER_KINDS = ("handoff", "replicate", "migrate")
TRANSFER_FALLBACKS = ("secondary_path", "recompute")
AGENT_OPERATION_KINDS = ("move", "promote", "compress")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")
DEFAULT_REASON = "capacity"
GPU_CODEC_SERIES = [(op, path) for op in ("encode", "decode") for path in ("batch", "one_by_one")]
# (metric, help, VllmEventStats attribute): an agent indexing a vLLM engine's KV events
VLLM_EVENT_COUNTERS = (
    ("kvcp_vllm_event_batches_total", "vLLM KV event batches applied (live or replayed).", "batches_total"),
    (
        "kvcp_vllm_event_malformed_total",
        "vLLM KV event messages or batches skipped as malformed (a batch: the engine's blocks forgotten).",
        "malformed_total",
    ),
    (
        "kvcp_vllm_event_unknown_total",
        "vLLM KV events of a kind not known here, left out of their batch.",
        "unknown_events_total",
    ),
    (
        "kvcp_vllm_event_other_group_total",
        "vLLM KV events of a KV cache group this agent does not index (--vllm-kv-group), left out.",
        "other_group_events_total",
    ),
    ("kvcp_vllm_event_gaps_total", "Gaps in the vLLM event sequence (asked of the replay endpoint).", "gaps_total"),
    (
        "kvcp_vllm_event_unrecovered_gaps_total",
        "Gaps replay could not fill: the engine's blocks were forgotten.",
        "unrecovered_gaps_total",
    ),
    ("kvcp_vllm_engine_restarts_total", "vLLM engine restarts seen (its sequence went back).", "engine_restarts_total"),
    (
        "kvcp_vllm_engine_lost_total",
        "Times the vLLM engine's event connection stayed down past the grace: its blocks were forgotten.",
        "engine_lost_total",
    ),
)


def _by_tier_reason(value, default_tier: Tier) -> dict[tuple[Tier, str], int]:
    """Normalise a pool counter: int, {tier: n} or {(tier, reason): n}."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return {(default_tier, DEFAULT_REASON): int(value)}
    out: dict[tuple[Tier, str], int] = {}
    for key, n in value.items():
        tier, reason = key if isinstance(key, tuple) else (key, DEFAULT_REASON)
        out[(Tier(tier), reason)] = out.get((Tier(tier), reason), 0) + int(n)
    return out


class _OperationDurations:
    """Durations of the mover's operations, each observed once as it ends (a Mover finish
    listener): the mover keeps only its latest operations, so reading them at scrape
    time would miss those that ended and were dropped between two scrapes."""

    def __init__(self, agent_id: str):
        self._agent_id = agent_id
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self._sums: dict[tuple[str, str], float] = {}
        for kind, state in itertools.product(AGENT_OPERATION_KINDS, TERMINAL_STATES):
            self._slot(kind, state)

    def _slot(self, kind: str, state: str) -> tuple[list[int], float]:
        key = (kind, state)
        if key not in self._buckets:
            self._buckets[key] = [0] * (len(DURATION_BUCKETS_SECONDS) + 1)
            self._sums[key] = 0.0
        return self._buckets[key], self._sums[key]

    def observe(self, op) -> None:
        state = str(op.state).lower()
        if state not in TERMINAL_STATES:
            return
        seconds = max(0.0, float(op.finished_unix_seconds) - float(op.created_unix_seconds))
        with self._lock:
            counts, _ = self._slot(op.kind, state)
            for i, bound in enumerate((*DURATION_BUCKETS_SECONDS, float("inf"))):
                if seconds <= bound:
                    counts[i] += 1
            self._sums[(op.kind, state)] += seconds

    def family(self) -> HistogramMetricFamily:
        h = HistogramMetricFamily(
            "kvcp_agent_operation_duration_seconds",
            "Duration of this agent's finished block operations (submit to finish), by kind and final state.",
            labels=["agent_id", "kind", "state"],
        )
        bounds = [*(floatToGoString(b) for b in DURATION_BUCKETS_SECONDS), "+Inf"]
        with self._lock:
            rows = [(key, list(counts), self._sums[key]) for key, counts in sorted(self._buckets.items())]
        for (kind, state), counts, total in rows:
            h.add_metric([self._agent_id, kind, state], list(zip(bounds, counts, strict=True)), total)
        return h


# the receiving and sending side of handoffs (agent.dataplane), read at scrape time
HANDOFF_FAMILIES = (
    (GaugeMetricFamily, "kvcp_handoff_reservations", "Handoffs arriving here: reservations open.", ()),
    (GaugeMetricFamily, "kvcp_handoff_reserved_bytes", "Bytes reserved for handoffs arriving here.", ()),
    (
        CounterMetricFamily,
        "kvcp_handoff_reservations_ended_total",
        "Reservations of arriving handoffs, by how they ended: committed, aborted by the sender, expired "
        "(the sender went silent: dead, hung, or past its deadline).",
        ("outcome",),
    ),
    (
        CounterMetricFamily,
        "kvcp_handoff_checksum_failures_total",
        "Arriving handoffs whose bytes did not match the sender's checksums (nothing of them was made visible).",
        (),
    ),
    (
        CounterMetricFamily,
        "kvcp_handoff_aborts_retried_total",
        "Aborts of failed outbound handoffs sent again because the peer did not answer in time "
        "(its reserved pages wait for an Abort or their expiry).",
        (),
    ),
    (
        GaugeMetricFamily,
        "kvcp_handoff_quarantined_bytes",
        "Pages of aborted or expired handoffs held until no late write can land in them.",
        (),
    ),
    (
        GaugeMetricFamily,
        "kvcp_handoff_held_for_writers",
        "Expired shared-memory handoffs whose pages are held past the quarantine while their sender lives "
        "(a hung sender).",
        (),
    ),
    (
        GaugeMetricFamily,
        "kvcp_handoff_free_bytes",
        "Room for arriving handoffs: free pages plus blocks that may be evicted or demoted.",
        (),
    ),
    (
        GaugeMetricFamily,
        "kvcp_handoffs_outbound",
        "Handoffs this agent sends, by state: inflight, queued (behind a link's concurrency limit).",
        ("state",),
    ),
    (
        GaugeMetricFamily,
        "kvcp_link_throughput_bytes_per_second",
        "Each peer's link capacity for handoff bytes, fitted to recent transfers (0: not measured yet).",
        ("peer_agent_id",),
    ),
    (
        GaugeMetricFamily,
        "kvcp_link_latency_seconds",
        "Each peer's fixed cost of one handoff (round trips, a verify), fitted to recent transfers.",
        ("peer_agent_id",),
    ),
)


class AgentCollector:
    """Block pool, engine, mover and control-plane link of one agent at scrape time."""

    def __init__(self, agent_id: str, pool, engine=None, link=None, mover=None, vllm=None):
        self.agent_id = agent_id
        self.pool = pool
        self.engine = engine
        self.link = link
        self.mover = mover
        self.vllm = vllm  # a VllmEventSubscriber, when the agent indexes a vLLM engine's events
        self.dataplane: DataPlane | None = None  # set once made (it takes these metrics)
        self._durations = _OperationDurations(agent_id)
        # the CUDA devices of the pool's GPU tiers ("cuda:N"): their memory is read at scrape time
        self._gpu_devices = sorted(
            {str(t.device) for t in getattr(pool, "tiers", ()) if t.tier == Tier.GPU and is_slab(t)}
        )
        self._gpu_memory_failed: set[str] = set()  # devices whose read failed (said once)
        if mover is not None and hasattr(mover, "finish_listeners"):
            mover.finish_listeners.append(self._durations.observe)

    def _families(self):
        g, c = GaugeMetricFamily, CounterMetricFamily
        a = ["agent_id"]
        specs = [
            (g, "kvcp_tier_capacity_bytes", "Capacity of each tier of this agent.", [*a, "tier"]),
            (g, "kvcp_tier_used_bytes", "Bytes of each tier in use (stored blocks, after compression).", [*a, "tier"]),
            (g, "kvcp_tier_blocks", "Blocks held in each tier.", [*a, "tier"]),
            (
                g,
                "kvcp_compression_saved_bytes",
                "Bytes of each tier compression frees: what its blocks would take raw minus what they take "
                "(whole pages, disk granules).",
                [*a, "tier"],
            ),
            (c, "kvcp_agent_lookups_total", "Engine lookups and loads served by this agent.", a),
            (c, "kvcp_agent_lookup_tokens_total", "Tokens asked about in engine lookups and loads.", a),
            (c, "kvcp_agent_lookup_hit_tokens_total", "Tokens found cached in engine lookups and loads.", a),
            (
                c,
                "kvcp_evictions_total",
                "Blocks dropped from a tier, by tier and reason: capacity (room for new blocks), command "
                "(the tier policy's or an operator's evict), cleanup.",
                [*a, "tier", "reason"],
            ),
            (
                c,
                "kvcp_demotions_total",
                "Blocks moved to a slower tier, by source tier and reason: capacity (room for new blocks), "
                "command (a move: the tier policy's or an operator's).",
                [*a, "tier", "reason"],
            ),
            (
                c,
                "kvcp_recoded_bytes_total",
                "Stored bytes of blocks re-encoded where they were (kvctl compress in place; not movement).",
                a,
            ),
            (c, "kvcp_promotions_total", "Blocks moved to a faster tier.", a),
            (
                c,
                "kvcp_tier_moved_bytes_total",
                "Bytes moved between tiers of this agent, by source and destination tier.",
                [*a, "src_tier", "dst_tier"],
            ),
            (c, "kvcp_move_failures_total", "Block moves between tiers that failed (source left intact).", a),
            (c, "kvcp_corrupt_blocks_total", "Blocks found corrupt or truncated on read, removed, never returned.", a),
            (
                g,
                "kvcp_parked_blocks",
                "Blocks recovered from disk after a restart that wait for their prefix to be stored again, "
                "or whose model is not served as they were written.",
                a,
            ),
            (
                c,
                "kvcp_store_refused_blocks_total",
                "Blocks of engine stores not kept: every tier was full of blocks that may not go (pinned, in use).",
                a,
            ),
            (
                c,
                "kvcp_disk_write_errors_total",
                "Block writes the disk tier's file system refused (ENOSPC, EIO); the tier shrinks to what fits.",
                a,
            ),
            (
                c,
                "kvcp_disk_compactions_total",
                "Compactions of the disk tier's free space that relocated blocks (a block of mixed sizes found no "
                "free run long enough although the tier's bytes had room).",
                a,
            ),
            (c, "kvcp_disk_relocated_bytes_total", "Bytes of disk blocks compaction relocated within the slab.", a),
            (
                g,
                "kvcp_disk_largest_free_run_bytes",
                "The longest free run of the disk tier's slab: the biggest block it can place without compaction.",
                a,
            ),
            (g, "kvcp_disk_free_bytes", "Free bytes of the disk tier's slab, in runs of any length.", a),
            (
                c,
                "kvcp_gpu_codec_blocks_total",
                "Blocks a move encoded or decoded on the GPU in batches (path batch), and those whose batch"
                " failed (out of GPU memory, say) and went one by one on the host (path one_by_one).",
                [*a, "op", "path"],
            ),
            (g, "kvcp_agent_controlplane_connected", "1 while the Sync stream to the control plane is up.", a),
            (c, "kvcp_agent_sync_connections_total", "Sync streams opened to the control plane.", a),
            (c, "kvcp_agent_resyncs_total", "Full inventories sent because the control plane asked.", a),
            (
                g,
                "kvcp_agent_operations",
                "This agent's block operations waiting or running, by kind and state.",
                [*a, "kind", "state"],
            ),
        ]
        if self._gpu_devices:
            specs.append(
                (
                    g,
                    "kvcp_gpu_memory_bytes",
                    "Memory of each GPU this agent's GPU tier is on: free and total on the device (every "
                    "process's use counts), reserved and allocated by this agent's torch allocator.",
                    [*a, "device", "kind"],
                )
            )
        if self.vllm is not None:
            specs.extend((c, name, doc, a) for name, doc, _ in VLLM_EVENT_COUNTERS)
            specs.append(
                (
                    c,
                    "kvcp_vllm_blocks_indexed_total",
                    "vLLM engine blocks indexed, by the hash they are indexed under: kvcp's digest of their "
                    "tokens (found by token lookups) or the engine's own (--vllm-index-by).",
                    [*a, "by"],
                )
            )
        if self.dataplane is not None:
            specs.extend((kind, name, doc, [*a, *extra]) for kind, name, doc, extra in HANDOFF_FAMILIES)
        return {name: kind(name, doc, labels=labels) for kind, name, doc, labels in specs}

    def describe(self):
        return [*self._families().values(), self._durations.family()]

    def collect(self):
        f = self._families()
        aid = self.agent_id
        pool = self.pool
        tiers = [u.tier for u in pool.usage()]
        for u in pool.usage():
            t = u.tier.label
            f["kvcp_tier_capacity_bytes"].add_metric([aid, t], u.capacity_bytes)
            f["kvcp_tier_used_bytes"].add_metric([aid, t], u.used_bytes)
            f["kvcp_tier_blocks"].add_metric([aid, t], u.num_blocks)
            f["kvcp_compression_saved_bytes"].add_metric([aid, t], max(0, getattr(u, "saved_bytes", 0)))
        e = self.engine
        if e is not None:
            f["kvcp_agent_lookups_total"].add_metric([aid], e.lookups_total)
            f["kvcp_agent_lookup_tokens_total"].add_metric([aid], e.lookup_tokens_total)
            f["kvcp_agent_lookup_hit_tokens_total"].add_metric([aid], e.lookup_hit_tokens_total)
        # evictions for room happen in the last tier, demotions start in any but the last
        for name, default_tier, by_reason in (
            (
                "kvcp_evictions_total",
                tiers[-1],
                (
                    (DEFAULT_REASON, "evictions_total"),
                    ("command", "commanded_evictions_total"),
                    ("cleanup", "cleanup_evictions_total"),
                ),
            ),
            (
                "kvcp_demotions_total",
                tiers[0],
                ((DEFAULT_REASON, "demotions_total"), ("command", "commanded_demotions_total")),
            ),
        ):
            counts = {(t, reason): 0 for t in tiers for reason, _ in by_reason}
            for reason, attr in by_reason:
                for (tier, r), n in _by_tier_reason(getattr(pool, attr, None), default_tier).items():
                    key = (tier, reason if r == DEFAULT_REASON else r)
                    counts[key] = counts.get(key, 0) + n
            for (tier, reason), n in sorted(counts.items()):
                f[name].add_metric([aid, tier.label, reason], n)
        f["kvcp_recoded_bytes_total"].add_metric([aid], int(getattr(pool, "recoded_bytes_total", 0) or 0))
        f["kvcp_promotions_total"].add_metric([aid], int(getattr(pool, "promotions_total", 0) or 0))
        moved = dict.fromkeys(itertools.permutations(sorted({*MEMORY_AND_DISK, *tiers}), 2), 0)  # src != dst
        moved.update(
            {(Tier(s), Tier(d)): int(n) for (s, d), n in (getattr(pool, "moved_bytes_total", None) or {}).items()}
        )
        for (src, dst), n in sorted(moved.items()):
            f["kvcp_tier_moved_bytes_total"].add_metric([aid, src.label, dst.label], n)
        f["kvcp_move_failures_total"].add_metric([aid], int(getattr(pool, "move_failures_total", 0) or 0))
        f["kvcp_corrupt_blocks_total"].add_metric([aid], int(getattr(pool, "corrupt_blocks_total", 0) or 0))
        f["kvcp_parked_blocks"].add_metric([aid], int(getattr(pool, "num_parked_blocks", 0)))
        f["kvcp_store_refused_blocks_total"].add_metric([aid], int(getattr(pool, "store_refused_blocks_total", 0)))
        disk_errors = sum(getattr(t, "write_errors_total", 0) for t in getattr(pool, "tiers", ()))
        f["kvcp_disk_write_errors_total"].add_metric([aid], int(disk_errors))
        disks = [t for t in getattr(pool, "tiers", ()) if hasattr(t, "fragmentation")]
        f["kvcp_disk_compactions_total"].add_metric([aid], sum(int(t.compactions_total) for t in disks))
        f["kvcp_disk_relocated_bytes_total"].add_metric([aid], sum(int(t.relocated_bytes_total) for t in disks))
        runs = [t.fragmentation() for t in disks]
        f["kvcp_disk_largest_free_run_bytes"].add_metric([aid], max((r[0] for r in runs), default=0))
        f["kvcp_disk_free_bytes"].add_metric([aid], sum(r[1] for r in runs))
        gpu_codec = dict.fromkeys(GPU_CODEC_SERIES, 0) | dict(getattr(pool, "gpu_codec_blocks_total", None) or {})
        for (op, path), n in sorted(gpu_codec.items()):
            f["kvcp_gpu_codec_blocks_total"].add_metric([aid, op, path], n)
        link = self.link
        if link is not None:
            f["kvcp_agent_controlplane_connected"].add_metric([aid], 1 if link.connected.is_set() else 0)
            f["kvcp_agent_sync_connections_total"].add_metric([aid], link.connections_total)
            f["kvcp_agent_resyncs_total"].add_metric([aid], link.resyncs_total)
        ops = self.mover.ops() if self.mover is not None else []
        active = {(k, s): 0 for k in AGENT_OPERATION_KINDS for s in ("pending", "running")}
        for op in ops:
            state = str(op.state).lower()
            if state in ("pending", "running"):
                active[(op.kind, state)] = active.get((op.kind, state), 0) + 1
        for (kind, state), n in sorted(active.items()):
            f["kvcp_agent_operations"].add_metric([aid, kind, state], n)
        if self.vllm is not None:
            st = self.vllm.stats
            for name, _, attr in VLLM_EVENT_COUNTERS:
                f[name].add_metric([aid], getattr(st, attr))
            ext = self.vllm.external
            f["kvcp_vllm_blocks_indexed_total"].add_metric([aid, "tokens"], ext.indexed_by_tokens_total)
            f["kvcp_vllm_blocks_indexed_total"].add_metric([aid, "engine_hash"], ext.indexed_by_engine_hash_total)
        if self.dataplane is not None:
            self._collect_handoffs(f)
        for device in self._gpu_devices:
            try:
                memory = memory_tier.gpu_memory_bytes(device)
            except Exception as exc:  # noqa: BLE001 - a CUDA error costs these series, not the scrape
                if device not in self._gpu_memory_failed:
                    self._gpu_memory_failed.add(device)
                    log.warning("cannot read the memory of %s for metrics: %s", device, exc)
                continue
            for kind, n in memory.items():
                f["kvcp_gpu_memory_bytes"].add_metric([aid, device, kind], n)
        return [*f.values(), self._durations.family()]

    def _collect_handoffs(self, f) -> None:
        aid, dp = self.agent_id, self.dataplane
        assert dp is not None  # called only with a data plane (collect)
        res = dp.reservations
        f["kvcp_handoff_reservations"].add_metric([aid], res.open_count())
        f["kvcp_handoff_reserved_bytes"].add_metric([aid], res.reserved_bytes())
        for outcome, n in (
            ("committed", res.committed_total),
            ("aborted", res.aborted_total),
            ("expired", res.expired_total),
        ):
            f["kvcp_handoff_reservations_ended_total"].add_metric([aid, outcome], n)
        f["kvcp_handoff_checksum_failures_total"].add_metric([aid], res.checksum_failures_total)
        f["kvcp_handoff_aborts_retried_total"].add_metric([aid], dp.aborts_retried_total)
        page = getattr(dp.store, "page_bytes", 1)
        f["kvcp_handoff_quarantined_bytes"].add_metric([aid], res.quarantined_pages() * page)
        f["kvcp_handoff_held_for_writers"].add_metric([aid], res.held_for_writers())
        f["kvcp_handoff_free_bytes"].add_metric([aid], max(0, dp.pool.reclaimable_bytes(dp.tier)))
        links = dp.links.all()
        f["kvcp_handoffs_outbound"].add_metric([aid, "inflight"], sum(link.inflight for link in links))
        f["kvcp_handoffs_outbound"].add_metric([aid, "queued"], sum(link.queued for link in links))
        for link in links:
            f["kvcp_link_throughput_bytes_per_second"].add_metric(
                [aid, link.peer_agent_id], link.throughput_bytes_per_second
            )
            f["kvcp_link_latency_seconds"].add_metric([aid, link.peer_agent_id], link.latency_seconds)


class AgentMetrics:
    """Every metric of one agent, in one injected registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        agent_id: str,
        pool,
        engine=None,
        link=None,
        mover=None,
        process: bool = True,
        vllm=None,
    ):
        self.registry = registry
        self.agent_id = agent_id
        const = {"agent_id": agent_id}
        self.collector = AgentCollector(agent_id, pool, engine, link, mover, vllm)
        registry.register(self.collector)
        registry.register(BuildInfoCollector("agent", const))
        if process:
            ProcessCollector(registry=registry)
        self.etcd = EtcdMetrics(registry, const)
        self.rpc = RpcMetricsInterceptor(registry, const)
        a = ("agent_id", "kind")
        self.transfers = Counter(
            "kvcp_transfers_total", "KV transfers to or from peer agents, by kind.", a, registry=registry
        )
        self.transfer_failures = Counter(
            "kvcp_transfer_failures_total", "KV transfers that failed on their first path.", a, registry=registry
        )
        self.transfer_fallbacks = Counter(
            "kvcp_transfer_fallbacks_total",
            "Failed transfers completed another way: a secondary path, or recompute by the engine.",
            (*a, "fallback"),
            registry=registry,
        )
        self.transfer_bytes = Counter(
            "kvcp_transfer_bytes_total", "Bytes of KV moved by transfers, by kind.", a, registry=registry
        )
        self.transfer_duration = Histogram(
            "kvcp_transfer_duration_seconds",
            "Duration of transfers, by kind (failed ones included).",
            a,
            registry=registry,
            buckets=DURATION_BUCKETS_SECONDS,
        )
        for kind in TRANSFER_KINDS:
            for m in (self.transfers, self.transfer_failures, self.transfer_bytes, self.transfer_duration):
                m.labels(agent_id, kind)
            for fb in TRANSFER_FALLBACKS:
                self.transfer_fallbacks.labels(agent_id, kind, fb)

    def record_transfer(self, kind: str, num_bytes: int, seconds: float, ok: bool, fallback: str = "") -> None:
        """One transfer finished: `ok` on its first path; `fallback` names how a failed
        one was completed instead ('secondary_path', 'recompute'), '' if it was not."""
        aid = self.agent_id
        self.transfers.labels(aid, kind).inc()
        self.transfer_duration.labels(aid, kind).observe(seconds)
        if ok or fallback == "secondary_path":
            self.transfer_bytes.labels(aid, kind).inc(num_bytes)
        if not ok:
            self.transfer_failures.labels(aid, kind).inc()
            if fallback:
                self.transfer_fallbacks.labels(aid, kind, fallback).inc()
