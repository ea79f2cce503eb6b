"""Prometheus metrics of a control-plane replica.

Most values are read from the core state when Prometheus scrapes (`ClusterCollector`
calls `Cluster.stats()` and `Cluster.agents()`), so the ingest and lookup paths pay
nothing for them. What can only be seen in passing is measured where it happens: lookup
latency in the AdminService (`lookup_duration`), etcd requests in the store adapters
(`protos.metrics.InstrumentedEtcd`), RPC status codes in an interceptor.

Features that are not built yet report through hooks that default to "nothing yet":
`pins_source` (pin count and pinned bytes), `operations_source` (operations by kind and
state) and `observe_operation()` (durations of finished operations). Their families are
exported from the start, with zeros, so dashboards and alerts see them now."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controlplane.core.cluster import AgentState, Cluster
from protos.metrics import (
    DURATION_BUCKETS_SECONDS,
    LATENCY_BUCKETS_SECONDS,
    BuildInfoCollector,
    EtcdMetrics,
    RpcMetricsInterceptor,
)

AGENT_STATES = tuple(s.name.lower() for s in AgentState)
OPERATION_KINDS = ("move", "cleanup", "compress", "transfer", "drain")
OPERATION_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
# why a command was sent again (kvcp_commands_resent_total's cause): lost with the agent's
# stream that closed under this leader; lost with the leader that sent it (an operation
# adopted from another replica); or sent by this replica before it lost the leadership and
# won it again (the agent's answer may have gone to a leader between, which kept none)
COMMAND_LOST_WITH_STREAM = "stream_closed"
COMMAND_LOST_WITH_LEADER = "leader_changed"
COMMAND_ASKED_ON_WINNING_AGAIN = "leader_won_again"
RESEND_CAUSES = (COMMAND_LOST_WITH_STREAM, COMMAND_LOST_WITH_LEADER, COMMAND_ASKED_ON_WINNING_AGAIN)
# what a lookup-socket frame is answered with (others, rarer, appear when they happen)
LOOKUP_SOCKET_CODES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE", "UNAUTHENTICATED", "FAILED_PRECONDITION")


@dataclass(frozen=True)
class PinStats:
    num_pins: int = 0
    pinned_bytes: int = 0


@dataclass(frozen=True)
class PolicyStats:
    """The tier-policy pass (Manager.policy_pass)."""

    passes_total: int = 0
    agents_decided_total: int = 0
    actions_total: int = 0
    last_pass_seconds: float = 0.0
    reuse_credit_turnovers: float = 0.0
    recent_first: bool = False
    lookups_dropped_total: int = 0
    lookup_history_blocks: int = 0  # blocks whose lookups the policy remembers (AccessStats)
    shadow_cache_blocks: int = 0  # blocks in the credit tuner's shadow caches, all of them


class ClusterCollector:
    """Cluster state at scrape time. `leadership` has is_leader, epoch (LeaderElection)."""

    def __init__(
        self,
        cluster: Cluster,
        leadership=None,
        pins_source: Callable[[], PinStats] | None = None,
        operations_source: Callable[[], Mapping[tuple[str, str], int]] | None = None,
        policy_source: Callable[[], PolicyStats] | None = None,
    ):
        self._cluster = cluster
        self._leadership = leadership
        self.pins_source = pins_source
        self.operations_source = operations_source
        self.policy_source = policy_source
        self.etcd_data_lost_source: Callable[[], int] | None = None  # Manager.etcd_resets_total
        self.auth_denied_source: Callable[[], int] | None = None  # TokenAuthInterceptor.denied_total
        # Manager.commands_resent_total: cause -> commands sent again
        self.commands_resent_source: Callable[[], Mapping[str, int]] | None = None

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        g, c = GaugeMetricFamily, CounterMetricFamily
        specs = [
            (g, "kvcp_controlplane_is_leader", "1 if this replica is the leader now, else 0.", []),
            (g, "kvcp_controlplane_serving_stale", "1 while a leader cut off from etcd answers from memory.", []),
            (
                g,
                "kvcp_controlplane_serving",
                "1 on the replica that answers for the cluster: the leader, or the leader cut off from etcd "
                "serving from memory (filter per-agent and cluster panels by it).",
                [],
            ),
            (g, "kvcp_controlplane_epoch", "Epoch (leader key create revision) of the leader this replica knows.", []),
            (g, "kvcp_agents", "Registered agents by sync state.", ["state"]),
            (
                g,
                "kvcp_agent_state",
                "Sync state of each registered agent (1 for its current state).",
                ["agent_id", "state"],
            ),
            (
                g,
                "kvcp_agent_cordoned",
                "1 while the agent is cordoned (kvctl cordon: Lookup and Route leave it out), else 0.",
                ["agent_id"],
            ),
            (g, "kvcp_agent_indexed_blocks", "Blocks the index holds for each agent.", ["agent_id"]),
            (
                g,
                "kvcp_agent_last_seen_timestamp_seconds",
                "Unix time of the last message from each agent.",
                ["agent_id"],
            ),
            (g, "kvcp_index_blocks", "Distinct blocks in the global index.", []),
            (
                g,
                "kvcp_index_block_replicas",
                "Block copies in the global index (a block on two agents counts twice).",
                [],
            ),
            (c, "kvcp_lookups_total", "Prefix lookups answered.", []),
            (c, "kvcp_lookup_tokens_total", "Tokens asked about in lookups.", []),
            (c, "kvcp_lookup_hit_tokens_total", "Tokens of the best agent's cached prefix, summed over lookups.", []),
            (c, "kvcp_block_events_total", "Block events (stored/removed blocks) ingested from agents.", []),
            (c, "kvcp_resyncs_total", "Full inventories asked of agents after a gap in their event sequence.", []),
            (g, "kvcp_pins", "Pins in force.", []),
            (
                c,
                "kvcp_etcd_data_lost_total",
                "Times this replica won an election in an etcd whose revisions went back (it lost its data) and "
                "wrote its pins and policy back from memory.",
                [],
            ),
            (g, "kvcp_pinned_bytes", "Bytes of KV cache held by pins.", []),
            (
                c,
                "kvcp_commands_resent_total",
                "Operation commands this replica sent an agent again because they were lost before the agent "
                "answered: with the agent's stream that closed (stream_closed), or with the leader that sent them "
                "(leader_changed: an adopted operation's command, kept in etcd); or sent by this replica before it "
                "lost the leadership and won it again, an answer given meanwhile possibly lost (leader_won_again).",
                ["cause"],
            ),
            (g, "kvcp_operations", "Operations known to the control plane by kind and state.", ["kind", "state"]),
            (c, "kvcp_policy_passes_total", "Tier-policy passes run by this replica.", []),
            (c, "kvcp_policy_agents_decided_total", "Agents the tier-policy passes decided for.", []),
            (c, "kvcp_policy_actions_total", "Commands the tier-policy passes sent to agents.", []),
            (g, "kvcp_policy_pass_seconds", "Duration of the latest tier-policy pass.", []),
            (
                c,
                "kvcp_policy_lookups_dropped_total",
                "Lookups the tier policy did not count as reuse evidence: its queue (100,000) was full.",
                [],
            ),
            (c, "kvcp_auth_denied_total", "Calls refused for a missing or wrong token.", []),
            (
                g,
                "kvcp_policy_reuse_credit_turnovers",
                "Reuse credit (turnovers of stay per reuse) of the latest pass that decided: tuned or set.",
                [],
            ),
            (
                g,
                "kvcp_policy_evidence_blocks",
                "Blocks the tier policy keeps evidence for, by kind: lookup_history (at most 2,097,152, "
                "~230 B each) and shadow_caches (the credit tuner's five, each at most 262,144, ~110 B a block).",
                ["kind"],
            ),
            (
                g,
                "kvcp_policy_recent_first",
                "1 while passes evict the most recently used first (lookups loop over more than the cache holds).",
                [],
            ),
        ]
        return {name: kind(name, doc, labels=labels) for kind, name, doc, labels in specs}

    def describe(self):
        return list(self._families().values())

    def collect(self):
        f = self._families()
        lead = self._leadership
        f["kvcp_controlplane_is_leader"].add_metric([], 1 if lead is not None and lead.is_leader else 0)
        stale = lead is not None and getattr(lead, "serving_from_memory", False)
        f["kvcp_controlplane_serving_stale"].add_metric([], 1 if stale else 0)
        # the leader cut off from etcd still answers lookups (flagged stale): its view of the
        # agents is the cluster's, and panels filtered by it must not go empty meanwhile
        leading = lead is not None and (lead.is_leader or stale)
        f["kvcp_controlplane_serving"].add_metric([], 1 if leading else 0)
        f["kvcp_controlplane_epoch"].add_metric([], lead.epoch if lead is not None else 0)
        stats = self._cluster.stats()
        by_state = dict.fromkeys(AGENT_STATES, 0)
        # per-agent series come from the serving replica only: a deposed replica keeps its
        # records (disconnected) until the agents' leases go, and alerts would fire on them
        for rec, num_blocks in self._cluster.agents():
            state = rec.state.name.lower()
            by_state[state] += 1
            if not leading:
                continue
            for s in AGENT_STATES:
                f["kvcp_agent_state"].add_metric([rec.agent_id, s], 1 if s == state else 0)
            f["kvcp_agent_cordoned"].add_metric([rec.agent_id], 1 if self._cluster.cordon_reason(rec.agent_id) else 0)
            f["kvcp_agent_indexed_blocks"].add_metric([rec.agent_id], num_blocks)
            f["kvcp_agent_last_seen_timestamp_seconds"].add_metric([rec.agent_id], rec.last_seen_unix_seconds)
        for s, n in by_state.items():
            f["kvcp_agents"].add_metric([s], n)
        f["kvcp_index_blocks"].add_metric([], stats.num_blocks)
        f["kvcp_index_block_replicas"].add_metric([], stats.num_block_replicas)
        f["kvcp_lookups_total"].add_metric([], stats.lookups_total)
        f["kvcp_lookup_tokens_total"].add_metric([], stats.lookup_tokens_total)
        f["kvcp_lookup_hit_tokens_total"].add_metric([], stats.lookup_hit_tokens_total)
        f["kvcp_block_events_total"].add_metric([], stats.events_total)
        f["kvcp_resyncs_total"].add_metric([], stats.resyncs_total)
        pins = self.pins_source() if self.pins_source else PinStats()
        f["kvcp_pins"].add_metric([], pins.num_pins)
        f["kvcp_etcd_data_lost_total"].add_metric([], self.etcd_data_lost_source() if self.etcd_data_lost_source else 0)
        f["kvcp_pinned_bytes"].add_metric([], pins.pinned_bytes)
        resent = dict(self.commands_resent_source()) if self.commands_resent_source else {}
        for cause in RESEND_CAUSES:
            f["kvcp_commands_resent_total"].add_metric([cause], resent.get(cause, 0))
        ops = dict(self.operations_source()) if self.operations_source else {}
        for kind in OPERATION_KINDS:
            for state in OPERATION_STATES:
                f["kvcp_operations"].add_metric([kind, state], ops.pop((kind, state), 0))
        for (kind, state), n in sorted(ops.items()):  # a kind added later still shows
            f["kvcp_operations"].add_metric([kind, state], n)
        policy = self.policy_source() if self.policy_source else PolicyStats()
        f["kvcp_policy_passes_total"].add_metric([], policy.passes_total)
        f["kvcp_policy_agents_decided_total"].add_metric([], policy.agents_decided_total)
        f["kvcp_policy_actions_total"].add_metric([], policy.actions_total)
        f["kvcp_policy_pass_seconds"].add_metric([], policy.last_pass_seconds)
        f["kvcp_policy_lookups_dropped_total"].add_metric([], policy.lookups_dropped_total)
        f["kvcp_auth_denied_total"].add_metric([], self.auth_denied_source() if self.auth_denied_source else 0)
        f["kvcp_policy_reuse_credit_turnovers"].add_metric([], policy.reuse_credit_turnovers)
        f["kvcp_policy_recent_first"].add_metric([], 1 if policy.recent_first else 0)
        f["kvcp_policy_evidence_blocks"].add_metric(["lookup_history"], policy.lookup_history_blocks)
        f["kvcp_policy_evidence_blocks"].add_metric(["shadow_caches"], policy.shadow_cache_blocks)
        return list(f.values())


class ControlPlaneMetrics:
    """Every metric of one control-plane replica, in one injected registry."""

    def __init__(self, registry: CollectorRegistry, cluster: Cluster, leadership=None, process: bool = True):
        self.registry = registry
        self.collector = ClusterCollector(cluster, leadership)
        registry.register(self.collector)
        registry.register(BuildInfoCollector("controlplane"))
        if process:
            ProcessCollector(registry=registry)
        self.etcd = EtcdMetrics(registry)
        self.rpc = RpcMetricsInterceptor(registry)
        self.lookup_duration = Histogram(
            "kvcp_lookup_duration_seconds",
            "Time to answer a prefix lookup in the AdminService (answered lookups).",
            registry=registry,
            buckets=LATENCY_BUCKETS_SECONDS,
        )
        self.lookup_socket_frames = Counter(
            "kvcp_lookup_socket_frames_total",
            "Frames answered on the lookup socket (--lookup-listen), by status code (OK when answered).",
            ("code",),
            registry=registry,
        )
        for code in LOOKUP_SOCKET_CODES:  # exported at 0 from the start, as every family here
            self.lookup_socket_frames.labels(code=code)
        self.operation_duration = Histogram(
            "kvcp_operation_duration_seconds",
            "Duration of finished operations, by kind and final state.",
            ("kind", "state"),
            registry=registry,
            buckets=DURATION_BUCKETS_SECONDS,
        )
        for kind in OPERATION_KINDS:
            for state in ("succeeded", "failed", "cancelled"):
                self.operation_duration.labels(kind=kind, state=state)

    @property
    def leadership(self):
        return self.collector._leadership

    @leadership.setter
    def leadership(self, value) -> None:
        self.collector._leadership = value

    def observe_operation(self, kind: str, state: str, seconds: float) -> None:
        """An operation finished (state: succeeded, failed or cancelled)."""
        self.operation_duration.labels(kind=kind, state=state.lower()).observe(seconds)
