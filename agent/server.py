"""Wires one agent process: tiers and block pool, the engine API (in process and over
gRPC), etcd registration under a lease, and the control-plane link.

Tests build `Agent(AgentConfig(...))` in process with port 0; the `kvcp-agent` console
script (agent.main) builds the same thing."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from agent.api.dataplane_service import DataPlaneServicer
from agent.api.engine_service import EngineServicer
from agent.api.sync_client import ControlPlaneLink, tier_usage_pb
from agent.api.vllm_events import VllmEventSubscriber
from agent.core.block_pool import BlockPool
from agent.core.engine_api import ENGINE_MESSAGE_BYTES, KVEngineAPI
from agent.core.handoff import VERIFIES_PER_HANDOFF
from agent.core.model_spec import ModelSpec
from agent.core.mover import Mover
from agent.core.vllm_events import ExternalBlocks
from agent.dataplane import DataPlane, DataPlaneConfig, etcd_cordons, etcd_peer_info
from agent.metrics import AgentMetrics
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier, cuda_available
from agent.store.pin_file import PinFile
from agent.store.registry import EtcdRegistration
from agent.store.transfer_engine import open_engine
from protos import etcd_keys
from protos.etcd_keys import EtcdAuth
from protos.grpc_errors import ErrorMappingInterceptor
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2
from protos.metrics import InstrumentedEtcd, MetricsServer, serve_metrics
from protos.security import PEER_METHODS, TLSConfig, TokenAuthInterceptor, add_port
from protos.tier import Tier

log = logging.getLogger(__name__)
PIN_SAVE_SPACING_SECONDS = 0.2  # pin-table saves are at most this often (a burst of commands is one)
COMPACT_IDLE_SECONDS = 1.0  # the disk tier's fragmentation is looked at this often while no compaction runs

DEMO_MODEL = ModelSpec("demo-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
MAX_MESSAGE_BYTES = ENGINE_MESSAGE_BYTES
RPC_WORKERS = 16  # gRPC workers for the engine's and peers' calls (handoff verifies get their own on top)


@dataclass
class AgentConfig:
    agent_id: str
    listen: str = "127.0.0.1:50061"
    etcd: str = "127.0.0.1:2379"
    controlplane: str = ""  # empty: follow the leader key in etcd
    advertise: str = ""
    models: list[ModelSpec] = field(default_factory=lambda: [DEMO_MODEL])
    gpu_capacity_bytes: int = 0  # used only when CUDA is present
    gpu_device: int = 0  # the CUDA device of this agent's GPU tier (one agent per GPU)
    cpu_capacity_bytes: int = 64 * 1024 * 1024
    disk_dir: str = ""  # empty: no disk tier
    disk_capacity_bytes: int = 0
    disk_fsync: bool = False
    tier_codecs: dict[Tier, str] = field(default_factory=dict)  # codec applied on entering a tier
    controlplane_token: str = ""  # presented to the control plane (its --agent-token-file)
    engine_token: str = ""  # asked of the engine's calls (EngineService, Handoff); "" leaves them open
    tls: TLSConfig | None = None  # cert/key: TLS on the engine listener and mTLS to the CP; ca: verify the CP
    tls_client_ca: str = ""  # with tls: the listener requires client certificates signed by it (mTLS)
    page_bytes: int = 0  # memory-tier page; 0: 1/16 of the smallest block, at least 1 KiB
    lease_ttl_seconds: int = 10
    stats_interval_seconds: float = 1.0
    etcd_wait_seconds: float = 30.0
    etcd_auth: EtcdAuth | None = None  # TLS files and user/password for etcd (as the control plane's)
    metrics_listen: str = ""  # /metrics HOST:PORT (port 0: any free one); "" serves none
    vllm_kv_events: str = ""  # a vLLM engine's KV event PUB endpoint (tcp://host:port); "" none
    vllm_kv_events_replay: str = ""  # its replay ROUTER endpoint, for gaps; "" none
    vllm_kv_events_topic: str = ""
    vllm_model_id: str = ""  # the model its blocks are indexed under; "" the first model
    vllm_disconnect_grace_seconds: float = 30.0  # its connection down this long: its blocks are forgotten
    vllm_kv_group: int = 0  # the engine's KV cache group indexed (hybrid models: others are left out)
    vllm_index_by: str = "tokens"  # the hash its blocks are indexed under (agent.core.vllm_events.INDEX_BY)
    role: str = ""  # prefill | decode | both ("" = both): what a router may send here
    # data plane for handoffs: mooncake | none (shm and the gRPC fallback only) | auto:
    # mooncake, unless the agent has an agent token (the engine's own port takes none)
    transfer_engine: str = "auto"
    transfer_protocol: str = "tcp"  # the engine's transport: tcp | rdma
    rdma_devices: str = ""  # the RDMA NICs the engine uses, comma separated ("": it discovers them)
    transfer_metadata: str = "P2PHANDSHAKE"  # or etcd://host:port (the engine's own metadata)
    shm_handoff: bool = True  # the CPU slab in shared memory for same-host handoff (pinned in place with CUDA)
    codec_threads: int = 2  # threads that encode blocks while a move writes the ones before
    dataplane: DataPlaneConfig = field(default_factory=DataPlaneConfig)


class Agent:
    def __init__(self, config: AgentConfig, log_fn=None, registry: CollectorRegistry | None = None):
        if config.engine_token and not config.controlplane_token:
            # peers write blocks through the DataPlane (Reserve/Push/Commit) with the agent
            # token: without one, any caller could put KV under a prompt's hashes that the
            # guarded engine then loads
            raise ValueError(
                "an engine token (--engine-token-file) guards the engine API, but without an agent token "
                "(--token-file) anyone can write blocks into this agent through the peer DataPlane: give both"
            )
        self.config = config
        self._log_fn = log_fn or (lambda msg: log.warning(msg))
        if config.controlplane_token and not config.engine_token:
            # its handoffs carry the agent token: KV anyone stores here reaches guarded peers
            self._log_fn(
                f"agent {config.agent_id}: an agent token and no engine token (--engine-token-file): its engine "
                "API is open, and what anyone stores here its handoffs carry to agents that guard theirs"
            )
        page = config.page_bytes or max(1024, min(m.block_bytes for m in config.models) // 16)
        tiers: list[MemoryTier | DiskTier] = []
        if config.gpu_capacity_bytes and cuda_available():
            try:
                tiers.append(MemoryTier(Tier.GPU, config.gpu_capacity_bytes, page, device=f"cuda:{config.gpu_device}"))
            except torch.OutOfMemoryError as exc:
                raise ValueError(
                    f"--gpu-capacity {config.gpu_capacity_bytes} B does not fit on cuda:{config.gpu_device}: "
                    f"{str(exc).splitlines()[0]}"
                ) from None
        tiers.append(MemoryTier(Tier.CPU, config.cpu_capacity_bytes, page, shared=config.shm_handoff))
        self.disk: DiskTier | None = None
        self.pin_file: PinFile | None = None
        if config.disk_dir:
            self.disk = DiskTier(config.disk_dir, config.disk_capacity_bytes or 1 << 30, fsync=config.disk_fsync)
            tiers.append(self.disk)
        self.pool = BlockPool(tiers, config.models, tier_codecs=config.tier_codecs, codec_threads=config.codec_threads)
        if self.disk is not None:
            found, corrupt = self.disk.scan()
            adopted = self.pool.recover(self.disk, found)
            self.pool.corrupt_blocks_total += corrupt
            unserved = self.pool.num_unserved_parked_blocks
            log.info(
                "disk tier %s: recovered %d blocks, %d more waiting for their prefix to be stored again, "
                "%d parked for their model (not served as they were written) (%d corrupt removed)",
                config.disk_dir,
                adopted,
                self.pool.num_parked_blocks - unserved,
                unserved,
                corrupt,
            )
            # the pins held before the restart protect what the disk kept from the first store on
            self.pin_file = PinFile(config.disk_dir)
            before = self.disk.claim(config.agent_id)
            if before and before != config.agent_id:
                # its blocks are content-addressed and checked (kept); its pins were another
                # agent's (some scoped to it), so the control plane sends this one its own
                log.warning(
                    "disk tier %s was used by agent %r: %d of its blocks adopted (%d more wait for their prefix, "
                    "%d parked for their model), its pins file not loaded",
                    config.disk_dir,
                    before,
                    adopted,
                    self.pool.num_parked_blocks - unserved,
                    unserved,
                )
                self.pin_file.save([], time.monotonic(), time.time())  # nor at this agent's next start
            else:
                with self.pool.lock:
                    for pin in self.pin_file.load():
                        self.pool.pins.add(pin)
        self.mover = Mover(self.pool)
        self.engine = KVEngineAPI(self.pool, config.models, self.mover)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.server: grpc.Server | None = None
        self.registration: EtcdRegistration | None = None
        self.etcd: InstrumentedEtcd | None = None
        self.port = 0
        self.link = ControlPlaneLink(
            self.info, self.pool, self.engine, self._controlplane_address, config.stats_interval_seconds, self.mover
        )
        self.link.token, self.link.tls = config.controlplane_token, config.tls
        self.link.etcd_leader = self._etcd_leader
        self._pins_dirty = threading.Event()
        if self.pin_file is not None:
            self.link.on_pins_changed = self._pins_dirty.set  # saved by the pin-saver thread
            for pin in list(self.pool.pins.pins.values()):  # restored: up to their tier again
                if not pin.block_hashes and pin.namespace:
                    self.link.raise_to_pin(pin.namespace, pin.tier)
        self.vllm_events: VllmEventSubscriber | None = None
        if config.vllm_kv_events:
            model_id = config.vllm_model_id or config.models[0].model_id
            specs = {m.model_id: m for m in config.models}
            if model_id not in specs:
                raise ValueError(f"--vllm-model-id {model_id!r} is not one of this agent's models (--model)")
            if len(specs) > 1:
                # vLLM's block hashes do not name the model: a lookup of another model this
                # agent serves would match the engine's blocks
                raise ValueError(
                    f"an agent indexing a vLLM engine's KV events serves that engine's one model "
                    f"({model_id!r}), not {len(specs)} (--model): vLLM's block hashes do not name the model"
                )
            self.link.external = ExternalBlocks(
                self.pool, model_id, specs[model_id].block_size, index_by=config.vllm_index_by
            )
            self.vllm_events = VllmEventSubscriber(
                config.vllm_kv_events,
                self.link.external,
                config.vllm_kv_events_replay,
                config.vllm_kv_events_topic,
                disconnect_grace_seconds=config.vllm_disconnect_grace_seconds,
                group=config.vllm_kv_group,
            )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AgentMetrics(
            self.registry, config.agent_id, self.pool, self.engine, self.link, self.mover, vllm=self.vllm_events
        )
        self.metrics_server: MetricsServer | None = None
        host = (config.advertise or config.listen).rpartition(":")[0] or "127.0.0.1"
        engine_kind = config.transfer_engine
        if engine_kind == "auto":
            engine_kind = "none" if config.controlplane_token else "mooncake"
        if config.controlplane_token and engine_kind == "mooncake":
            self._log_fn(
                f"agent {config.agent_id}: --transfer-engine mooncake: the engine's own port takes no token "
                "and reaches this agent's whole CPU slab (reads and writes): give it a network only the agents reach"
            )
        if config.transfer_engine == "auto" and engine_kind == "none":
            backend = open_engine(
                "none",
                reason="the agent has an agent token and the Mooncake engine's port takes none "
                "(--transfer-engine mooncake to use it anyway, on a network only the agents reach)",
            )
        else:
            backend = open_engine(
                engine_kind, host, config.transfer_protocol, config.transfer_metadata, config.rdma_devices
            )
        if not backend.available:
            paths = "shared memory (same host) and the gRPC path" if config.shm_handoff else "the gRPC path only"
            self._log_fn(f"agent {config.agent_id}: handoffs use {paths}, no transfer engine: {backend.status}")
        self.dataplane = DataPlane(
            config.agent_id,
            self.pool,
            backend,
            config.dataplane,
            lambda a: etcd_peer_info(self.etcd)(a),
            self.metrics,
            lambda: etcd_cordons(self.etcd)(),
        )
        self.dataplane.tls = config.tls
        self.dataplane.token = config.controlplane_token
        self.link.dataplane = self.dataplane
        self.metrics.collector.dataplane = self.dataplane

    @property
    def agent_id(self) -> str:
        return self.config.agent_id

    @property
    def address(self) -> str:
        host = self.config.listen.rpartition(":")[0] or "127.0.0.1"
        return self.config.advertise or f"{host}:{self.port}"

    @property
    def metrics_address(self) -> str:
        if self.metrics_server is None:
            return ""
        host = self.metrics_server.host
        if host in ("", "0.0.0.0", "::"):  # bound to all interfaces: peers use our advertised host
            host = self.address.rpartition(":")[0]
        return f"{host}:{self.metrics_server.port}"

    def _expire_parked(self, stop: threading.Event) -> None:
        """Recovered blocks still waiting for their prefix after PARKED_SECONDS are freed."""
        while self.pool.num_parked_blocks and not stop.wait(10.0):
            self.pool.free_parked(expired_only=True)

    def _compact_disk(self, stop: threading.Event) -> None:
        """Compact the disk tier's free space in bounded steps while its longest free run
        is shorter than its biggest block (agent.core.compaction): a step right after one
        that moved blocks, else a look every COMPACT_IDLE_SECONDS."""
        while not stop.wait(COMPACT_IDLE_SECONDS):
            try:
                moved_bytes = self.pool.compact_disk()
                while moved_bytes and not stop.wait(0.01):  # more to do: the next step at once
                    moved_bytes = self.pool.compact_disk()
            except Exception:  # noqa: BLE001 - a failed step leaves every block where it was; tried again later
                log.exception("disk tier compaction failed")

    def _pin_saver(self, stop: threading.Event) -> None:
        """Save the pin table after pin commands, at most every PIN_SAVE_SPACING_SECONDS: a
        burst of commands (a thousand pins re-sent after a restart) is one write, where a
        write per command rewrote the whole file each time (O(n^2); 3,000 pins kept an
        agent at a full core for minutes and its operations waited behind it). The pins
        stand in memory at once; the file is what a restart without a control plane reads."""
        while not stop.is_set():
            if not self._pins_dirty.wait(0.5):
                continue
            self._pins_dirty.clear()
            try:
                self._save_pins()
            except OSError as exc:  # the pins stand in memory; saved again in a second
                log.warning("could not save the pin table (retried): %s", exc)
                self._pins_dirty.set()
                stop.wait(1.0)
            stop.wait(PIN_SAVE_SPACING_SECONDS)

    def _save_pins(self) -> None:
        with self.pool.lock:
            pins = list(self.pool.pins.pins.values())
            monotonic_now, unix_now = self.pool.pins.clock(), time.time()
        assert self.pin_file is not None  # saved only by an agent with a pin file (a disk tier)
        self.pin_file.save(pins, monotonic_now, unix_now)

    def info(self) -> types_pb2.AgentInfo:
        info = types_pb2.AgentInfo(
            agent_id=self.agent_id,
            address=self.address,
            metrics_address=self.metrics_address,
            models=[
                types_pb2.ModelSpec(
                    model_id=m.model_id,
                    block_size=m.block_size,
                    num_layers=m.num_layers,
                    num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim,
                    dtype=m.dtype,
                )
                for m in self.config.models
            ],
            tiers=tier_usage_pb(self.pool),
            lease_id=self.registration.lease.id if self.registration and self.registration.lease else 0,
            role=self.config.role or "both",
        )
        self.dataplane.fill_info(info)
        return info

    def _controlplane_address(self) -> str:
        if self.config.controlplane:
            return self.config.controlplane
        assert self.registration is not None  # start() registers before the link asks
        return self.registration.leader_address()

    def _etcd_leader(self) -> tuple[str, int]:
        """The leader and epoch etcd itself names (("", 0) without etcd)."""
        return self.registration.leader() if self.registration is not None else ("", 0)

    def start(self) -> Agent:
        # peers' DataPlane calls (handoffs into this agent's memory) must carry the agent
        # token when there is one; the engine's calls the engine token when there is one
        auth = TokenAuthInterceptor(
            None, self.config.controlplane_token, agent_services=PEER_METHODS, engine_token=self.config.engine_token
        )
        # the engine's and peers' calls, plus room for the verifies of every handoff arriving
        # at once (each holds up to LandedGroups.max_pending workers while its bytes hash at
        # low priority): those never take the workers the engine's lookups and loads need
        workers = RPC_WORKERS + VERIFIES_PER_HANDOFF * self.dataplane.config.max_inbound
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-rpc"),
            interceptors=[auth, ErrorMappingInterceptor(), self.metrics.rpc],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        listener_tls = self.config.tls
        if listener_tls is not None and self.config.tls_client_ca:
            listener_tls = TLSConfig(listener_tls.cert_file, listener_tls.key_file, self.config.tls_client_ca)
        self.port = add_port(self.server, self.config.listen, listener_tls, bool(self.config.tls_client_ca))
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.listen} (port in use?)")
        agent_pb2_grpc.add_EngineServiceServicer_to_server(EngineServicer(self.engine), self.server)
        agent_pb2_grpc.add_DataPlaneServicer_to_server(DataPlaneServicer(self.dataplane, self.engine), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (
                agent_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
                agent_pb2.DESCRIPTOR.services_by_name["DataPlane"].full_name,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.server.start()
        self.metrics_server = serve_metrics(self.config.metrics_listen, self.registry, self._log_fn)
        # the engine is served from here on, whether or not etcd and the control plane are up
        self.etcd = InstrumentedEtcd(
            etcd_keys.connect(
                self.config.etcd,
                wait_seconds=self.config.etcd_wait_seconds,
                log=self._log_fn,
                auth=self.config.etcd_auth,
            ),
            self.metrics.etcd,
        )
        self.registration = EtcdRegistration(
            self.etcd,
            self.agent_id,
            lambda: json_format.MessageToJson(self.info(), indent=None),
            self.config.lease_ttl_seconds,
        )
        self.registration.register_at_start()
        self._spawn("etcd-keepalive", self.registration.run_forever)
        self._spawn("cp-link", self.link.run_forever)
        if self.vllm_events is not None:
            self._spawn("vllm-events", self.vllm_events.run_forever)
        self._spawn("mover", self.mover.run_forever)
        if self.pin_file is not None:
            self._spawn("pin-saver", self._pin_saver)
        if self.pool.num_parked_blocks:
            self._spawn("parked-expiry", self._expire_parked)
        if Tier.DISK in self.pool.store_of:
            self._spawn("disk-compaction", self._compact_disk)
        self._spawn("dataplane", self.dataplane.run_forever)
        log.info("agent %s serving on %s", self.agent_id, self.address)
        return self

    def _spawn(self, name: str, target) -> None:
        t = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self.link.request_reconnect()
        if deregister and self.registration is not None:
            self.registration.deregister()
        if self.server is not None:
            self.server.stop(0.5).wait()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for t in self._threads:
            t.join(timeout=3)
        if self.pin_file is not None and self._pins_dirty.is_set():
            with contextlib.suppress(OSError):
                self._save_pins()  # the last commands' pins, not yet saved by the thread
        self.dataplane.close()
        self.pool.close()
        for store in self.pool.store_of.values():
            if isinstance(store, MemoryTier):
                store.close()
        if self.disk is not None:
            self.disk.close()
        if self.etcd is not None:
            self.etcd.close()
