"""Wires one control-plane process: etcd client, election, membership watch, the
cluster state and the gRPC server (AdminService, AgentService, health, reflection).

Tests build `ControlPlane(ControlPlaneConfig(...))` in process with port 0; the
`kvcp-controlplane` console script (controlplane.main) builds the same thing."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from functools import partial

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from controlplane.api.admin_service import AdminServicer
from controlplane.api.agent_service import AgentServicer
from controlplane.api.lookup_socket import LookupSocketServer
from controlplane.core.clock import SteadyWallClock
from controlplane.core.cluster import Cluster
from controlplane.core.pins import pinned_bytes_of
from controlplane.manager import Manager
from controlplane.manager_policy import validate_policy
from controlplane.metrics import ControlPlaneMetrics, PinStats
from controlplane.store.durable import DurableStore
from controlplane.store.election import LeaderElection
from controlplane.store.membership import MembershipWatcher
from protos import etcd_keys
from protos.block_hash import BLOCK_HASH_BYTES
from protos.etcd_keys import EtcdAuth
from protos.grpc_errors import ErrorMappingInterceptor
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, agent_pb2, agent_pb2_grpc
from protos.lookup_wire import split_address
from protos.metrics import InstrumentedEtcd, MetricsServer, serve_metrics
from protos.security import ADMIN_SERVICE, TLSConfig, TokenAuthInterceptor, add_port, load_tokens, server_ssl_context
from protos.tier import Tier

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _pinned_blocks(u) -> list[tuple[bytes, int]]:
    """(block, pin tier) pairs an OpUpdate reports; none when the two lists disagree."""
    raw, tiers = u.pinned_block_hashes, list(u.pinned_tiers)
    if len(raw) != BLOCK_HASH_BYTES * len(tiers):
        return []
    valid = {int(t) for t in Tier}
    return [(raw[i * BLOCK_HASH_BYTES : (i + 1) * BLOCK_HASH_BYTES], t) for i, t in enumerate(tiers) if t in valid]


@dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    etcd: str = "127.0.0.1:2379"
    advertise: str = ""  # address others reach us at; defaults to the bound listen address
    election_ttl_seconds: int = 5
    membership_resync_seconds: float = 2.0
    etcd_wait_seconds: float = 30.0
    # each etcd call: under a client's deadline (kvctl: 5 s), so a write to an etcd that
    # does not answer is refused UNAVAILABLE ("etcd is unreachable") rather than timing out
    etcd_timeout_seconds: float = 2.0
    max_workers: int = 128
    op_timeout_seconds: float = 60.0
    admin_tokens_file: str = ""  # "ROLE TOKEN" lines; empty: the admin API is open
    agent_token: str = ""  # agents must present it; empty: open
    tls: TLSConfig | None = None  # server cert/key; with ca_file and require_client_cert: mTLS
    require_client_cert: bool = False
    etcd_auth: EtcdAuth | None = None
    policy_enabled: bool = True  # the automatic tier policy (decide) in the reconcile loop
    metrics_listen: str = ""  # /metrics HOST:PORT (port 0: any free one); "" serves none
    expected_blocks: int = 0  # distinct blocks to size the index for up front (0: grow as they come)
    lookup_listen: str = ""  # the lookup socket, HOST:PORT or unix:PATH; "" serves none


class ControlPlane:
    def __init__(self, config: ControlPlaneConfig, log_fn=None, registry: CollectorRegistry | None = None):
        self.config = config
        self._log_fn = log_fn or (lambda msg: log.warning(msg))
        # one clock for lookups, store stamps and the policy's `now` (a step of the host's
        # clock moves none of them: mixed, a step back ranked the blocks in use as the oldest)
        self.clock = SteadyWallClock()
        self.cluster = Cluster(clock=self.clock, expected_blocks=config.expected_blocks)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ControlPlaneMetrics(self.registry, self.cluster)
        self.metrics_server: MetricsServer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.etcd: InstrumentedEtcd | None = None
        self.election_etcd: InstrumentedEtcd | None = None
        self.election: LeaderElection | None = None
        self.server: grpc.Server | None = None
        self.lookup_socket: LookupSocketServer | None = None
        self.admin: AdminServicer | None = None
        self.port = 0

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
        return self.config.advertise or f"{host}:{self.port}"

    def _connect_etcd(self) -> InstrumentedEtcd:
        return InstrumentedEtcd(
            etcd_keys.connect(
                self.config.etcd,
                timeout_seconds=self.config.etcd_timeout_seconds,
                wait_seconds=self.config.etcd_wait_seconds,
                log=self._log_fn,
                auth=self.config.etcd_auth,
            ),
            self.metrics.etcd,
        )

    def start(self) -> ControlPlane:
        self._check_lookup_listen()  # bad flags fail before anything starts
        self.etcd = self._connect_etcd()
        tokens = load_tokens(self.config.admin_tokens_file) if self.config.admin_tokens_file else None
        self.auth = TokenAuthInterceptor(tokens, self.config.agent_token)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.config.max_workers, thread_name_prefix="cp-rpc"),
            interceptors=[self.auth, ErrorMappingInterceptor(), self.metrics.rpc],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # agents ping idle Sync streams to notice a paused or vanished leader
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        self.port = add_port(self.server, self.config.listen, self.config.tls, self.config.require_client_cert)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.listen} (port in use?)")
        # the election has its own etcd client: pyetcd marks a client's endpoint failed for
        # a second after any one call fails, and another thread's failed call must not
        # make the leader's lease refresh fail with it (a healthy leader gone read-only)
        self.election_etcd = self._connect_etcd()
        self.election = LeaderElection(self.election_etcd, self.address, self.config.election_ttl_seconds)
        self.metrics.leadership = self.election
        self.election.run_once()
        self.durable = DurableStore(self.etcd, self.election, self.config.etcd)
        self.manager = Manager(
            self.cluster,
            self.durable,
            self.election,
            self.etcd,
            op_timeout_seconds=self.config.op_timeout_seconds,
            policy_validator=validate_policy,
            clock=self.clock,
        )
        self.manager.on_finished = self.metrics.observe_operation
        self.manager.policy_enabled = self.config.policy_enabled
        if self.config.policy_enabled:
            self.cluster.on_lookup = self.manager.note_lookup
        self.metrics.collector.pins_source = self._pin_stats
        self.metrics.collector.operations_source = self.manager.operation_counts
        self.metrics.collector.policy_source = self.manager.policy_stats
        self.metrics.collector.etcd_data_lost_source = lambda: self.manager.etcd_resets_total
        self.metrics.collector.commands_resent_source = lambda: dict(self.manager.commands_resent_total)
        self.metrics.collector.auth_denied_source = lambda: self.auth.denied_total
        admin = self.admin = AdminServicer(self.cluster, self.election, self.metrics.lookup_duration)
        admin.manager = self.manager
        admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, self.server)
        if self.config.lookup_listen:
            self.lookup_socket = self._lookup_socket(admin)
            admin.lookup_address = self.lookup_socket.address
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentServicer(self.cluster, self.election, self._agent_key_exists, self._on_op_update, self.manager.clock),
            self.server,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
            agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        self.server.start()
        self.metrics_server = serve_metrics(self.config.metrics_listen, self.registry, self._log_fn)
        self.membership = MembershipWatcher(self.etcd, self.cluster, self.config.membership_resync_seconds)
        self._spawn("election", self._run_election)
        self._spawn("membership", self.membership.run_forever)
        self._spawn("reconcile", self.manager.run_forever)
        log.info("control plane serving on %s (leader=%s)", self.address, self.election.is_leader)
        return self

    def _check_lookup_listen(self) -> None:
        if self.config.lookup_listen:
            split_address(self.config.lookup_listen)  # ValueError naming the address

    def _lookup_socket(self, admin: AdminServicer) -> LookupSocketServer:
        lookup_method = ADMIN_SERVICE + "Lookup"

        def check_token(token: str):
            denial = self.auth.check(lookup_method, token)
            if denial is None:
                return None
            self.auth.count_denial()  # kvcp_auth_denied_total, as the gRPC services' refusals
            return denial[0].name, denial[1]

        frames = self.metrics.lookup_socket_frames
        return LookupSocketServer(
            self.config.lookup_listen,
            admin.answer_lookup,
            check_token,
            on_frame=lambda code: frames.labels(code=code).inc(),
            ssl_context=server_ssl_context(self.config.tls, self.config.require_client_cert),
        ).start()

    def _pin_stats(self) -> PinStats:
        pins = self.manager.list_pins()
        now = self.manager.clock()
        # each byte once: a namespace pinned twice, or a prefix inside a pinned namespace
        held = sum(
            pinned_bytes_of(pins, ns, now, partial(self.manager.cluster.namespace_bytes, ns))
            for ns in {p.namespace for p in pins}
        )
        return PinStats(len(pins), held)

    def _on_op_update(self, agent_id: str, u) -> None:
        self.manager.on_op_update(
            agent_id,
            u.op_id,
            u.state,
            u.num_done_blocks,
            u.num_total_blocks,
            u.num_failed_blocks,
            u.moved_bytes,
            u.error,
            u.num_skipped_pinned_blocks,
            {t.tier: (t.num_blocks, t.used_bytes) for t in u.freed},
            _pinned_blocks(u),
            u.result,
            list(u.peer_taken_bytes),
        )

    def _agent_key_exists(self, agent_id: str) -> bool:
        assert self.etcd is not None  # start() connects it before it serves the AgentService that asks
        value, _ = self.etcd.get(etcd_keys.agent_key(agent_id))
        return value is not None

    def _run_election(self, stop: threading.Event) -> None:
        election = self.election
        assert election is not None  # start() makes it before it spawns this loop
        while not stop.is_set():
            leading = election.run_once()
            status = health_pb2.HealthCheckResponse.SERVING if leading else health_pb2.HealthCheckResponse.NOT_SERVING
            self.health.set("kvcp.v1.AdminService", status)
            self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            stop.wait(max(self.config.election_ttl_seconds / 3.0, 0.2))

    def _spawn(self, name: str, target) -> None:
        t = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    @property
    def metrics_address(self) -> str:
        return self.metrics_server.address if self.metrics_server is not None else ""

    def wait(self) -> None:
        assert self.server is not None, "wait() is for a started ControlPlane"
        self.server.wait_for_termination()

    def stop(self, grace_seconds: float = 1.0) -> None:
        self._stop.set()
        if self.lookup_socket is not None:
            self.lookup_socket.stop()
        if self.server is not None:
            self.server.stop(grace_seconds).wait()
        if self.election is not None:
            self.election.resign()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for t in self._threads:
            t.join(timeout=2)
        for client in (self.etcd, self.election_etcd):
            if client is not None:
                client.close()
