"""`kvcp-bench handoff`: prefill -> decode handoff throughput between two agent processes,
next to the raw Mooncake Transfer Engine between the same two processes, in one run.

Two worker processes each run a real agent (`agent.server.Agent`, its gRPC servers,
its engine with the CPU slab registered, its etcd registration). For each payload the
driver asks, in turn:

- `raw`: the sender's engine writes the payload from its slab into the receiver's
  slab, the better of one `transfer_sync_write` and the same bytes as writes of the
  agent's batch size submitted four at a time (what the engine alone achieves either
  way; no reserve, no checksum, no visibility);
- `engine`: a kvcp handoff of a prefix of the same bytes (blocks of `--block-mib`),
  Reserve, engine writes of every block into the reserved pages, per-block xxh3 verify,
  commit: the blocks are loadable on the receiver afterwards (checked);
- `grpc`: the same handoff over the fallback path (chunked gRPC stream);
- `shm`: the same handoff over the same-host path (the receiver's slab is a memfd the
  sender maps, copied by `shm_copy_threads` threads side by side; the receiver verifies),
  next to `raw_memcpy`: the sender copying the same bytes into the receiver's mapped slab
  with as many threads and nothing else (what the machine's memory does alone). `ratio` stays against the raw engine;
  `memcpy_ratio` is against raw_memcpy.

Figures are the best of `--repeats` (the receiver drops the blocks between runs). A
last scenario kills a third receiver process with SIGKILL while a handoff to it is on
the wire and reports the sender's definite answer and how long it took.

The machine is shared and small; compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

MIB = 1 << 20


@dataclass
class PathResult:
    payload_bytes: int
    path: str  # engine | grpc
    gbps: float
    raw_engine_gbps: float | None  # None (JSON null): no engine here to measure
    ratio: float | None
    seconds: float
    num_blocks: int
    median_gbps: float = 0.0
    median_raw_engine_gbps: float | None = None
    median_ratio: float | None = None
    raw_memcpy_gbps: float = 0.0  # shm rows: the same bytes with one memcpy into the mapped slab
    memcpy_ratio: float = 0.0
    # raw_engine_gbps is the better of these two ways of driving the engine alone (best of repeats)
    raw_engine_sync_gbps: float = 0.0  # one blocking transfer_sync_write of every byte
    raw_engine_windowed_gbps: float = 0.0  # the agent's batch size, submitted four at a time


def _spec(block_mib: int):
    from agent.core.model_spec import ModelSpec

    # [layers, 2, 32 tokens, 8 heads, 128] fp16 = 1 MiB per 8 layers
    return ModelSpec(f"bench-{block_mib}m", block_size=32, num_layers=8 * block_mib, num_kv_heads=8, head_dim=128)


# ---- worker process ----------------------------------------------------------------------


def worker(agent_id: str, etcd: str, block_mib: int, capacity_bytes: int, engine: str, chunk_bytes: int) -> None:
    """One agent in this process; JSON commands on stdin, one JSON answer per line."""
    import logging

    import torch

    from agent.dataplane import DataPlaneConfig
    from agent.server import Agent, AgentConfig
    from protos.block_hash import hash_prefix, split_hashes

    logging.basicConfig(level=logging.ERROR)
    spec = _spec(block_mib)
    agent = Agent(
        AgentConfig(
            agent_id=agent_id,
            listen="127.0.0.1:0",
            etcd=etcd,
            models=[spec],
            cpu_capacity_bytes=capacity_bytes,
            lease_ttl_seconds=5,
            transfer_engine=engine,
            dataplane=DataPlaneConfig(chunk_bytes=chunk_bytes),
        ),
        log_fn=lambda m: None,
    ).start()
    dp = agent.dataplane
    dp.store.slab.fill_(0)  # touch every page once: neither side pays first-touch page faults in a figure
    out = sys.stdout

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def prompt(n: int, seed: int):
        tokens = [seed * 1_000_003 + i for i in range(n * spec.block_size)]
        return tokens, split_hashes(hash_prefix(spec.model_id, tokens, spec.block_size))

    info = agent.info()
    reply(
        address=agent.address,
        endpoint=dp.engine.endpoint if dp.engine_up else "",
        slab_address=dp.store.slab.data_ptr(),
        slab_bytes=dp.store.slab.numel(),
        engine=dp.engine.status,
        shm_path=info.shm_path,
        shm_inode=info.shm_inode,
    )
    mapped = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["cmd"]
        if op == "store":
            tokens, _ = prompt(cmd["blocks"], cmd["seed"])
            g = torch.Generator().manual_seed(cmd["seed"])
            kv = torch.randint(-1000, 1000, (cmd["blocks"], *spec.block_shape), generator=g).to(spec.torch_dtype)
            r = agent.engine.store(spec.model_id, tokens, kv)
            reply(stored=r.num_stored_blocks)
        elif op == "raw":
            # the engine alone, two ways: one blocking write of every byte, and the same bytes
            # as submitted writes of the agent's batch size, as many on the wire at once as the
            # agent keeps (no reserve, no checksum, no Python protocol between them)
            src, dst, n = dp.store.slab.data_ptr(), cmd["dst"], cmd["bytes"]
            t0 = time.perf_counter()
            dp.engine.write(cmd["endpoint"], [(src, dst, n)])
            one = time.perf_counter() - t0
            parts = [(src + o, dst + o, min(chunk_bytes, n - o)) for o in range(0, n, chunk_bytes)]
            window = dp.config.engine_window
            t0 = time.perf_counter()
            inflight = []
            while parts or inflight:
                while parts and len(inflight) < window:
                    inflight.append(dp.engine.submit(cmd["endpoint"], [parts.pop(0)]))
                while inflight and inflight[0].poll():
                    inflight.pop(0)
                if inflight:
                    time.sleep(0.0002)
            windowed = time.perf_counter() - t0
            reply(seconds=min(one, windowed), sync_seconds=one, windowed_seconds=windowed)
        elif op == "raw_memcpy":
            from agent.store.shm import PeerSlab

            key = (cmd["path"], cmd["inode"], cmd["dst"], cmd["slab_bytes"])
            peer = mapped.get(key) or mapped.setdefault(key, PeerSlab(*key))
            t0 = time.perf_counter()
            peer.write([(dp.store.slab.data_ptr(), cmd["dst"], cmd["bytes"])], dp.copier, dp.config.shm_copy_threads)
            reply(seconds=time.perf_counter() - t0)
        elif op == "handoff":
            _, hashes = prompt(cmd["blocks"], cmd["seed"])
            t0 = time.perf_counter()
            r = dp.handoff(spec.model_id, hashes, cmd["to"], cmd.get("deadline", 60.0), paths=tuple(cmd["paths"]))
            reply(
                seconds=time.perf_counter() - t0,
                outcome=r.outcome,
                path=r.path,
                sent_bytes=r.sent_bytes,
                reason=r.reason,
                attempts=r.attempts,
            )
        elif op == "check":
            tokens, hashes = prompt(cmd["blocks"], cmd["seed"])
            reply(num_leading=agent.pool.num_leading(hashes))
        elif op == "drop":
            agent.pool.cleanup(0.0)
            reply(used_bytes=dp.store.used_bytes)
        elif op == "quit":
            reply(bye=True)
            break
    agent.stop()


class Worker:
    def __init__(
        self, agent_id: str, etcd: str, block_mib: int, capacity_bytes: int, engine: str = "mooncake", chunk_bytes=0
    ):
        env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        self.agent_id = agent_id
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.handoff",
                agent_id,
                etcd,
                str(block_mib),
                str(capacity_bytes),
                engine,
                str(chunk_bytes or 8 * MIB),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker {self.agent_id} exited (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit")
                self.proc.wait(10)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()


# ---- etcd for the run ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Etcd:
    def __init__(self):
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (apt-get install -y etcd-server), or pass --etcd HOST:PORT")
        self.dir = tempfile.mkdtemp(prefix="kvcp-bench-etcd-")
        port, peer = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "--data-dir",
                os.path.join(self.dir, "data"),
                "--listen-client-urls",
                f"http://{self.endpoint}",
                "--advertise-client-urls",
                f"http://{self.endpoint}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        from protos.etcd_keys import connect

        connect(self.endpoint, wait_seconds=20, log=lambda m: None).close()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the run -------------------------------------------------------------------------


def run(
    sizes_mib: tuple[int, ...], block_mib: int, repeats: int, etcd: str = "", fault: bool = True, chunk_mib: int = 8
) -> dict:
    own = None if etcd else _Etcd()
    endpoint = etcd or own.endpoint
    capacity = (max(sizes_mib) + 2 * block_mib + 8) * MIB
    sender = receiver = None
    results: list[PathResult] = []
    notes: list[str] = []
    fault_result: dict = {}
    try:
        sender = Worker("bench-prefill", endpoint, block_mib, capacity, chunk_bytes=chunk_mib * MIB)
        receiver = Worker("bench-decode", endpoint, block_mib, capacity, chunk_bytes=chunk_mib * MIB)
        engine_up = bool(sender.hello["endpoint"] and receiver.hello["endpoint"])
        if not engine_up:
            notes.append(f"transfer engine unavailable: {sender.hello['engine']}; only the gRPC path is measured")
        shm_up = bool(receiver.hello.get("shm_path"))
        if not shm_up:
            notes.append("the receiver's slab is not in shared memory: the shm path is not measured")
        paths = (("shm",) if shm_up else ()) + (("engine", "grpc") if engine_up else ("grpc",))
        for k, size in enumerate(sizes_mib):
            n = max(1, size // block_mib)
            nbytes = n * block_mib * MIB
            seed = 100 + k
            sender.call(cmd="store", blocks=n, seed=seed)
            # interleaved (raw engine, raw memcpy, then each path) x repeats: each figure sees the same
            # machine load; best of repeats. A first round is not timed: the first engine write
            # between two processes, the first copy through a fresh mapping and a path's first
            # handoff pay one-off costs (connections, page-table faults) on either side alike
            times: dict[str, list[float]] = {p: [] for p in ("raw", "raw_sync", "raw_windowed", "raw_memcpy", *paths)}
            for trial in range(repeats + 1):
                into = times if trial else {p: [] for p in times}  # the warm-up's: dropped
                if shm_up:
                    receiver.call(cmd="drop")
                    into["raw_memcpy"].append(
                        sender.call(
                            cmd="raw_memcpy",
                            path=receiver.hello["shm_path"],
                            inode=receiver.hello["shm_inode"],
                            dst=receiver.hello["slab_address"],
                            slab_bytes=receiver.hello["slab_bytes"],
                            bytes=nbytes,
                        )["seconds"]
                    )
                if engine_up:
                    receiver.call(cmd="drop")
                    t = sender.call(
                        cmd="raw",
                        endpoint=receiver.hello["endpoint"],
                        dst=receiver.hello["slab_address"],
                        bytes=nbytes,
                        repeats=1,
                    )
                    into["raw"].append(t["seconds"])
                    into["raw_sync"].append(t["sync_seconds"])
                    into["raw_windowed"].append(t["windowed_seconds"])
                for path in paths:
                    receiver.call(cmd="drop")
                    last = sender.call(cmd="handoff", blocks=n, seed=seed, to=receiver.agent_id, paths=[path])
                    if last["outcome"] != "transferred" or last["path"] != path:
                        raise RuntimeError(f"{path} handoff of {size} MiB did not transfer: {last}")
                    if receiver.call(cmd="check", blocks=n, seed=seed)["num_leading"] != n:
                        raise RuntimeError(f"{path} handoff of {size} MiB is not all visible on the receiver")
                    into[path].append(last["seconds"])
            raw = nbytes / min(times["raw"]) / 1e9 if engine_up else 0.0
            raw_med = nbytes / statistics.median(times["raw"]) / 1e9 if engine_up else 0.0
            memcpy = nbytes / min(times["raw_memcpy"]) / 1e9 if shm_up else 0.0
            raw_sync = nbytes / min(times["raw_sync"]) / 1e9 if engine_up else 0.0
            raw_windowed = nbytes / min(times["raw_windowed"]) / 1e9 if engine_up else 0.0
            for path in paths:
                gbps = nbytes / min(times[path]) / 1e9
                med = nbytes / statistics.median(times[path]) / 1e9
                is_shm = path == "shm"
                results.append(
                    PathResult(
                        nbytes,
                        path,
                        round(gbps, 3),
                        round(raw, 3) if raw else None,  # (0.0 read as "0x the engine")
                        round(gbps / raw, 3) if raw else None,
                        round(min(times[path]), 4),
                        n,
                        round(med, 3),
                        round(raw_med, 3) if raw_med else None,
                        round(med / raw_med, 3) if raw_med else None,
                        round(memcpy, 3) if is_shm else 0.0,
                        round(gbps / memcpy, 3) if is_shm and memcpy else 0.0,
                        round(raw_sync, 3),
                        round(raw_windowed, 3),
                    )
                )
            receiver.call(cmd="drop")
            sender.call(cmd="drop")
        if fault:
            fault_result = _fault(sender, endpoint, block_mib, capacity, max(sizes_mib))
            if fault_result["outcome"] == "transferred":
                notes.append(
                    f"fault: the {max(sizes_mib)} MiB handoff finished in {fault_result['answer_seconds']}s, before "
                    "the receiver was killed 50 ms in: nothing was tested (use --sizes with 64 or more)"
                )
    finally:
        for w in (sender, receiver):
            if w is not None:
                w.close()
        if own is not None:
            own.close()
    return {
        "block_bytes": block_mib * MIB,
        "repeats": repeats,
        "results": [asdict(r) for r in results],
        "fault": fault_result,
        "notes": notes,
    }


def _fault(sender: Worker, etcd: str, block_mib: int, capacity: int, size_mib: int) -> dict:
    """Kill the receiver with SIGKILL while a handoff to it runs: the sender's answer."""
    victim = Worker("bench-victim", etcd, block_mib, capacity)
    n = max(1, size_mib // block_mib)
    sender.call(cmd="store", blocks=n, seed=7)
    answer: dict = {}

    def go():
        answer.update(sender.call(cmd="handoff", blocks=n, seed=7, to=victim.agent_id, paths=[], deadline=10.0))

    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.05)  # reserved, bytes on the wire
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    t.join(30)
    sender.call(cmd="drop")
    return {
        "payload_bytes": n * block_mib * MIB,
        "killed_after_seconds": 0.05,
        "outcome": answer.get("outcome", "none"),
        "answer_seconds": round(answer.get("seconds", 0.0), 3),
        "deadline_seconds": 10.0,
        "attempts": answer.get("attempts", 0),
        "reason": answer.get("reason", ""),
    }


def _num(v: float | None, width: int, places: int) -> str:
    """A figure right-aligned, or n/a where it was not measured."""
    return f"{v:>{width}.{places}f}" if v is not None else f"{'n/a':>{width}s}"


def format_table(result: dict) -> str:
    lines = [
        f"handoff between two agent processes (blocks of {result['block_bytes'] >> 20} MiB, "
        f"best and median of {result['repeats']}, interleaved)",
        f"{'payload':>8s} {'path':6s} {'GB/s':>7s} {'raw engine GB/s':>16s} {'ratio':>6s}   "
        f"{'median GB/s':>11s} {'raw':>6s} {'ratio':>6s}",
    ]
    for r in result["results"]:
        memcpy = (
            f"   raw memcpy {r['raw_memcpy_gbps']:.3f} GB/s, ratio {r['memcpy_ratio']:.2f}"
            if r.get("raw_memcpy_gbps")
            else ""
        )

        lines.append(
            f"{r['payload_bytes'] >> 20:>5d}MiB {r['path']:6s} {r['gbps']:>7.3f} {_num(r['raw_engine_gbps'], 16, 3)} "
            f"{_num(r['ratio'], 6, 2)}   {r['median_gbps']:>11.3f} {_num(r['median_raw_engine_gbps'], 6, 3)} "
            f"{_num(r['median_ratio'], 6, 2)}" + memcpy
        )
    f = result.get("fault") or {}
    if f:
        lines += [
            "",
            f"receiver SIGKILLed {f['killed_after_seconds']}s into a {f['payload_bytes'] >> 20} MiB handoff: "
            f"{f['outcome']} after {f['answer_seconds']}s ({f['attempts']} attempts; deadline {f['deadline_seconds']}s)",
            f"  reason: {f['reason'][:300]}",
        ]
    raws = {r["payload_bytes"]: r for r in result["results"] if r.get("raw_engine_sync_gbps")}
    if raws:
        lines.append("raw engine = the better of one blocking write and the agent's batches four at a time:")
        lines += [
            f"{n >> 20:>5d}MiB blocking {r['raw_engine_sync_gbps']:.3f} GB/s, windowed {r['raw_engine_windowed_gbps']:.3f} GB/s"
            for n, r in raws.items()
        ]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(a[0], a[1], int(a[2]), int(a[3]), a[4], int(a[5]))


# ---- simulation: N prefill and M decode agents under a request stream -----------------------


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 2
    num_decode: int = 2
    num_requests: int = 2000
    requests_per_second: float = 6.0
    block_size: int = 16
    block_bytes: int = 2 * MIB  # ~ an 8B model's KV of 16 tokens
    min_prompt_blocks: int = 16
    max_prompt_blocks: int = 256
    output_tokens: int = 256
    decode_tokens_per_second: float = 40.0  # per request
    prefill_tokens_per_second: float = 10_000.0  # per prefill agent
    decode_capacity_blocks: int = 3072  # KV a decode agent can hold (6 GiB here)
    link_bytes_per_second: float = 2e9
    seed: int = 0


def simulate(cfg: SimConfig, backpressure: bool) -> dict:
    """Discrete-event run of the request stream; routing decisions by controlplane.core.routing.

    With backpressure, a handoff whose decode agents are all behind waits at its prefill
    agent (queued) until one has room, and Route steers new prompts to the prefill agent
    with the shortest queue. Without, every handoff goes at once to the decode agent with
    the fastest idle link, whatever its free capacity: a request whose KV arrives at a
    full decode agent is an overrun. It waits there for room, and then recomputes its
    prefill, since its KV was evicted meanwhile; its TTFT pays both."""
    import heapq
    import random

    from controlplane.core.routing import Candidate, DataPlaneView, RouteParams, route

    rng = random.Random(cfg.seed)
    params = RouteParams(
        prefill_tokens_per_second=cfg.prefill_tokens_per_second,
        default_link_bytes_per_second=cfg.link_bytes_per_second,
        free_watermark=0.0,
        queue_penalty_seconds=0.5,
    )
    prefill_free_at = [0.0] * cfg.num_prefill
    queued: list[list[tuple[float, int, int]]] = [[] for _ in range(cfg.num_prefill)]  # (ready at, req, blocks)
    held = [0] * cfg.num_decode  # blocks in the decode agent's memory (reserved, arrived, decoding)
    active = [0] * cfg.num_decode  # blocks of requests decoding
    waiting: list[list[tuple[int, int]]] = [[] for _ in range(cfg.num_decode)]  # overruns: (req, blocks)
    inflight = [0] * cfg.num_decode
    peak = [0] * cfg.num_decode
    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def push(t, kind, data):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    t = 0.0
    arrival: dict[int, float] = {}
    for i in range(cfg.num_requests):
        t += rng.expovariate(cfg.requests_per_second)
        blocks = rng.randint(cfg.min_prompt_blocks, cfg.max_prompt_blocks)
        arrival[i] = t
        push(t, "arrive", (i, blocks))
    ttft: list[float] = []
    overruns = 0
    queue_samples: list[int] = []
    cap = cfg.decode_capacity_blocks * cfg.block_bytes

    def decode_candidates():
        return [
            Candidate(
                f"d{j}",
                "",
                "decode",
                dataplane=DataPlaneView(
                    handoff_free_bytes=max(0, cfg.decode_capacity_blocks - held[j]) * cfg.block_bytes,
                    handoff_capacity_bytes=cap,
                    inbound_reservations=inflight[j],
                    max_inbound=1 << 30,
                ),
            )
            for j in range(cfg.num_decode)
        ]

    def try_send(now: float, p: int, req: int, blocks: int) -> bool:
        r = route("decode", decode_candidates(), blocks, cfg.block_size, cfg.block_bytes, params)
        if backpressure and r.backpressure:
            return False
        j = int(r.decode_agent_id[1:])
        held[j] += blocks
        inflight[j] += 1
        peak[j] = max(peak[j], held[j])
        push(now + blocks * cfg.block_bytes / cfg.link_bytes_per_second, "arrived", (req, j, blocks))
        return True

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            req, blocks = data
            cands = [
                Candidate(
                    f"p{k}",
                    "",
                    "prefill",
                    dataplane=DataPlaneView(outbound_queued=len(queued[k]) + (prefill_free_at[k] > now)),
                )
                for k in range(cfg.num_prefill)
            ]
            k = int(route("prefill", cands, blocks, cfg.block_size, cfg.block_bytes, params).agent_id[1:])
            start = max(now, prefill_free_at[k])
            prefill_free_at[k] = start + blocks * cfg.block_size / cfg.prefill_tokens_per_second
            push(prefill_free_at[k], "prefilled", (req, k, blocks))
        elif kind == "prefilled":
            req, k, blocks = data
            # behind those already queued on its agent: it goes only when they have
            if queued[k] or not try_send(now, k, req, blocks):
                queued[k].append((now, req, blocks))
        elif kind == "arrived":
            req, j, blocks = data
            inflight[j] -= 1
            if active[j] + blocks > cfg.decode_capacity_blocks:
                overruns += 1
                waiting[j].append((req, blocks))
            else:
                active[j] += blocks
                ttft.append(now - arrival[req])
                push(now + cfg.output_tokens / cfg.decode_tokens_per_second, "done", (j, blocks))
        elif kind == "done":
            j, blocks = data
            held[j] -= blocks
            active[j] -= blocks
            while waiting[j] and active[j] + waiting[j][0][1] <= cfg.decode_capacity_blocks:
                req, b = waiting[j].pop(0)
                active[j] += b
                first = now + b * cfg.block_size / cfg.prefill_tokens_per_second  # recompute its evicted KV
                ttft.append(first - arrival[req])
                push(first + cfg.output_tokens / cfg.decode_tokens_per_second, "done", (j, b))
            # room freed: each prefill agent's queue goes in order (the oldest head's first);
            # a head that does not fit holds its agent's queue, not the other agents'
            for k in sorted((k for k in range(cfg.num_prefill) if queued[k]), key=lambda k: queued[k][0][0]):
                while queued[k] and try_send(now, k, queued[k][0][1], queued[k][0][2]):
                    queued[k].pop(0)
        queue_samples.append(sum(len(q) for q in queued))
    ttft.sort()

    def pct(q):
        return round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 3) if ttft else 0.0

    return {
        "backpressure": backpressure,
        "requests": len(ttft),
        "ttft_p50_seconds": pct(0.5),
        "ttft_p99_seconds": pct(0.99),
        "decode_queue_mean": round(sum(queue_samples) / max(1, len(queue_samples)), 2),
        "decode_queue_max": max(queue_samples, default=0),
        "decode_peak_blocks": max(peak),
        "decode_capacity_blocks": cfg.decode_capacity_blocks,
        "over_capacity": max(peak) > cfg.decode_capacity_blocks,
        "overruns": overruns,
    }


def simulate_both(cfg: SimConfig) -> dict:
    return {"config": asdict(cfg), "results": [simulate(cfg, False), simulate(cfg, True)]}


def format_sim(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['num_prefill']} prefill + {c['num_decode']} decode agents, {c['num_requests']} requests at "
        f"{c['requests_per_second']}/s, decode capacity {c['decode_capacity_blocks']} blocks each",
        f"{'backpressure':12s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'queue mean':>10s} {'queue max':>9s} "
        f"{'decode peak':>11s} {'overruns':>8s}",
    ]
    for r in result["results"]:
        lines.append(
            f"{'on' if r['backpressure'] else 'off':12s} {r['ttft_p50_seconds']:>8.2f}s {r['ttft_p99_seconds']:>8.2f}s "
            f"{r['decode_queue_mean']:>10.2f} {r['decode_queue_max']:>9d} "
            f"{r['decode_peak_blocks']:>5d}/{r['decode_capacity_blocks']:<5d} {r['overruns']:>8d}"
        )
    return "\n".join(lines)
