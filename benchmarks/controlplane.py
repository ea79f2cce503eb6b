"""`kvcp-bench controlplane`: the control plane under a fleet's block events and lookups.

Everything is real and on loopback: an etcd (started here unless --etcd is given), one
control plane (`ControlPlane`, its own process), simulated agents in separate processes
(each process drives several agents, each on its own gRPC channel and Sync stream:
Register, Hello, an empty inventory, then sequence-numbered event batches of packed
hashes), and a lookup client process issuing AdminService Lookups of `lookup_blocks`-block
prefixes at a fixed offered rate. Measured:

- `events_per_second`: block events the control plane ingested (its own `events_total`,
  polled) from the moment every agent starts streaming until the last is counted, the
  index growing from empty (table rebuilds included); `events_per_second_steady`: then
  each agent removes `churn_fraction` of its blocks and stores as many new ones (the
  index keeps its size);
- `lookup_p50_ms` / `lookup_p99_ms` / `lookup_qps`: client-side latency of Lookup (a gRPC
  round trip, Python on both ends) against the full index, at the offered rate, after
  ingest; `lookup_server_*`: the same lookups timed inside the control plane
  (Cluster.lookup); `rpc_floor_*`: a health check at the same rate, the round trip with
  nothing behind it; the same during ingest under `lookup_during_ingest_*`;
- `lookup_socket_*`: the same lookups, same rate, over the lookup socket
  (`--lookup-listen`: length-prefixed protobuf on TCP, no gRPC) — client side, and
  `lookup_socket_server_*` inside the control plane; `lookup_index_*`: the index's part
  (BlockIndex.prefix_holders) of the lookups after ingest;
- `bytes_per_replica`: the control-plane process's RSS growth over the ingest / replicas;
- `resync_seconds`: one agent's full inventory (`blocks_per_agent` blocks, 64 Ki-block
  chunks) from its Hello to the index showing it.

Peers in the same run (each in a fresh process, same blocks and lookups, in process): the
kvcp BlockIndex itself, NVIDIA Dynamo's RadixTree (`ai-dynamo-runtime`) fed the JSON
events its KV router consumes, and Mooncake's master (`mooncake_master`) driven by its
store client (batched existence checks and batched puts of the same number of keys). A
peer that is not installed or does not start is reported `unavailable` with the reason.

Block hashes are synthetic but fixed: key (agent, position) -> two splitmix64 words, so
any process regenerates any agent's chain without shipping it. A `shared_fraction` of each
agent's blocks are chains every agent holds (system prompts); the rest are its own.
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

MODEL_ID = "bench-model"
BLOCK_SIZE = 16
INVENTORY_CHUNK_BLOCKS = 65536
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class BenchConfig:
    agents: int = 64
    blocks_per_agent: int = 1_000_000
    lookup_blocks: int = 128
    event_batch_blocks: int = 1024
    agent_processes: int = 4
    lookup_rate: float = 200.0  # offered lookups per second
    lookup_seconds: float = 10.0
    shared_fraction: float = 0.1
    etcd: str = ""  # empty: start one on free loopback ports
    peers: bool = True
    peer_blocks: int = 2_000_000  # events fed to each in-process peer (memory: Dynamo is large)
    peer_batch_blocks: int = 128  # blocks per event for the in-process peers (Dynamo's JSON events)
    mooncake_keys: int = 1_000_000
    policy_loop: bool = False  # the control plane's tier-policy pass (manager.policy_pass)
    churn_fraction: float = 0.1  # steady-state phase: each agent replaces this share of its blocks
    expected_blocks: int = 0  # the control plane's index sized for this many blocks at start
    seed: int = 0


# ---- synthetic block keys ------------------------------------------------------------
_G = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    z = x + _G
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def num_shared_blocks(cfg: BenchConfig) -> int:
    chains = cfg.blocks_per_agent // cfg.lookup_blocks
    return int(round(chains * cfg.shared_fraction)) * cfg.lookup_blocks


def block_keys(cfg: BenchConfig, agent: int, start: int, n: int) -> np.ndarray:
    """(n, 2) uint64 keys of agent `agent`'s blocks at positions [start, start + n):
    positions below num_shared_blocks are the shared chains, the rest the agent's own."""
    pos = np.arange(start, start + n, dtype=np.uint64)
    shared = pos < np.uint64(num_shared_blocks(cfg))
    owner = np.where(shared, np.uint64(0), np.uint64(agent + 1))
    ident = (np.uint64(cfg.seed & 0xFF) << np.uint64(56)) | (owner << np.uint64(36)) | pos
    out = np.empty((n, 2), np.uint64)
    out[:, 0] = _splitmix(ident)
    out[:, 1] = _splitmix(ident ^ np.uint64(0x5555555555555555))
    return out


def block_parents(cfg: BenchConfig, agent: int, start: int, n: int) -> np.ndarray:
    """(n, 2) uint64 parent keys of the blocks block_keys() gives: the previous position's
    key, zero (ROOT_PARENT_HASH) at the start of each chain of `lookup_blocks` blocks, as an
    engine's STORED events carry them."""
    out = np.zeros((n, 2), np.uint64)
    if n:
        prev = block_keys(cfg, agent, start - 1, n + 1)[:-1] if start else block_keys(cfg, agent, 0, n)
        if not start:
            prev = np.concatenate([np.zeros((1, 2), np.uint64), prev[:-1]])
        out[:] = prev
        first = (np.arange(start, start + n) % cfg.lookup_blocks) == 0
        out[first] = 0
    return out


def lookup_queries(cfg: BenchConfig, n: int, salt: int) -> list[tuple[int, bytes]]:
    """n prefixes: (agent, packed hashes of one of its chains)."""
    rng = np.random.default_rng([cfg.seed, salt])
    chains = max(1, cfg.blocks_per_agent // cfg.lookup_blocks)
    out = []
    for _ in range(n):
        a = int(rng.integers(cfg.agents))
        c = int(rng.integers(chains))
        out.append((a, block_keys(cfg, a, c * cfg.lookup_blocks, cfg.lookup_blocks).tobytes()))
    return out


# ---- processes -----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us


class LocalEtcd:
    """A throwaway etcd on free loopback ports (the Debian `etcd` binary)."""

    def __init__(self) -> None:
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("etcd is not installed (apt-get install -y etcd-server), or pass --etcd HOST:PORT")
        self.port, peer = _free_port(), _free_port()
        self.dir = tempfile.mkdtemp(prefix="kvcp-bench-etcd-")
        client, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name=bench",
                f"--data-dir={self.dir}/data",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=bench={peer_url}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.endpoint = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _controlplane_main(etcd: str, policy_loop: bool, conn, expected_blocks: int = 0) -> None:
    _quiet()
    from controlplane.server import ControlPlane, ControlPlaneConfig

    sys.setswitchinterval(0.0005)  # as kvcp-controlplane runs (--gil-switch-interval-ms 0.5)

    cp = ControlPlane(
        ControlPlaneConfig(
            listen="127.0.0.1:0",
            etcd=etcd,
            max_workers=256,
            expected_blocks=expected_blocks,
            lookup_listen="127.0.0.1:0",
        ),
        log_fn=lambda m: None,
    )
    cp.start()
    if not policy_loop:
        cp.manager.policy_interval_seconds = float("inf")  # the tier-policy pass off
    # server-side lookup time (Cluster.lookup: hashing, the lock, the index), timed here,
    # and the index's part of it (the table probe and the holders' arrays)
    durations: collections.deque[float] = collections.deque(maxlen=1_000_000)
    index_durations: collections.deque[float] = collections.deque(maxlen=1_000_000)
    cp.cluster.lookup = _timed(cp.cluster.lookup, durations)
    cp.cluster.index.prefix_holders = _timed(cp.cluster.index.prefix_holders, index_durations)
    conn.send((cp.address, cp.lookup_socket.address))
    while True:
        msg = conn.recv()
        if msg == "lookups":  # the durations so far, and start again
            conn.send(list(durations))
            durations.clear()
        elif msg == "index":
            conn.send(list(index_durations))
            index_durations.clear()
        elif msg == "policy":
            m = cp.manager
            conn.send(
                {
                    "passes": m.policy_passes_total,
                    "agents_decided": m.policy_agents_decided_total,
                    "pass_seconds_max": round(m.policy_pass_seconds_max, 3),
                    "actions": m.policy_actions_total,
                }
            )
        else:
            break
    cp.stop(0.2)


def _timed(fn, durations: collections.deque):
    """`fn`, appending each call's wall time to `durations`."""

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - t)

    return timed


def _agent_info(agent_id: str):
    from protos.kvcp.v1 import types_pb2

    return types_pb2.AgentInfo(
        agent_id=agent_id,
        address=f"bench/{agent_id}",
        models=[types_pb2.ModelSpec(model_id=MODEL_ID, block_size=BLOCK_SIZE)],
    )


def churn_blocks(cfg: BenchConfig) -> int:
    """Blocks each agent removes (and as many it stores) in the steady-state phase."""
    n = int(cfg.blocks_per_agent * cfg.churn_fraction)
    return n - n % cfg.event_batch_blocks if n >= cfg.event_batch_blocks else n


def _agents_main(cfg_dict: dict, agent_indices: list[int], address: str, ready, go, churn_go, stop, out) -> None:
    """One simulated-agent process: a channel and a Sync stream per agent."""
    _quiet()
    import grpc

    from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2

    cfg = BenchConfig(**cfg_dict)
    opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    resyncs = [0]
    sent = [0]

    def prepared(agent: int) -> tuple[list[bytes], list[bytes]]:
        """The agent's whole stream, serialised before the clock starts (a real agent's
        CPU is on its own machine, not on the control plane's two cores): the fill, then
        the steady-state churn (as many blocks removed, the oldest, as stored)."""
        n, step = cfg.blocks_per_agent, cfg.event_batch_blocks
        seq = [0]

        def batch(kind: int, start: int, count: int) -> bytes:
            seq[0] += 1
            part = block_keys(cfg, agent, start, count).tobytes()
            stored = kind == agent_pb2.BLOCK_EVENT_KIND_STORED
            parents = block_parents(cfg, agent, start, count).tobytes() if stored else b""
            group = agent_pb2.BlockGroup(model_id=MODEL_ID, tier=2, block_hashes=part, parent_hashes=parents)
            msg = agent_pb2.AgentMessage(events=agent_pb2.BlockEventBatch(seq=seq[0], kind=kind, groups=[group]))
            return msg.SerializeToString()

        fill = [batch(agent_pb2.BLOCK_EVENT_KIND_STORED, b, min(step, n - b)) for b in range(0, n, step)]
        if cfg.policy_loop:
            # usage as a real agent reports it: a CPU tier of n blocks, full (over the 0.95
            # high watermark), so every agent gives the policy pass something to decide
            usage = types_pb2.TierUsage(tier=2, capacity_bytes=n << 20, used_bytes=n << 20, num_blocks=n)
            fill.append(agent_pb2.AgentMessage(stats=agent_pb2.AgentStats(tiers=[usage])).SerializeToString())
        churn = []
        total = churn_blocks(cfg)
        for b in range(0, total, step):
            count = min(step, total - b)
            churn.append(batch(agent_pb2.BLOCK_EVENT_KIND_REMOVED, b, count))
            churn.append(batch(agent_pb2.BLOCK_EVENT_KIND_STORED, n + b, count))
        return fill, churn

    def messages(agent: int, agent_id: str, started: threading.Event):
        fill, churn = prepared(agent)
        yield agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=agent_id, session_id=f"bench-{agent_id}"))
        yield agent_pb2.AgentMessage(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True))
        started.set()
        go.wait()
        sent[0] += cfg.blocks_per_agent
        yield from fill
        churn_go.wait()
        sent[0] += 2 * churn_blocks(cfg)
        yield from churn
        stop.wait()

    def drive(agent: int, started: threading.Event) -> None:
        agent_id = f"agent-{agent}"
        with grpc.insecure_channel(address, options=opts) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            stub.Register(agent_pb2.RegisterRequest(agent=_agent_info(agent_id)), timeout=30)
            # the Sync method taking messages as they are or already serialised
            sync = ch.stream_stream(
                "/kvcp.v1.AgentService/Sync",
                request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
                response_deserializer=agent_pb2.ControlMessage.FromString,
            )
            try:
                for msg in sync(messages(agent, agent_id, started)):
                    if msg.WhichOneof("body") == "resync":
                        resyncs[0] += 1
            except grpc.RpcError:
                pass

    threads = []
    for a in agent_indices:
        started = threading.Event()
        t = threading.Thread(target=drive, args=(a, started), daemon=True)
        t.start()
        threads.append((t, started))
    for _, started in threads:
        started.wait(120)
    ready.release()
    stop.wait()
    for t, _ in threads:
        t.join(5)
    out.put({"sent": sent[0], "resyncs": resyncs[0]})


def _lookup_main(
    cfg_dict: dict,
    address: str,
    rate: float,
    seconds: float,
    salt: int,
    until,
    out,
    floor_seconds: float = 0.0,
    socket_address: str = "",
) -> None:
    """Lookups at an offered rate (paced; a slow answer delays the next) for `seconds`,
    or until `until` is set: over gRPC, or over the lookup socket when `socket_address`
    is given (the client facade's LookupSocket). First, for `floor_seconds`, health checks
    at the same rate: the gRPC round trip with nothing behind it."""
    _quiet()
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cli.client import ClientError, LookupSocket
    from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc

    cfg = BenchConfig(**cfg_dict)
    queries = lookup_queries(cfg, 2048, salt)
    lat, floor, errors, full_hits = [], [], [], 0
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
        if socket_address:
            fast = LookupSocket(socket_address, timeout_seconds=60)
            fast.call(admin_pb2.LookupRequest(model_id=MODEL_ID, block_hashes=queries[0][1]))  # connected

            def lookup(request):
                try:
                    return fast.call(request)
                except ClientError as exc:
                    raise _LookupFailed(exc.code) from None
        else:

            def lookup(request):
                try:
                    return stub.Lookup(request, timeout=60)
                except grpc.RpcError as exc:
                    raise _LookupFailed(exc.code().name) from None

        health = health_pb2_grpc.HealthStub(ch)
        start = time.perf_counter()
        while time.perf_counter() - start < floor_seconds:
            time.sleep(max(0.0, start + len(floor) / rate - time.perf_counter()))
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest(), timeout=30)
            floor.append(time.perf_counter() - t0)
        start = time.perf_counter()
        i = 0
        while True:
            due = start + i / rate
            now = time.perf_counter()
            if now - start >= seconds or (until is not None and until.is_set()):
                break
            if due > now:
                time.sleep(due - now)
            _, packed = queries[i % len(queries)]
            t0 = time.perf_counter()
            try:
                resp = lookup(admin_pb2.LookupRequest(model_id=MODEL_ID, block_hashes=packed))
            except _LookupFailed as exc:  # counted (at its full wait), the run goes on
                errors.append(exc.code)
                resp = None
            lat.append(time.perf_counter() - t0)
            if resp is not None and resp.agents and resp.agents[0].num_hit_blocks == cfg.lookup_blocks:
                full_hits += 1
            i += 1
        elapsed = time.perf_counter() - start
    out.put({"latencies": lat, "elapsed": elapsed, "full_hits": full_hits, "floor": floor, "errors": errors})


class _LookupFailed(Exception):
    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


def _percentiles_ms(lat: list[float]) -> tuple[float, float]:
    if not lat:
        return float("nan"), float("nan")
    a = np.asarray(lat) * 1e3
    return round(float(np.percentile(a, 50)), 3), round(float(np.percentile(a, 99)), 3)


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


# ---- in-process peers (each in a fresh process so RSS is its own) --------------------
def _peer_plan(cfg: BenchConfig) -> tuple[int, int]:
    """(agents, blocks per agent) fed to the in-process peers: all agents, fewer blocks."""
    per_agent = min(cfg.blocks_per_agent, max(cfg.lookup_blocks, cfg.peer_blocks // max(1, cfg.agents)))
    per_agent -= per_agent % cfg.lookup_blocks
    return cfg.agents, max(cfg.lookup_blocks, per_agent)


def _peer_queries(cfg: BenchConfig, per_agent: int) -> list[bytes]:
    sub = BenchConfig(**{**asdict(cfg), "blocks_per_agent": per_agent})
    return [q for _, q in lookup_queries(sub, 1000, 7)]


def _kvcp_index_main(cfg_dict: dict, out) -> None:
    _quiet()
    from controlplane.core.index import BlockIndex

    cfg = BenchConfig(**cfg_dict)
    agents, per_agent = _peer_plan(cfg)
    sub = BenchConfig(**{**asdict(cfg), "blocks_per_agent": per_agent})
    data = [
        (block_keys(sub, a, 0, per_agent).tobytes(), block_parents(sub, a, 0, per_agent).tobytes())
        for a in range(agents)
    ]
    idx = BlockIndex()
    rss0 = _rss(os.getpid())
    step = cfg.peer_batch_blocks * 16
    t0 = time.perf_counter()
    for a in range(agents):
        (raw, praw), name = data[a], f"agent-{a}"
        for off in range(0, len(raw), step):
            idx.add(name, raw[off : off + step], 2, praw[off : off + step])
    ingest = time.perf_counter() - t0
    rss1 = _rss(os.getpid())
    lat = []
    for q in _peer_queries(cfg, per_agent):
        t = time.perf_counter()
        idx.lookup(q)
        lat.append(time.perf_counter() - t)
    p50, p99 = _percentiles_ms(lat)
    replicas = idx.num_replicas
    # the same events in the wire's batches (event_batch_blocks per call)
    wide, step = BlockIndex(), cfg.event_batch_blocks * 16
    t0 = time.perf_counter()
    for a in range(agents):
        (raw, praw), name = data[a], f"agent-{a}"
        for off in range(0, len(raw), step):
            wide.add(name, raw[off : off + step], 2, praw[off : off + step])
    wide_seconds = time.perf_counter() - t0
    out.put(
        {
            "events": agents * per_agent,
            "events_per_second": round(agents * per_agent / ingest),
            "events_per_second_wire_batches": round(agents * per_agent / wide_seconds),
            "lookup_p50_ms": p50,
            "lookup_p99_ms": p99,
            "bytes_per_replica": round((rss1 - rss0) / max(1, replicas), 1),
        }
    )


def _dynamo_main(cfg_dict: dict, out) -> None:
    _quiet()
    try:
        from dynamo.llm import RadixTree
    except Exception as exc:  # noqa: BLE001 - reported as unavailable
        out.put({"unavailable": f"cannot import dynamo.llm.RadixTree ({type(exc).__name__}: {exc})"})
        return
    cfg = BenchConfig(**cfg_dict)
    agents, per_agent = _peer_plan(cfg)
    sub = BenchConfig(**{**asdict(cfg), "blocks_per_agent": per_agent})
    mask = np.uint64((1 << 63) - 1)
    step = cfg.peer_batch_blocks
    # the JSON events a Dynamo KV router consumes, built before the clock starts
    events = []
    for a in range(agents):
        keys = block_keys(sub, a, 0, per_agent)
        bh, th = (keys[:, 0] & mask).tolist(), (keys[:, 1] & mask).tolist()
        for n, off in enumerate(range(0, per_agent, step)):
            parent = None if off % cfg.lookup_blocks == 0 else bh[off - 1]
            blocks = [{"block_hash": bh[i], "tokens_hash": th[i]} for i in range(off, min(per_agent, off + step))]
            ev = {"event_id": n, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}
            events.append((a, json.dumps(ev).encode()))
    tree = RadixTree()
    rss0 = _rss(os.getpid())
    t0 = time.perf_counter()
    for worker, payload in events:
        tree.apply_event(worker, payload)
    ingest = time.perf_counter() - t0
    rss1 = _rss(os.getpid())
    del events
    lat = []
    for q in _peer_queries(cfg, per_agent):
        seq = (np.frombuffer(q, np.uint64).reshape(-1, 2)[:, 1] & mask).tolist()
        t = time.perf_counter()
        tree.find_matches(seq)
        lat.append(time.perf_counter() - t)
    p50, p99 = _percentiles_ms(lat)
    out.put(
        {
            "events": agents * per_agent,
            "events_per_second": round(agents * per_agent / ingest),
            "lookup_p50_ms": p50,
            "lookup_p99_ms": p99,
            "bytes_per_replica": round((rss1 - rss0) / max(1, agents * per_agent), 1),
        }
    )


def _mooncake_main(cfg_dict: dict, out) -> None:
    """Mooncake master metadata throughput, driven by its own store client."""
    _quiet()
    cfg = BenchConfig(**cfg_dict)
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore
    except Exception as exc:  # noqa: BLE001 - reported as unavailable
        out.put({"unavailable": f"cannot import mooncake.store ({type(exc).__name__}: {exc})"})
        return
    binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.path.exists(binary):
        out.put({"unavailable": "mooncake_master binary not found"})
        return
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvcp-bench-mooncake-", suffix=".log", delete=False)  # noqa: SIM115
    keep_log = False
    master = subprocess.Popen(
        [
            binary,
            f"-rpc_port={rpc}",
            "-rpc_address=127.0.0.1",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={http}",
            f"-metrics_port={metrics}",
            "-enable_metric_reporting=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        store = MooncakeDistributedStore()
        rc = -1
        for _ in range(50):
            time.sleep(0.2)
            if master.poll() is not None:
                break
            rc = store.setup(
                "127.0.0.1", f"http://127.0.0.1:{http}/metadata", 256 << 20, 64 << 20, "tcp", "", f"127.0.0.1:{rpc}"
            )
            if rc == 0:
                break
        if rc != 0:
            keep_log = True  # named in the answer
            out.put({"unavailable": f"mooncake store client setup failed (rc {rc}); master log {log.name}"})
            return
        n = cfg.mooncake_keys
        keys = [k.hex() for k in np.frombuffer(block_keys(cfg, 0, 0, n).tobytes(), dtype="V16").tolist()]
        step = cfg.event_batch_blocks
        t0 = time.perf_counter()
        for i in range(0, n, step):
            store.batch_is_exist(keys[i : i + step])
        exist = time.perf_counter() - t0
        n_put = min(n, 50_000)
        value = b"\0" * 16
        t0 = time.perf_counter()
        failed = 0
        for i in range(0, n_put, step):
            part = keys[i : i + step]
            rc = store.put_batch(part, [value] * len(part))
            failed += rc != 0
        put = time.perf_counter() - t0
        store.close()
        out.put(
            {
                "keys": n,
                "batch_is_exist_keys_per_second": round(n / exist),
                "put_batch_keys": n_put,
                "put_batch_keys_per_second": round(n_put / put),
                "put_batch_failures": failed,
            }
        )
    except Exception as exc:  # noqa: BLE001 - reported as unavailable
        out.put({"unavailable": f"{type(exc).__name__}: {exc}"})
    finally:
        master.terminate()
        try:
            master.wait(5)
        except subprocess.TimeoutExpired:
            master.kill()
        log.close()
        if not keep_log:  # a run that measured leaves no file behind
            os.unlink(log.name)


def _run_peer(ctx, target, cfg: BenchConfig, timeout_seconds: float = 600) -> dict:
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(asdict(cfg), q), daemon=True)
    p.start()
    try:
        return q.get(timeout=timeout_seconds)
    except queue.Empty:
        return {"unavailable": f"no result within {timeout_seconds:.0f}s (exit code {p.exitcode})"}
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


# ---- the run -------------------------------------------------------------------------
def run(cfg: BenchConfig, report=lambda msg: None) -> dict:
    import grpc

    from protos import etcd_keys
    from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, agent_pb2, agent_pb2_grpc

    if cfg.agents < 1 or cfg.blocks_per_agent < cfg.lookup_blocks or cfg.lookup_blocks < 1:
        raise ValueError("need agents >= 1 and blocks_per_agent >= lookup_blocks >= 1")
    ctx = mp.get_context("spawn")
    etcd = LocalEtcd() if not cfg.etcd else None
    endpoint = cfg.etcd or etcd.endpoint
    procs = []
    result: dict = {"agents": cfg.agents, "blocks_per_agent": cfg.blocks_per_agent}
    try:
        client = etcd_keys.connect(endpoint, wait_seconds=20, log=report)
        lease = client.lease(60)
        lease_stop = threading.Event()

        def keep_lease() -> None:
            while not lease_stop.wait(15):
                try:
                    lease.refresh()
                except Exception:  # noqa: BLE001 - etcd gone; the run fails elsewhere
                    return

        threading.Thread(target=keep_lease, daemon=True).start()
        from google.protobuf import json_format

        for a in range(cfg.agents):
            client.put(
                etcd_keys.agent_key(f"agent-{a}"), json_format.MessageToJson(_agent_info(f"agent-{a}")), lease=lease
            )

        cp_conn, child = ctx.Pipe()
        cp = ctx.Process(
            target=_controlplane_main, args=(endpoint, cfg.policy_loop, child, cfg.expected_blocks), daemon=True
        )
        cp.start()
        if not cp_conn.poll(60):
            raise RuntimeError("the control plane did not start within 60 s")
        address, lookup_address = cp_conn.recv()
        report(f"control plane on {address} (pid {cp.pid}); starting {cfg.agents} agents")
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        admin = admin_pb2_grpc.AdminServiceStub(channel)

        ready, go, churn_go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Event()
        out = ctx.Queue()
        nproc = max(1, min(cfg.agent_processes, cfg.agents))
        for p in range(nproc):
            mine = list(range(p, cfg.agents, nproc))
            proc = ctx.Process(
                target=_agents_main, args=(asdict(cfg), mine, address, ready, go, churn_go, stop, out), daemon=True
            )
            proc.start()
            procs.append(proc)
        for _ in range(nproc):
            if not ready.acquire(timeout=180):
                raise RuntimeError("simulated agents did not connect within 180 s")
        stats0 = admin.GetStats(admin_pb2.GetStatsRequest(), timeout=30)
        rss0 = _rss(cp.pid)
        total = cfg.agents * cfg.blocks_per_agent
        report(f"{stats0.num_agents} agents synced; streaming {total:,} block events")

        ingest_done = ctx.Event()
        lq = ctx.Queue()
        during = ctx.Process(
            target=_lookup_main, args=(asdict(cfg), address, cfg.lookup_rate, 3600.0, 1, ingest_done, lq), daemon=True
        )
        during.start()
        time.sleep(1.0)  # the lookup client's imports
        cp_conn.send("lookups")
        cp_conn.recv()
        t0 = time.perf_counter()
        go.set()
        last_report = t0

        def stats():
            # a long rebuild of the index holds the lock: wait it out rather than fail the run
            for _ in range(10):
                try:
                    return admin.GetStats(admin_pb2.GetStatsRequest(), timeout=60)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
            raise RuntimeError("the control plane did not answer GetStats for 10 minutes")

        while True:
            s = stats()
            done = s.events_total - stats0.events_total
            now = time.perf_counter()
            if done >= total:
                break
            if now - last_report > 10:
                report(f"  {done:,}/{total:,} events ({done / (now - t0):,.0f}/s)")
                last_report = now
            if now - t0 > 3600:
                raise RuntimeError(f"ingest did not finish within an hour ({done:,}/{total:,})")
            time.sleep(0.05)
        ingest_seconds = now - t0
        ingest_done.set()
        rss1 = _rss(cp.pid)
        d = lq.get(timeout=300)
        during.join(10)
        result["lookup_during_ingest_errors"] = len(d["errors"])
        s = stats()
        replicas = s.num_block_replicas
        result["events_per_second"] = round(total / ingest_seconds)
        result["ingest_seconds"] = round(ingest_seconds, 2)
        result["block_replicas"] = replicas
        result["distinct_blocks"] = s.num_blocks
        result["resyncs_during_ingest"] = s.resyncs_total - stats0.resyncs_total
        result["bytes_per_replica"] = round((rss1 - rss0) / max(1, replicas), 1)
        result["controlplane_rss_bytes"] = rss1
        p50, p99 = _percentiles_ms(d["latencies"])
        result["lookup_during_ingest_p50_ms"], result["lookup_during_ingest_p99_ms"] = p50, p99
        result["lookup_during_ingest_qps"] = round(len(d["latencies"]) / max(d["elapsed"], 1e-9), 1)
        cp_conn.send("lookups")
        server = cp_conn.recv()
        cp_conn.send("index")  # the index's part is reported after ingest only
        cp_conn.recv()
        result["lookup_during_ingest_server_p50_ms"], result["lookup_during_ingest_server_p99_ms"] = _percentiles_ms(
            server
        )
        report(f"ingested in {ingest_seconds:.1f}s: {result['events_per_second']:,} events/s; measuring lookups")

        after = ctx.Process(
            target=_lookup_main,
            args=(asdict(cfg), address, cfg.lookup_rate, cfg.lookup_seconds, 2, None, lq, min(5.0, cfg.lookup_seconds)),
            daemon=True,
        )
        after.start()
        d = lq.get(timeout=2 * cfg.lookup_seconds + 120)
        after.join(10)
        p50, p99 = _percentiles_ms(d["latencies"])
        result["lookup_p50_ms"], result["lookup_p99_ms"] = p50, p99
        cp_conn.send("lookups")
        result["lookup_server_p50_ms"], result["lookup_server_p99_ms"] = _percentiles_ms(cp_conn.recv())
        result["rpc_floor_p50_ms"], result["rpc_floor_p99_ms"] = _percentiles_ms(d["floor"])
        result["lookup_qps"] = round(len(d["latencies"]) / max(d["elapsed"], 1e-9), 1)
        result["lookup_rate_offered"] = cfg.lookup_rate
        result["lookup_full_hits"] = round(d["full_hits"] / max(1, len(d["latencies"])), 4)

        # the same lookups over the lookup socket (kvcp-controlplane --lookup-listen)
        fast = ctx.Process(
            target=_lookup_main,
            args=(asdict(cfg), address, cfg.lookup_rate, cfg.lookup_seconds, 2, None, lq, 0.0, lookup_address),
            daemon=True,
        )
        fast.start()
        d = lq.get(timeout=2 * cfg.lookup_seconds + 120)
        fast.join(10)
        result["lookup_socket_p50_ms"], result["lookup_socket_p99_ms"] = _percentiles_ms(d["latencies"])
        cp_conn.send("lookups")
        result["lookup_socket_server_p50_ms"], result["lookup_socket_server_p99_ms"] = _percentiles_ms(cp_conn.recv())
        cp_conn.send("index")  # the index's part, over the gRPC and socket lookups after ingest
        result["lookup_index_p50_ms"], result["lookup_index_p99_ms"] = _percentiles_ms(cp_conn.recv())
        result["lookup_socket_qps"] = round(len(d["latencies"]) / max(d["elapsed"], 1e-9), 1)
        result["lookup_socket_errors"] = len(d["errors"])

        # steady state: every agent removes its oldest blocks and stores as many new ones
        churn = churn_blocks(cfg)
        if churn:
            e0 = stats().events_total
            want = 2 * churn * cfg.agents
            report(f"steady state: {want:,} events (removals and stores, the index keeps its size)")
            t0 = time.perf_counter()
            churn_go.set()
            while stats().events_total - e0 < want:
                if time.perf_counter() - t0 > 3600:
                    raise RuntimeError("the steady-state phase did not finish within an hour")
                time.sleep(0.05)
            result["events_per_second_steady"] = round(want / (time.perf_counter() - t0))
            result["steady_events"] = want
        else:
            churn_go.set()

        # one agent's full resync: a new session, its whole inventory in chunks; it counts when
        # the index shows the inventory (one block fewer than it held, so the change is visible)
        n = cfg.blocks_per_agent - 1
        raw = block_keys(cfg, 0, churn, n).tobytes()
        praw = block_parents(cfg, 0, churn, n).tobytes()
        step = INVENTORY_CHUNK_BLOCKS * 16
        chunks = [(raw[i : i + step], praw[i : i + step]) for i in range(0, len(raw), step)]
        msgs = [agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="agent-0", session_id="bench-resync"))]
        for i, (c, p) in enumerate(chunks):
            msgs.append(
                agent_pb2.AgentMessage(
                    inventory=agent_pb2.Inventory(
                        seq=0,
                        chunk_index=i,
                        last_chunk=i == len(chunks) - 1,
                        groups=[agent_pb2.BlockGroup(model_id=MODEL_ID, tier=3, block_hashes=c, parent_hashes=p)],
                    )
                )
            )
        resync_stop = threading.Event()

        def inventory():
            yield from msgs
            resync_stop.wait()

        agent_channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        stub = agent_pb2_grpc.AgentServiceStub(agent_channel)
        t0 = time.perf_counter()
        stream = stub.Sync(inventory())
        resync_seconds = None
        while time.perf_counter() - t0 < 300:
            agents = admin.ListAgents(admin_pb2.ListAgentsRequest(), timeout=60).agents
            a0 = next((a for a in agents if a.info.agent_id == "agent-0"), None)
            if a0 is not None and a0.num_blocks == n and a0.state == 1:
                resync_seconds = time.perf_counter() - t0
                break
            time.sleep(0.005)
        resync_stop.set()
        stream.cancel()
        agent_channel.close()
        result["resync_seconds"] = round(resync_seconds, 3) if resync_seconds is not None else None
        report(f"resync of {n:,} blocks: {result['resync_seconds']}s")

        stop.set()
        sent = resyncs = 0
        for _ in procs:
            try:
                r = out.get(timeout=30)
                sent += r["sent"]
                resyncs += r["resyncs"]
            except queue.Empty:
                pass
        result["resync_requests_to_agents"] = resyncs
        if cfg.policy_loop:
            cp_conn.send("policy")
            result["policy_pass"] = cp_conn.recv()
            report(f"policy pass: {result['policy_pass']}")
        channel.close()
        cp_conn.send("stop")
        cp.join(15)
        lease_stop.set()
        client.revoke_lease(lease.id)
        client.close()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if etcd is not None:
            etcd.stop()
    result["event_batch_blocks"] = cfg.event_batch_blocks
    result["policy_loop"] = cfg.policy_loop
    result["expected_blocks"] = cfg.expected_blocks
    result["agent_processes"] = nproc
    result["cores"] = os.cpu_count()
    if cfg.peers:
        report("peers: kvcp index in process")
        result["peers"] = {"kvcp_index_in_process": _run_peer(ctx, _kvcp_index_main, cfg)}
        report("peers: Dynamo RadixTree")
        result["peers"]["dynamo_radix_tree"] = _run_peer(ctx, _dynamo_main, cfg)
        report("peers: Mooncake master")
        mc = _run_peer(ctx, _mooncake_main, cfg)
        result["peers"]["mooncake_master"] = mc
        if "batch_is_exist_keys_per_second" in mc:
            mc["kvcp_events_per_second_ratio"] = round(
                result["events_per_second"] / mc["batch_is_exist_keys_per_second"], 3
            )
        dyn = result["peers"]["dynamo_radix_tree"]
        kv = result["peers"]["kvcp_index_in_process"]
        if "events_per_second" in dyn and "events_per_second" in kv:
            dyn["kvcp_index_events_per_second_ratio"] = round(kv["events_per_second"] / dyn["events_per_second"], 3)
    return result


def format_table(result: dict) -> str:
    lines = []
    for k, v in result.items():
        if k == "peers":
            continue
        lines.append(f"{k:32s} {v}")
    for name, peer in result.get("peers", {}).items():
        lines.append(f"peer {name}:")
        for k, v in peer.items():
            lines.append(f"  {k:30s} {v}")
    return "\n".join(lines)
