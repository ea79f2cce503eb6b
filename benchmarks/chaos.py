"""`kvcp-bench chaos`: a small real cluster under load while its parts are killed, paused
and cut off, checking that nothing wrong is ever served and no pin is lost.

Everything runs on loopback, started here: one etcd, two `kvcp-controlplane` replicas
(election TTL 2 s) and three `kvcp-agent` processes. Worker threads play the workload of
benchmarks/workload.py the way a KV-aware router does: Lookup through the control
plane (the client facade, moved to the other replica when one stops answering), Load of
the cached prefix from the best agent, a check of every loaded block (each element of a
block equals block_fill(its hash)), and Store of the blocks it "computed". When the
control plane cannot answer, a request is still routed, to the least loaded agent.

At set times, one after another, it: SIGKILLs an agent (and restarts it); SIGKILLs the
leader (and restarts it); SIGSTOPs the new leader, then SIGCONTs it; pauses etcd for
10 s (SIGSTOP/SIGCONT); SIGKILLs etcd and starts it again on its data 15 s later; and,
when this build has handoff, SIGKILLs the destination of
a handoff in flight (and restarts it). A fault's `recovery_seconds` is the time until a
lookup and a pin both succeed again through the facade, counted from the fault (from
etcd's return for the etcd pause); `back_seconds` is the time until the faulted part is
in service again. A few pins with TTLs longer than the run are checked at the end
(`pins_lost`), and the blocks they protect on an agent that is never killed too.

All the while, tier moves run across the faults: one `move` every `move_interval_seconds`
of a small prefix (namespace "moved") on the agent that is never killed, to disk and
back to cpu by turns (that agent has a disk tier for it), asked through the facade and
each followed to its end for up to `op_wait_seconds` (past the control plane's operation
timeout, 60 s: a command lost with a leader or a stream ends its part by then). A start
the control plane refuses (UNAVAILABLE during a failover, etcd away) is counted apart
(`ops_refused`), not as a failure; an operation it accepted must end, SUCCEEDED or
FAILED/CANCELLED with a reason: `ops_unfinished` (no end within the wait) must be 0. A
move accepted though its start was answered with an error (the leader died or stopped
after taking it) is found in the operations list and followed too.

Drains run across the faults as well: every `drain_interval_seconds` one agent, the three
in turn, is drained (`kvctl drain`: cordoned, its prefixes handed to the others), its end
awaited as a move's (`drains_unfinished` must be 0), then it is uncordoned. A few marker
prefixes stored on it just before and pinned cluster-wide must, after a drain SUCCEEDED
with no block left, load whole and right from another agent (`drain_blocks_lost` must be
0); a drain's other blocks may be dropped by policy or eviction without loss to anyone.
The handoff fault waits for the drain under way (its destination must not be cordoned).

Every process started here is stopped on the way out, on an error or Ctrl-C too (and
the kernel kills them should this process die first, where util-linux setpriv exists)."""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from agent.client import EngineClient
from benchmarks.etcd import EtcdServer, free_ports
from benchmarks.workload import DTYPES, PromptGenerator, WorkloadConfig, block_fill
from cli.client import ClientError, ControlPlaneClient, OperationView
from protos.block_hash import hash_prefix, split_hashes

WORKLOAD_MODEL = "demo-model:block_size=16,num_layers=2,num_kv_heads=2,head_dim=32,dtype=float16"
HANDOFF_MODEL = "chaos-big:block_size=32,num_layers=8,num_kv_heads=8,head_dim=128,dtype=float16"  # 1 MiB blocks
RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "CANCELLED", "UNKNOWN", "RESOURCE_EXHAUSTED"}
AGENTS = ("agent-1", "agent-2", "agent-3")
REPLICAS = ("cp-a", "cp-b")
HANDOFF_SOURCE, VICTIM, KEEPER = "agent-1", "agent-2", "agent-3"  # KEEPER is never killed: it holds the pins
MOVED_NAMESPACE = "moved"  # KEEPER's prefix that the tier moves carry to disk and back
ERROR_CHARS = 120  # an operation's error as the report keeps it
MOVES_FIND_SECONDS = 5.0  # how often the moves accepted without an answer are looked for


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float = 120.0
    rate_per_second: float = 8.0  # offered requests per second, over all workers
    workers: int = 2
    seed: int = 0
    log_dir: str = ""  # empty: a new temporary directory (kept; its path is printed)
    recovery_timeout_seconds: float = 60.0  # generous: the machine is small and shared
    election_ttl_seconds: int = 2
    agent_lease_ttl_seconds: int = 4
    etcd_pause_seconds: float = 10.0
    etcd_down_seconds: float = 15.0  # SIGKILLed, then started again on its data
    leader_pause_seconds: float = 8.0
    agent_cpu_capacity: str = "32MiB"  # small: the workload keeps the tiers full, so pins matter
    # the handoff: 20 blocks of 1 MiB of a second model, over a source link paced to 4 MiB/s:
    # the engine writes 16 MiB at once, then waits the pace off, so the prefix is in flight for seconds
    handoff_blocks: int = 20
    handoff_link_bandwidth: str = "4MiB"
    num_pins: int = 3
    move_interval_seconds: float = 0.75
    moved_blocks: int = 8
    # the control plane's operation timeout (60 s: its default, which the cluster keeps,
    # no flag sets it) and a failover on top
    op_wait_seconds: float = 90.0
    keeper_disk_capacity: str = "64MiB"
    # a drain of each agent in turn, with marker prefixes pinned on it first (see Drains)
    drain_interval_seconds: float = 20.0
    drain_markers: int = 2
    drain_marker_blocks: int = 4


@dataclass
class FaultResult:
    fault: str
    recovered: bool
    recovery_seconds: float | None
    at_seconds: float = 0.0
    back_seconds: float | None = None
    detail: str = ""


@dataclass
class ChaosResult:
    seconds: float
    requests: int
    served: int
    wrong_kv_served: int  # loaded blocks whose content was not the block's (must be 0)
    pins_lost: int  # pins made at the start that the control plane no longer has (must be 0)
    pinned_blocks_evicted: int  # blocks of those pins gone from the agent that holds them
    faults: list[FaultResult]
    lookups_failed: int
    requests_failed: int
    hit_tokens: int
    prompt_tokens: int
    log_dir: str
    ops_started: int = 0  # tier moves the control plane accepted
    ops_succeeded: int = 0
    ops_failed: int = 0  # FAILED or CANCELLED, with their errors in ops_failed_errors
    ops_refused: int = 0  # starts refused (by code in ops_refused_codes): not failures
    ops_unfinished: int = 0  # accepted, and no end within op_wait_seconds (must be 0)
    ops_failed_errors: dict[str, int] = field(default_factory=dict)
    ops_refused_codes: dict[str, int] = field(default_factory=dict)
    drains_started: int = 0  # drains the control plane accepted, an agent at a time
    drains_succeeded: int = 0
    drains_failed: int = 0  # FAILED or CANCELLED, with their errors in drains_failed_errors
    drains_refused: int = 0  # starts refused (by code in drains_refused_codes): not failures
    drains_unfinished: int = 0  # accepted, and no end within op_wait_seconds (must be 0)
    drain_blocks_lost: int = 0  # pinned marker blocks of a clean drain served by no other agent (must be 0)
    drains_failed_errors: dict[str, int] = field(default_factory=dict)
    drains_refused_codes: dict[str, int] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


# ---- processes ----------------------------------------------------------------------


def die_with_parent() -> tuple[str, ...]:
    """A command prefix that has the kernel SIGKILL the child when this process dies
    (util-linux setpriv); empty where it is missing. Not a preexec_fn: forking a process
    whose gRPC threads are busy can crash the child before it execs."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return ()
    try:
        out = subprocess.run([setpriv, "--help"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return (setpriv, "--pdeathsig", "KILL", "--") if "--pdeathsig" in out else ()


def console_script(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"console script {name} not found next to {sys.executable} nor on PATH (pip install -e .)")
    return found


class Processes:
    """The cluster's processes by name, each logging to <log_dir>/<name>.log; restarts
    keep the same command line (and so the same ports). Started from the main thread
    only: the kernel's parent-death signal follows the thread that forked."""

    def __init__(self, log_dir: Path, prefix: tuple[str, ...] = ()):
        self.log_dir = log_dir
        self.prefix = prefix
        self.argv: dict[str, list[str]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.killed_at: dict[str, float] = {}  # name -> monotonic time of its last SIGKILL
        self._logs: list = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        self.argv[name] = argv
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all()
        self._logs.append(log)
        log.write(f"==== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        log.flush()
        self.procs[name] = subprocess.Popen(
            [*self.prefix, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        return self.procs[name]

    def restart(self, name: str) -> None:
        self.start(name, self.argv[name])

    def signal(self, name: str, sig: int) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        if sig == signal.SIGKILL:
            self.killed_at[name] = time.monotonic()
            p.wait(10)

    def stop_all(self) -> None:
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
                p.terminate()
        deadline = time.monotonic() + 10
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()


# ---- the control plane as a client sees it ----------------------------------------


class Facade:
    """The client facade (ControlPlaneClient) on one replica, moved to the next when that
    one does not answer or has no leader, with backoff, until a deadline. One per thread."""

    def __init__(self, endpoints: list[str], timeout_seconds: float = 3.0):
        self.endpoints = endpoints
        self.timeout_seconds = timeout_seconds
        self._i = 0
        self._client: ControlPlaneClient | None = None

    def _get(self) -> ControlPlaneClient:
        if self._client is None:
            self._client = ControlPlaneClient(self.endpoints[self._i], self.timeout_seconds)
        return self._client

    def _rotate(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = None
        self._i = (self._i + 1) % len(self.endpoints)

    def call(self, fn: Callable[[ControlPlaneClient], object], deadline_seconds: float = 10.0):
        deadline = time.monotonic() + deadline_seconds
        delay = 0.1
        while True:
            try:
                return fn(self._get())
            except ClientError as exc:
                if exc.code not in RETRYABLE:
                    raise
                last = exc
                self._rotate()
            if time.monotonic() + delay > deadline:
                raise last
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def replica_role(endpoint: str) -> str:
    """leader | follower | down, from the replica's gRPC health (AdminService is SERVING
    on the leader only)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(endpoint) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="kvcp.v1.AdminService"), timeout=2
            )
        except grpc.RpcError:
            return "down"
    return "leader" if r.status == health_pb2.HealthCheckResponse.SERVING else "follower"


# ---- the load ------------------------------------------------------------------------


@dataclass
class LoadStats:
    requests: int = 0
    served: int = 0
    wrong_kv_served: int = 0
    lookups_failed: int = 0
    requests_failed: int = 0
    engine_errors: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    stored_blocks: int = 0


class Model:
    """The KV layout of the cluster's model, as the control plane reports it."""

    def __init__(self, spec: dict):
        self.model_id = spec["model_id"]
        self.block_size = spec["block_size"]
        self.dtype = DTYPES[spec["dtype"]]
        self.block_elems = spec["num_layers"] * 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_dim"]

    def hashes(self, tokens: list[int]) -> list[bytes]:
        return split_hashes(hash_prefix(self.model_id, tokens, self.block_size))

    def kv(self, hashes: list[bytes]) -> bytes:
        arr = np.empty((len(hashes), self.block_elems), dtype=self.dtype)
        for i, h in enumerate(hashes):
            arr[i] = block_fill(h)
        return arr.tobytes()

    def wrong_blocks(self, kv: bytes, hashes: list[bytes], num_blocks: int) -> int:
        """Blocks of a load whose content is not theirs (a short or long payload: all)."""
        if num_blocks > len(hashes) or len(kv) != num_blocks * self.block_elems * np.dtype(self.dtype).itemsize:
            return max(num_blocks, 1)
        if not num_blocks:
            return 0
        arr = np.frombuffer(kv, dtype=self.dtype).reshape(num_blocks, -1)
        return sum(1 for i in range(num_blocks) if not np.all(arr[i] == block_fill(hashes[i])))


class Load:
    """Worker threads playing the workload against the cluster."""

    def __init__(self, cfg: ChaosConfig, endpoints: list[str], model: Model, agent_addresses: dict[str, str]):
        self.cfg = cfg
        self.endpoints = endpoints
        self.model = model
        self.addresses = dict(agent_addresses)  # agent_id -> engine address (fixed ports)
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, fill_agent: str = "") -> None:
        targets = [(self._run, (i,), f"chaos-load-{i}") for i in range(self.cfg.workers)]
        if fill_agent:
            targets.append((self._fill, (fill_agent,), "chaos-fill"))
        for target, args, name in targets:
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def _fill(self, agent_id: str) -> None:
        """Keep one agent's tier full with prefixes nobody asks for again: the routed load
        follows shared system prompts and may leave an agent idle, and pins must be tested
        against eviction pressure."""
        m = self.model
        r = np.random.default_rng(self.cfg.seed + 7)
        engine = EngineClient(self.addresses[agent_id], timeout_seconds=5.0)
        try:
            while not self.stop.wait(0.1):
                tokens = r.integers(0, 32000, 16 * m.block_size).tolist()
                with contextlib.suppress(grpc.RpcError):  # the agent may be down for a fault
                    engine.store(m.model_id, tokens, m.kv(m.hashes(tokens)), namespace="filler")
        finally:
            engine.close()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _run(self, worker: int) -> None:
        gen = PromptGenerator(WorkloadConfig(seed=self.cfg.seed + worker, num_documents=100))
        facade = Facade(self.endpoints)
        engines: dict[str, EngineClient] = {}
        per_agent: dict[str, int] = dict.fromkeys(self.addresses, 0)
        rng = random.Random(self.cfg.seed + 100 + worker)
        interval = self.cfg.workers / self.cfg.rate_per_second if self.cfg.rate_per_second > 0 else 0.0
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    self._request(gen, facade, engines, per_agent, rng)
                except Exception:  # noqa: BLE001 - a bug here must not stop the run silently
                    self._count(requests_failed=1)
                    import traceback

                    traceback.print_exc()
                self.stop.wait(max(0.0, interval - (time.monotonic() - t0)))
        finally:
            facade.close()
            for e in engines.values():
                e.close()

    def _request(self, gen, facade: Facade, engines, per_agent, rng) -> None:
        m = self.model
        prompt = gen.next_prompt()
        namespace = gen.last_namespace
        hashes = m.hashes(prompt)
        self._count(requests=1, prompt_tokens=len(prompt))
        best: list[str] = []
        try:
            view = facade.call(lambda c: c.lookup(m.model_id, prompt), deadline_seconds=4.0)
            best = [a.agent_id for a in view.agents if a.agent_id in self.addresses and a.num_hit_blocks > 0][:1]
        except ClientError:
            self._count(lookups_failed=1)  # routed without the control plane
        rest = sorted((a for a in self.addresses if a not in best), key=lambda a: (per_agent[a], rng.random()))
        for agent_id in [*best, *rest][:2]:
            engine = engines.get(agent_id)
            if engine is None:
                engine = engines[agent_id] = EngineClient(self.addresses[agent_id], timeout_seconds=5.0)
            try:
                loaded = engine.load(m.model_id, prompt)
                n = loaded.num_cached_tokens // m.block_size
                wrong = m.wrong_blocks(loaded.kv, hashes, n)
                stored = 0
                if n < len(hashes) and not wrong:
                    stored = engine.store(
                        m.model_id, prompt, m.kv(hashes[n:]), first_block=n, namespace=namespace
                    ).num_stored_blocks
            except grpc.RpcError:
                self._count(engine_errors=1)
                engines.pop(agent_id).close()
                continue
            per_agent[agent_id] += 1
            self._count(served=1, wrong_kv_served=wrong, hit_tokens=n * m.block_size, stored_blocks=stored)
            return
        self._count(requests_failed=1)


@dataclass
class MoveStats:
    started: int = 0
    succeeded: int = 0
    failed: int = 0
    refused: int = 0
    unfinished: int = 0
    moved_blocks: int = 0  # by the operations that ended (0: no move found anything to carry)
    failed_errors: dict[str, int] = field(default_factory=dict)
    refused_codes: dict[str, int] = field(default_factory=dict)
    unfinished_op_ids: list[str] = field(default_factory=list)
    failed_op_ids: list[str] = field(default_factory=list)  # with when each was made (wall clock)
    # accepted though their start was answered with an error (a timeout as the leader
    # died or stopped): found in the control plane's list, counted in started, followed
    found_unanswered: int = 0


class Moves:
    """One thread that asks for a tier move of KEEPER's prefix in MOVED_NAMESPACE every
    `move_interval_seconds`, to disk and to cpu by turns, and follows each to its end.
    stop: no more starts, the running ones followed until they end or their wait is
    up; abandon: none followed any more (the cluster is going away)."""

    def __init__(self, cfg: ChaosConfig, endpoints: list[str], model: Model, engine_address: str, tokens: list[int]):
        self.cfg = cfg
        self.endpoints = endpoints
        self.model = model
        self.engine_address = engine_address
        self.tokens = tokens
        self.stats = MoveStats()
        self.stop = threading.Event()
        self.abandon = threading.Event()
        self._seen: set[str] = set()  # op ids started or found, each followed once
        self._thread = threading.Thread(target=self._run, name="chaos-moves", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join(self.cfg.op_wait_seconds + 30)

    def _run(self) -> None:
        facade = Facade(self.endpoints)
        engine = EngineClient(self.engine_address, timeout_seconds=5.0)
        waits: dict[str, float] = {}  # op_id -> monotonic end of its wait
        tiers = itertools.cycle(("disk", "cpu"))
        next_start = next_find = time.monotonic()
        finds_after_stop = 0  # looked for once more after the last start (up to 3 tries)
        try:
            while not self.abandon.is_set() and (waits or not self.stop.is_set() or finds_after_stop < 3):
                if not self.stop.is_set() and time.monotonic() >= next_start:
                    next_start = time.monotonic() + self.cfg.move_interval_seconds
                    self._start(facade, engine, next(tiers), waits)
                if time.monotonic() >= next_find or (self.stop.is_set() and finds_after_stop < 3):
                    stopped = self.stop.is_set()
                    found = self._find_unanswered(facade, waits)
                    if stopped:
                        finds_after_stop = 3 if found else finds_after_stop + 1
                    next_find = time.monotonic() + MOVES_FIND_SECONDS
                self._follow(facade, waits)
                time.sleep(0.25)
        finally:
            facade.close()
            engine.close()

    def _start(self, facade: Facade, engine: EngineClient, to_tier: str, waits: dict[str, float]) -> None:
        m = self.model
        with contextlib.suppress(grpc.RpcError):  # stored again where evicted: each move has blocks to carry
            engine.store(m.model_id, self.tokens, m.kv(m.hashes(self.tokens)), namespace=MOVED_NAMESPACE)
        try:
            op = facade.call(lambda c: c.move(to_tier, namespace=MOVED_NAMESPACE, agent_id=KEEPER), 5.0)
        except ClientError as exc:
            code = exc.code if exc.code in RETRYABLE else f"{exc.code}: {str(exc)[:60]}"  # (a "no" says why)
            self.stats.refused += 1
            self.stats.refused_codes[code] = self.stats.refused_codes.get(code, 0) + 1
            return
        self.stats.started += 1
        self._seen.add(op.op_id)
        waits[op.op_id] = time.monotonic() + self.cfg.op_wait_seconds

    def _find_unanswered(self, facade: Facade, waits: dict[str, float]) -> bool:
        """Follow the moves the control plane accepted though their start was answered
        with an error: a leader killed or stopped after it took one (and sent its commands)
        answers nothing, the start is retried or counted refused, and that very move (the
        lost-command case across a failover) would otherwise never be checked. False when
        the list could not be read."""
        try:
            listed = facade.call(lambda c: c.list_operations(1000), 5.0)
        except ClientError:
            return False
        for op in listed:
            if op.op_id in self._seen or op.kind != "move" or op.params.get("namespace") != MOVED_NAMESPACE:
                continue
            self._seen.add(op.op_id)
            self.stats.started += 1
            self.stats.found_unanswered += 1
            if op.finished:
                self._ended(op)
            else:
                waits[op.op_id] = time.monotonic() + self.cfg.op_wait_seconds
        return True

    def _follow(self, facade: Facade, waits: dict[str, float]) -> None:
        for op_id, wait_end in list(waits.items()):
            with contextlib.suppress(ClientError):  # not answered now (a failover, etcd away): asked again
                op = facade.call(lambda c, i=op_id: c.get_operation(i), 2.0)
                if op.finished:
                    del waits[op_id]
                    self._ended(op)
                    continue
            if time.monotonic() >= wait_end:
                del waits[op_id]
                self.stats.unfinished += 1
                self.stats.unfinished_op_ids.append(op_id)

    def _ended(self, op: OperationView) -> None:
        self.stats.moved_blocks += op.num_done_blocks
        if op.state == "SUCCEEDED":
            self.stats.succeeded += 1
            return
        self.stats.failed += 1
        self.stats.failed_op_ids.append(
            f"{op.op_id} made {time.strftime('%H:%M:%S', time.localtime(op.created_unix_seconds))}"
        )
        error = op.error[:ERROR_CHARS] + ("..." if len(op.error) > ERROR_CHARS else "") or "(no reason given)"
        key = error if op.state == "FAILED" else f"{op.state}: {error}"
        self.stats.failed_errors[key] = self.stats.failed_errors.get(key, 0) + 1


@dataclass
class DrainStats:
    started: int = 0  # drains the control plane accepted
    succeeded: int = 0
    failed: int = 0  # FAILED or CANCELLED, with their errors in failed_errors
    refused: int = 0  # starts refused (by code in refused_codes): not failures
    unfinished: int = 0  # accepted, and no end within op_wait_seconds (must be 0)
    checked: int = 0  # SUCCEEDED with no block left: its marker prefixes looked for elsewhere
    wrong_kv: int = 0  # marker blocks loaded from another agent whose content was not theirs (must be 0)
    blocks_lost: int = 0  # marker blocks of those served by no other agent (must be 0)
    blocks_unchecked: int = 0  # missing, but another agent was SIGKILLed since the drain began
    blocks_left_partial: int = 0  # missing after a drain that said it left blocks (no room): no loss
    moved_blocks: int = 0
    failed_errors: dict[str, int] = field(default_factory=dict)
    refused_codes: dict[str, int] = field(default_factory=dict)
    unfinished_op_ids: list[str] = field(default_factory=list)
    found_unanswered: int = 0  # accepted though their start was answered with an error
    uncordon_failed: int = 0  # drained agents left cordoned (the facade did not answer for 60 s)
    runs: list[str] = field(default_factory=list)  # one line per drain: agent, end, blocks, seconds


class Drains:
    """One thread that drains an agent every `drain_interval_seconds`, the agents in turn
    (to the others: kvctl drain's destinations), follows the drain to its end, then
    uncordons the agent. Before each, a few marker prefixes are stored on that agent and
    pinned (cluster-wide, so neither the source's eviction nor a destination's policy may
    drop them): after a drain SUCCEEDED with no block left, each must load, whole and
    right, from another agent. That is the honest check: the agent's other blocks may be
    dropped (policy, eviction) before or after they land without any loss to a user.
    `lock` is held from a drain's start to its uncordon: a fault that needs every agent
    in rotation (the handoff's destination must not be cordoned) takes it meanwhile.
    `killed_at` (agent -> monotonic time of its last SIGKILL) tells a marker lost with a
    destination killed after it landed, not counted lost."""

    def __init__(
        self,
        cfg: ChaosConfig,
        endpoints: list[str],
        model: Model,
        agent_addresses: dict[str, str],
        killed_at: dict[str, float],
        tokens: Callable[[int, int], list[int]],
    ):
        self.cfg = cfg
        self.endpoints = endpoints
        self.model = model
        self.addresses = agent_addresses
        self.killed_at = killed_at
        self.tokens = tokens
        self.stats = DrainStats()
        self.t_start = 0.0
        self.lock = threading.Lock()
        self.stop = threading.Event()  # no more drains; the one under way followed to its end
        self.abandon = threading.Event()  # none followed any more (the cluster is going away)
        self._thread = threading.Thread(target=self._run, name="chaos-drains", daemon=True)

    def start(self, t_start: float) -> None:
        self.t_start = t_start
        self._thread.start()

    def join(self, timeout_seconds: float | None = None) -> None:
        self.stop.set()
        self._thread.join(self.cfg.op_wait_seconds + 120 if timeout_seconds is None else timeout_seconds)

    def _run(self) -> None:
        facade = Facade(self.endpoints)
        order = itertools.cycle((HANDOFF_SOURCE, KEEPER, VICTIM))
        next_at = self.t_start + self.cfg.drain_interval_seconds / 2
        try:
            for n in itertools.count():
                if self.stop.wait(max(0.0, next_at - time.monotonic())):
                    return
                with self.lock:
                    self._one(facade, next(order), n)
                next_at = max(next_at + self.cfg.drain_interval_seconds, time.monotonic())
        finally:
            facade.close()

    def _one(self, facade: Facade, agent_id: str, n: int) -> None:
        m = self.model
        markers = [self.tokens(self.cfg.drain_marker_blocks, 1000 + 10 * n + i) for i in range(self.cfg.drain_markers)]
        pins: list[str] = []
        t0 = time.monotonic()
        try:
            engine = EngineClient(self.addresses[agent_id], timeout_seconds=5.0)
            try:
                for tokens in markers:
                    engine.store(m.model_id, tokens, m.kv(m.hashes(tokens)), namespace="drained")
            finally:
                engine.close()
            for i, tokens in enumerate(markers):
                pin_id = f"chaos-drain-{n}-{i}-{uuid.uuid4().hex[:6]}"
                facade.call(
                    lambda c, t=tokens, p=pin_id: c.pin(
                        model_id=m.model_id, token_ids=t, ttl_seconds=600, owner="kvcp-bench-chaos", pin_id=p
                    ),
                    5.0,
                )
                pins.append(pin_id)
        except (ClientError, grpc.RpcError) as exc:  # the agent is down, or a failover: no drain this turn
            if not isinstance(exc, ClientError):
                self._refused("markers not stored: agent down")
            else:  # (a refusal says why in its first words: a follower that knows no leader)
                self._refused(
                    f"pin: {exc.code}: {str(exc)[:40]}" if exc.code == "FAILED_PRECONDITION" else f"pin: {exc.code}"
                )
            self._unpin(facade, pins)
            return
        op: OperationView | None = None
        asked = time.time() - 5.0  # (this machine's clock is the control plane's)
        try:
            try:
                op = facade.call(lambda c: c.drain(agent_id, reason="kvcp-bench chaos"), 5.0)
            except ClientError as exc:
                op = self._find_unanswered(facade, agent_id, asked)
                if op is None:  # (a refusal says why in its first words: no room, not ready)
                    self._refused(f"{exc.code}: {str(exc)[:40]}" if exc.code == "FAILED_PRECONDITION" else exc.code)
                    return
            self.stats.started += 1
            op = self._follow(facade, op)
            if op is None:
                return
            self.stats.moved_blocks += op.num_done_blocks
            line = (
                f"{agent_id} at {t0 - self.t_start:.0f}s: "
                f"{op.state} {op.num_done_blocks}/{op.num_total_blocks} blocks "
                f"({op.num_failed_blocks} failed) in {time.monotonic() - t0:.1f}s"
            )
            if op.state != "SUCCEEDED":
                self.stats.failed += 1
                error = op.error[:ERROR_CHARS] + ("..." if len(op.error) > ERROR_CHARS else "") or "(no reason given)"
                key = error if op.state == "FAILED" else f"{op.state}: {error}"
                self.stats.failed_errors[key] = self.stats.failed_errors.get(key, 0) + 1
            else:
                self.stats.succeeded += 1
                line += self._check(agent_id, markers, t0, left=op.num_failed_blocks > 0)
            if op.error:
                line += f"; {op.error[:ERROR_CHARS]}"

            self.stats.runs.append(line)
        finally:
            self._uncordon(facade, agent_id)
            self._unpin(facade, pins)

    def _refused(self, code: str) -> None:
        self.stats.refused += 1
        self.stats.refused_codes[code] = self.stats.refused_codes.get(code, 0) + 1

    def _find_unanswered(self, facade: Facade, agent_id: str, asked: float) -> OperationView | None:
        """The drain of `agent_id` the control plane took though its answer was lost (a
        leader killed or stopped after it took it): followed like one answered."""
        with contextlib.suppress(ClientError):
            for op in facade.call(lambda c: c.list_operations(1000), 10.0):
                if op.kind == "drain" and op.params.get("agent") == agent_id and op.created_unix_seconds >= asked:
                    self.stats.found_unanswered += 1
                    return op
        return None

    def _follow(self, facade: Facade, op: OperationView) -> OperationView | None:
        """The drain at its end; None (counted unfinished) when it has none within the wait."""
        wait_end = time.monotonic() + self.cfg.op_wait_seconds
        while time.monotonic() < wait_end:
            if self.abandon.is_set():
                return None
            with contextlib.suppress(ClientError):  # not answered now (a failover, etcd away): asked again
                got = facade.call(lambda c: c.get_operation(op.op_id), 2.0)
                if got.finished:
                    return got
            time.sleep(0.25)
        self.stats.unfinished += 1
        self.stats.unfinished_op_ids.append(op.op_id)
        return None

    def _check(self, agent_id: str, markers: list[list[int]], since: float, left: bool) -> str:
        """Each marker prefix served, whole and right, by an agent other than the drained one.
        `left`: the drain said it left blocks (no room): one missing is counted apart, no loss."""
        m = self.model
        self.stats.checked += not left
        lost = wrong = 0
        for tokens in markers:
            hashes = m.hashes(tokens)
            served = False
            for other, address in self.addresses.items():
                if other == agent_id:
                    continue
                engine = EngineClient(address, timeout_seconds=5.0)
                try:
                    loaded = engine.load(m.model_id, tokens)
                except grpc.RpcError:
                    continue
                finally:
                    engine.close()
                n = loaded.num_cached_tokens // m.block_size
                bad = m.wrong_blocks(loaded.kv, hashes, n)
                wrong += bad
                if n == len(hashes) and not bad:
                    served = True
                    break
            if served:
                continue
            if any(t >= since for a, t in self.killed_at.items() if a in self.addresses and a != agent_id):
                self.stats.blocks_unchecked += len(hashes)
            else:
                lost += len(hashes)
        if left:
            self.stats.blocks_left_partial += lost
        else:
            self.stats.blocks_lost += lost
        self.stats.wrong_kv += wrong
        missing = "left (the drain left blocks)" if left else "LOST"
        return f"; markers: {lost} blocks {missing}, {wrong} wrong" if lost or wrong else ""

    def _uncordon(self, facade: Facade, agent_id: str) -> None:
        if self.abandon.is_set():
            return
        try:
            facade.call(lambda c: c.uncordon(agent_id), 60.0)
        except ClientError:
            self.stats.uncordon_failed += 1

    def _unpin(self, facade: Facade, pins: list[str]) -> None:
        for pin_id in [] if self.abandon.is_set() else pins:
            with contextlib.suppress(ClientError):  # a pin left expires with its TTL
                facade.call(lambda c, p=pin_id: c.unpin(p), 10.0)


# ---- the run --------------------------------------------------------------------------


class Chaos:
    def __init__(self, cfg: ChaosConfig, report: Callable[[str], None]):
        self.cfg = cfg
        self.report = report
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="kvcp-chaos-")).resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = die_with_parent()
        self.procs = Processes(self.log_dir, self.prefix)
        self.etcd: EtcdServer | None = None
        # every port of the run at once, so no two are the same (an agent got etcd's)
        ports = free_ports(len(REPLICAS) + len(AGENTS) + 2)
        self.etcd_ports = (ports[0], ports[1])
        self.cp_ports = dict(zip(REPLICAS, ports[2 : 2 + len(REPLICAS)], strict=True))
        self.agent_ports = dict(zip(AGENTS, ports[2 + len(REPLICAS) :], strict=True))
        self.endpoints = [f"127.0.0.1:{p}" for p in self.cp_ports.values()]
        self.replica_of = {f"127.0.0.1:{p}": name for name, p in self.cp_ports.items()}
        self.facade = Facade(self.endpoints)
        self.model: Model | None = None
        self.drains: Drains | None = None
        self.t_start = 0.0
        self._probe_tokens: list[int] = []
        # the recovery probe's failures: when, how long, which call, why (a slow recovery's story)
        self.probe_errors: list[str] = []

    # ---- cluster --------------------------------------------------------------------
    def _start_cluster(self) -> None:
        etcd_dir = self.log_dir / "etcd"
        self.etcd = EtcdServer(str(etcd_dir), ports=self.etcd_ports).start(command_prefix=self.prefix)
        self.report(f"chaos: etcd at {self.etcd.endpoint}; logs in {self.log_dir}")
        for name, port in self.cp_ports.items():
            self.procs.start(
                name,
                [
                    console_script("kvcp-controlplane"),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--etcd",
                    self.etcd.endpoint,
                    "--election-ttl-seconds",
                    str(self.cfg.election_ttl_seconds),
                    "--metrics-listen",
                    "",
                ],
            )
        for name, port in self.agent_ports.items():
            argv = [
                console_script("kvcp-agent"),
                "--agent-id",
                name,
                "--listen",
                f"127.0.0.1:{port}",
                "--etcd",
                self.etcd.endpoint,
                "--lease-ttl-seconds",
                str(self.cfg.agent_lease_ttl_seconds),
                "--cpu-capacity",
                self.cfg.agent_cpu_capacity,
                "--metrics-listen",
                "",
                "--model",
                WORKLOAD_MODEL,
                "--model",
                HANDOFF_MODEL,
            ]
            if name == KEEPER:  # where the tier moves go
                argv += ["--disk-dir", str(self._keeper_disk()), "--disk-capacity", self.cfg.keeper_disk_capacity]
            if name == HANDOFF_SOURCE and handoff_available():
                argv += ["--link-bandwidth", self.cfg.handoff_link_bandwidth]
            self.procs.start(name, argv)
        self._wait(lambda: self._ready_agents() == set(AGENTS), 90, "3 agents ready behind a leader")
        models = {m["model_id"]: m for m in self.facade.call(lambda c: c.stats(), 20).models}
        self.model = Model(models[WORKLOAD_MODEL.partition(":")[0]])
        self.big = Model(models[HANDOFF_MODEL.partition(":")[0]])
        self.report(f"chaos: 2 control-plane replicas, 3 agents up; model {self.model.model_id}")

    def _keeper_disk(self) -> Path:
        return self.log_dir / f"{KEEPER}-disk"

    def _ready_agents(self) -> set[str]:
        try:
            agents = self.facade.call(lambda c: c.list_agents(), 5)
        except ClientError:
            return set()
        return {a.agent_id for a in agents if a.state == "ready"}

    def _wait(self, predicate: Callable[[], bool], timeout_seconds: float, what: str) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout_seconds:.0f}s waiting for {what} (logs: {self.log_dir})")

    def _until(self, predicate: Callable[[], bool], since: float, timeout_seconds: float) -> float | None:
        """Seconds from `since` until predicate() holds; None past the timeout."""
        deadline = since + timeout_seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(ClientError, grpc.RpcError):
                if predicate():
                    return time.monotonic() - since
            time.sleep(0.25)
        return None

    def _engine(self, agent_id: str) -> EngineClient:
        return EngineClient(f"127.0.0.1:{self.agent_ports[agent_id]}", timeout_seconds=10.0)

    def _store(self, agent_id: str, tokens: list[int], namespace: str = "", model: Model | None = None) -> None:
        model = model or self.model
        engine = self._engine(agent_id)
        try:
            engine.store(model.model_id, tokens, model.kv(model.hashes(tokens)), namespace=namespace)
        finally:
            engine.close()

    def _tokens(self, n_blocks: int, salt: int, model: Model | None = None) -> list[int]:
        r = np.random.default_rng(10_000 + salt)
        return r.integers(0, 32000, n_blocks * (model or self.model).block_size).tolist()

    # ---- pins and the recovery probe --------------------------------------------------
    def _make_pins(self, ttl_seconds: float) -> list[tuple[str, list[int]]]:
        pins = []
        for i in range(self.cfg.num_pins):
            tokens = self._tokens(8, salt=i)
            self._store(KEEPER, tokens, namespace="pinned")
            pin_id = f"chaos-{i}-{uuid.uuid4().hex[:8]}"  # one id for every retry: one pin
            pin = self.facade.call(
                lambda c, t=tokens, p=pin_id: c.pin(
                    model_id=self.model.model_id,
                    token_ids=t,
                    ttl_seconds=ttl_seconds,
                    owner="kvcp-bench-chaos",
                    pin_id=p,
                ),
                30,
            )
            pins.append((pin.pin_id, tokens))
        return pins

    def _probe(self) -> bool:
        """A lookup and a pin (then its unpin) through the facade, each in a few seconds."""
        m = self.model
        t0 = time.monotonic()
        what = "lookup"
        try:
            self.facade.call(lambda c: c.lookup(m.model_id, self._probe_tokens), 3)
            what = "pin"
            pin = self.facade.call(
                lambda c: c.pin(model_id=m.model_id, token_ids=self._probe_tokens, ttl_seconds=30, owner="probe"), 3
            )
        except ClientError as exc:
            self.probe_errors.append(
                f"{t0 - self.t_start:.1f}+{time.monotonic() - t0:.1f}s {what} {exc.code}: {str(exc)[:100]}"
            )
            return False
        with contextlib.suppress(ClientError):
            self.facade.call(lambda c: c.unpin(pin.pin_id), 3)
        return True

    def _leader(self) -> str:
        """The replica that leads now (by name), after an election if one is under way."""
        found = {}

        def known() -> bool:
            roles = {name: replica_role(ep) for ep, name in self.replica_of.items()}
            leaders = [n for n, r in roles.items() if r == "leader"]
            found["leader"] = leaders[0] if len(leaders) == 1 else ""
            return bool(found["leader"])

        self._wait(known, self.cfg.recovery_timeout_seconds, "one leader")
        return found["leader"]

    def _endpoint(self, replica: str) -> str:
        return f"127.0.0.1:{self.cp_ports[replica]}"

    # ---- faults ---------------------------------------------------------------------
    def _recovery(self, since: float) -> float | None:
        return self._until(self._probe, since, self.cfg.recovery_timeout_seconds)

    def fault_agent_kill(self) -> FaultResult:
        t0 = time.monotonic()
        self.procs.signal(VICTIM, signal.SIGKILL)
        recovery = self._recovery(t0)
        time.sleep(1.0)
        self.procs.restart(VICTIM)
        back = self._until(lambda: VICTIM in self._ready_agents(), t0, self.cfg.recovery_timeout_seconds)
        return FaultResult(
            "agent_sigkill",
            recovery is not None and back is not None,
            recovery,
            back_seconds=back,
            detail=f"{VICTIM} killed, restarted 1 s later; back = ready again in the index",
        )

    def fault_leader_kill(self) -> FaultResult:
        leader = self._leader()
        t0 = time.monotonic()
        self.procs.signal(leader, signal.SIGKILL)
        recovery = self._recovery(t0)
        new = self._leader() if recovery is not None else ""
        self.procs.restart(leader)
        endpoint = self._endpoint(leader)
        back = self._until(lambda: replica_role(endpoint) == "follower", t0, self.cfg.recovery_timeout_seconds)
        return FaultResult(
            "leader_sigkill",
            recovery is not None and back is not None,
            recovery,
            back_seconds=back,
            detail=f"{leader} killed, {new or 'nobody'} took over; back = {leader} restarted and following",
        )

    def fault_leader_pause(self) -> FaultResult:
        leader = self._leader()
        t0 = time.monotonic()
        self.procs.signal(leader, signal.SIGSTOP)
        try:
            recovery = self._recovery(t0)
            time.sleep(max(0.0, t0 + self.cfg.leader_pause_seconds - time.monotonic()))
        finally:
            self.procs.signal(leader, signal.SIGCONT)
        endpoint = self._endpoint(leader)
        back = self._until(lambda: replica_role(endpoint) == "follower", t0, self.cfg.recovery_timeout_seconds)
        return FaultResult(
            "leader_sigstop",
            recovery is not None and back is not None,
            recovery,
            back_seconds=back,
            detail=f"{leader} stopped for {self.cfg.leader_pause_seconds:.0f}s, then continued; "
            f"back = it follows (fenced) after SIGCONT",
        )

    def fault_etcd_pause(self) -> FaultResult:
        lookups = stale = tries = 0
        pins: dict[str, int] = {}  # outcome of each pin tried during the outage
        t0 = time.monotonic()
        self.etcd.pause()
        try:
            while time.monotonic() < t0 + self.cfg.etcd_pause_seconds:
                tries += 1
                try:
                    view = self.facade.call(lambda c: c.lookup(self.model.model_id, self._probe_tokens), 2)
                    lookups += 1
                    stale += view.possibly_stale
                except ClientError:
                    pass
                if time.monotonic() > t0 + self.cfg.etcd_pause_seconds - 4.0:
                    time.sleep(0.5)
                    continue  # a pin asked now could be answered after etcd is back
                try:
                    pin = self.facade.call(
                        lambda c: c.pin(model_id=self.model.model_id, token_ids=self._probe_tokens, ttl_seconds=5), 1
                    )
                    outcome = "accepted"
                    with contextlib.suppress(ClientError):
                        self.facade.call(lambda c, p=pin: c.unpin(p.pin_id), 1)
                except ClientError as exc:
                    outcome = exc.code
                pins[outcome] = pins.get(outcome, 0) + 1
                time.sleep(0.5)
        finally:
            self.etcd.resume()
        t1 = time.monotonic()
        recovery = self._recovery(t1)
        back = self._until(lambda: self._ready_agents() == set(AGENTS), t1, self.cfg.recovery_timeout_seconds)
        pin_text = ", ".join(f"{n} {code}" for code, n in sorted(pins.items()))
        return FaultResult(
            "etcd_sigstop_10s",
            recovery is not None and back is not None and not pins.get("accepted"),
            recovery,
            back_seconds=back,
            detail=f"during the outage {lookups}/{tries} lookups answered ({stale} flagged possibly_stale); "
            f"pins tried: {pin_text}; timed from etcd's return; back = all agents ready",
        )

    def fault_etcd_kill(self) -> FaultResult:
        """etcd SIGKILLed and started again on its data after `etcd_down_seconds`: the
        control plane's etcd client must reconnect within about a second of its return
        (gRPC's own backoff grew with the outage: 4-8 s after 18 s down)."""
        lookups = tries = 0
        t0 = time.monotonic()
        self.etcd.proc.kill()
        self.etcd.proc.wait()
        self.etcd.stop()  # closes its log
        while time.monotonic() < t0 + self.cfg.etcd_down_seconds:
            tries += 1
            with contextlib.suppress(ClientError):  # counted: lookups answered of those tried
                self.facade.call(lambda c: c.lookup(self.model.model_id, self._probe_tokens), 2)
                lookups += 1
            time.sleep(0.5)
        self.etcd.start(command_prefix=self.prefix)
        t1 = time.monotonic()
        recovery = self._recovery(t1)
        back = self._until(lambda: self._ready_agents() == set(AGENTS), t1, self.cfg.recovery_timeout_seconds)
        return FaultResult(
            f"etcd_sigkill_{self.cfg.etcd_down_seconds:.0f}s",
            recovery is not None and back is not None,
            recovery,
            back_seconds=back,
            detail=f"down {self.cfg.etcd_down_seconds:.0f}s, started again on its data; {lookups}/{tries} lookups "
            "answered meanwhile; timed from etcd answering again; back = all agents ready",
        )

    def fault_handoff_kill(self) -> FaultResult:
        if not handoff_available():
            return FaultResult("handoff_kill", False, None, detail="not available: no handoff in this build")
        # no drain meanwhile: a drained (cordoned) destination refuses the handoff
        with self.drains.lock if self.drains is not None else contextlib.nullcontext():
            return self._handoff_kill()

    def _handoff_kill(self) -> FaultResult:
        m = self.big
        tokens = self._tokens(self.cfg.handoff_blocks, salt=99, model=m)
        hashes = m.hashes(tokens)
        self._store(HANDOFF_SOURCE, tokens, model=m)
        self._wait(
            lambda: any(
                a.agent_id == HANDOFF_SOURCE and a.num_hit_blocks == len(hashes)
                for a in self.facade.call(lambda c: c.lookup(m.model_id, tokens), 5).agents
            ),
            30,
            "the handoff prefix indexed",
        )
        op = self.facade.call(
            lambda c: c.transfer(m.model_id, HANDOFF_SOURCE, VICTIM, token_ids=tokens, deadline_seconds=10), 10
        )
        time.sleep(1.5)  # reserved, the first 16 MiB written, the rest waiting for the link
        t0 = time.monotonic()
        self.procs.signal(VICTIM, signal.SIGKILL)
        recovery = self._recovery(t0)
        time.sleep(1.0)
        self.procs.restart(VICTIM)
        final = {}

        def finished() -> bool:
            final["op"] = self.facade.call(lambda c: c.get_operation(op.op_id), 5)
            return final["op"].finished and VICTIM in self._ready_agents()

        back = self._until(finished, t0, self.cfg.recovery_timeout_seconds)
        # whatever the victim holds of the prefix now is what it loads, and it must be right
        engine = self._engine(VICTIM)
        try:
            loaded = engine.load(m.model_id, tokens)
            n = loaded.num_cached_tokens // m.block_size
            wrong = m.wrong_blocks(loaded.kv, hashes, n)
        finally:
            engine.close()
        src = self._engine(HANDOFF_SOURCE)
        try:
            loaded = src.load(m.model_id, tokens)
            wrong += m.wrong_blocks(loaded.kv, hashes, loaded.num_cached_tokens // m.block_size)
        finally:
            src.close()
        self.handoff_wrong = wrong
        state = final["op"].state if "op" in final else "unknown"
        error = final["op"].error if "op" in final else ""
        error = f" ({error[:150]}{'...' if len(error) > 150 else ''})" if error else ""
        return FaultResult(
            "handoff_kill",
            recovery is not None and back is not None and not wrong,
            recovery,
            back_seconds=back,
            detail=f"{VICTIM} (destination of {len(hashes)} blocks from {HANDOFF_SOURCE}) killed mid-handoff; "
            f"operation {state}{error}; {wrong} wrong blocks on either side afterwards; "
            f"back = operation finished and {VICTIM} ready",
        )

    # ---- the whole run --------------------------------------------------------------
    def run(self) -> ChaosResult:
        cfg = self.cfg
        self.handoff_wrong = 0
        load: Load | None = None
        moves: Moves | None = None
        drains: Drains | None = None
        try:
            self._start_cluster()
            self._probe_tokens = self._tokens(2, salt=7)
            faults = [
                self.fault_agent_kill,
                self.fault_leader_kill,
                self.fault_leader_pause,
                self.fault_etcd_pause,
                self.fault_etcd_kill,
                self.fault_handoff_kill,
            ]
            pin_ttl = cfg.seconds + len(faults) * cfg.recovery_timeout_seconds * 2 + 600
            pins = self._make_pins(pin_ttl)
            load = Load(cfg, self.endpoints, self.model, {a: f"127.0.0.1:{p}" for a, p in self.agent_ports.items()})
            keeper_address = f"127.0.0.1:{self.agent_ports[KEEPER]}"
            moves = Moves(cfg, self.endpoints, self.model, keeper_address, self._tokens(cfg.moved_blocks, salt=11))
            drains = self.drains = Drains(
                cfg, self.endpoints, self.model, load.addresses, self.procs.killed_at, self._tokens
            )
            self.t_start = time.monotonic()
            load.start(fill_agent=KEEPER)
            moves.start()
            drains.start(self.t_start)
            self.report(
                f"chaos: load started ({cfg.rate_per_second:g} requests/s); {len(pins)} pins held; "
                f"a tier move every {cfg.move_interval_seconds:g}s, a drain every {cfg.drain_interval_seconds:g}s"
            )
            results: list[FaultResult] = []
            for i, fault in enumerate(faults):
                at = self.t_start + cfg.seconds * (i + 1) / (len(faults) + 1.5)
                time.sleep(max(0.0, at - time.monotonic()))
                started = time.monotonic() - self.t_start
                try:
                    r = fault()
                except (ClientError, grpc.RpcError, RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    name = fault.__name__.removeprefix("fault_")
                    r = FaultResult(name, False, None, detail=f"the fault itself failed: {exc}")
                r.at_seconds = round(started, 1)
                results.append(r)
                took = "" if r.recovery_seconds is None else f" in {r.recovery_seconds:.1f}s"
                self.report(
                    f"chaos: t={started:5.1f}s {r.fault}: {'recovered' if r.recovered else 'NOT recovered'}{took}"
                )
            time.sleep(max(0.0, self.t_start + cfg.seconds - time.monotonic()))
            load.join()
            drains.stop.set()  # none after the load (the one under way is followed below)
            elapsed = time.monotonic() - self.t_start
            moves.join()  # the operations still running, followed to their end
            drains.join()  # the drain under way followed to its end, its agent uncordoned
            held = {p.pin_id for p in self.facade.call(lambda c: c.list_pins(), 60)}
            pins_lost = sum(1 for pin_id, _ in pins if pin_id not in held)
            evicted = 0
            engine = self._engine(KEEPER)
            try:
                for _, tokens in pins:
                    evicted += len(self.model.hashes(tokens)) - engine.lookup(self.model.model_id, tokens) // (
                        self.model.block_size
                    )
            finally:
                engine.close()
            # the pins were under pressure only if the tier that holds them was full
            keeper = next(a for a in self.facade.call(lambda c: c.list_agents(), 30) if a.agent_id == KEEPER)
            cpu = next((t for t in keeper.tiers if t.tier == "cpu"), None)
            s, ms, ds = load.stats, moves.stats, drains.stats
            return ChaosResult(
                seconds=round(elapsed, 1),
                requests=s.requests,
                served=s.served,
                wrong_kv_served=s.wrong_kv_served + self.handoff_wrong + ds.wrong_kv,
                pins_lost=pins_lost,
                pinned_blocks_evicted=evicted,
                faults=results,
                lookups_failed=s.lookups_failed,
                requests_failed=s.requests_failed,
                hit_tokens=s.hit_tokens,
                prompt_tokens=s.prompt_tokens,
                log_dir=str(self.log_dir),
                ops_started=ms.started,
                ops_succeeded=ms.succeeded,
                ops_failed=ms.failed,
                ops_refused=ms.refused,
                ops_unfinished=ms.unfinished,
                ops_failed_errors=ms.failed_errors,
                ops_refused_codes=ms.refused_codes,
                drains_started=ds.started,
                drains_succeeded=ds.succeeded,
                drains_failed=ds.failed,
                drains_refused=ds.refused,
                drains_unfinished=ds.unfinished,
                drain_blocks_lost=ds.blocks_lost,
                drains_failed_errors=ds.failed_errors,
                drains_refused_codes=ds.refused_codes,
                stats={
                    "engine_errors": s.engine_errors,
                    "stored_blocks": s.stored_blocks,
                    "pin_holder_cpu_used_fraction": round(cpu.used_bytes / cpu.capacity_bytes, 3) if cpu else None,
                    "ops_moved_blocks": ms.moved_blocks,
                    "ops_unfinished_op_ids": ms.unfinished_op_ids,
                    "ops_failed_op_ids": ms.failed_op_ids,
                    "ops_found_unanswered": ms.found_unanswered,
                    "probe_errors": self.probe_errors,
                    "drains_moved_blocks": ds.moved_blocks,
                    "drains_checked": ds.checked,
                    "drain_blocks_unchecked": ds.blocks_unchecked,
                    "drain_blocks_left_partial": ds.blocks_left_partial,
                    "drains_uncordon_failed": ds.uncordon_failed,
                    "drains_unfinished_op_ids": ds.unfinished_op_ids,
                    "drains_found_unanswered": ds.found_unanswered,
                    "drains": ds.runs,
                },
            )
        finally:
            if load is not None:
                load.stop.set()
            if moves is not None:
                moves.abandon.set()
            if drains is not None:
                drains.stop.set()
                drains.abandon.set()
            self.facade.close()
            self.procs.stop_all()
            if self.etcd is not None:
                self.etcd.stop()
                shutil.rmtree(self.log_dir / "etcd" / "data", ignore_errors=True)
            shutil.rmtree(self._keeper_disk(), ignore_errors=True)
            if load is not None:
                load.join()
            if moves is not None:
                moves.join()
            if drains is not None:
                drains.join(10)  # (abandoned: its last call to a stopped cluster need not be waited out)


def handoff_available() -> bool:
    """The handoff feature: a Transfer RPC in the contract and `transfer` on the facade."""
    from protos.kvcp.v1 import admin_pb2

    return "Transfer" in admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods_by_name and hasattr(
        ControlPlaneClient, "transfer"
    )


def run(cfg: ChaosConfig, report: Callable[[str], None] = print) -> ChaosResult:
    """Run it; SIGTERM stops it like Ctrl-C (KeyboardInterrupt), cleaning up first."""
    if cfg.seconds <= 0 or cfg.workers < 1:
        raise ValueError("--seconds and --workers must be positive")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        return Chaos(cfg, report).run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def format_table(r: ChaosResult) -> str:
    def secs(v):
        return "-" if v is None else f"{v:.1f}"

    def counted(reasons: dict[str, int]) -> str:
        return " (" + "; ".join(f"{n}x {why}" for why, n in sorted(reasons.items())) + ")" if reasons else ""

    hit = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
    lines = [
        f"{'FIELD':22s} VALUE",
        f"{'seconds':22s} {r.seconds}",
        f"{'requests':22s} {r.requests}",
        f"{'served':22s} {r.served} ({r.requests_failed} failed; {r.lookups_failed} routed without a lookup)",
        f"{'wrong_kv_served':22s} {r.wrong_kv_served}",
        f"{'pins_lost':22s} {r.pins_lost}",
        f"{'pinned_blocks_evicted':22s} {r.pinned_blocks_evicted} (their agent's cpu tier "
        f"{(r.stats.get('pin_holder_cpu_used_fraction') or 0):.0%} full)",
        f"{'hit ratio':22s} {hit:.1%}",
        f"{'ops_started':22s} {r.ops_started} (tier moves accepted)",
        f"{'ops_succeeded':22s} {r.ops_succeeded} ({r.stats.get('ops_moved_blocks', 0)} blocks moved in all)",
        f"{'ops_failed':22s} {r.ops_failed}{counted(r.ops_failed_errors)}",
        f"{'ops_refused':22s} {r.ops_refused}{counted(r.ops_refused_codes)}",
        f"{'ops_unfinished':22s} {r.ops_unfinished}",
        f"{'drains_started':22s} {r.drains_started} (drains accepted, an agent at a time)",
        f"{'drains_succeeded':22s} {r.drains_succeeded} ({r.stats.get('drains_moved_blocks', 0)} blocks handed off; "
        f"{r.stats.get('drains_checked', 0)} with none left, their pinned markers checked elsewhere)",
        f"{'drains_failed':22s} {r.drains_failed}{counted(r.drains_failed_errors)}",
        f"{'drains_refused':22s} {r.drains_refused}{counted(r.drains_refused_codes)}",
        f"{'drains_unfinished':22s} {r.drains_unfinished}",
        f"{'drain_blocks_lost':22s} {r.drain_blocks_lost}",
        "",
        f"{'FAULT':18s} {'AT':>6s} {'RECOVERED':9s} {'RECOVERY_S':>10s} {'BACK_S':>7s}  DETAIL",
    ]
    for f in r.faults:
        lines.append(
            f"{f.fault:18s} {f.at_seconds:6.1f} {'yes' if f.recovered else 'NO':9s} "
            f"{secs(f.recovery_seconds):>10s} {secs(f.back_seconds):>7s}  {f.detail}"
        )
    lines += ["", f"logs: {r.log_dir}"]
    return "\n".join(lines)
