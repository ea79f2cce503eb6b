"""`kvcp-bench tiers`: block movement between tiers and codec speed, each against a raw
baseline measured in the same run on the same bytes.

Moves go through the agent's real path (a Mover operation, as a control-plane command
runs it: BlockPool.move_blocks in batches: allocate, copy or read/write in few calls,
verify, switch, free; codecs on codec threads or, for GPU blocks, in batches on the GPU).
Baselines: a plain torch copy of the same bytes between the same devices, and for the
disk a plain sequential write of the same bytes into one file (same fsync setting) and a
sequential read of it into memory of the same size (each block at its own place). Disk
reads come from the page cache in both cases unless the machine evicts it; the figures
are ratios for that reason.

Between moves the benchmark drains the pool's event journal, as a running agent's sync
does all along (undrained, the events of the whole run pile up and the garbage
collector's passes over them cost a moving block ~3 us on this path).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import torch

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.model_spec import ModelSpec
from agent.core.mover import SUCCEEDED, Mover
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier, cuda_available
from protos.tier import Tier


@dataclass
class MoveResult:
    path: str
    block_bytes: int
    gbps: float
    baseline_gbps: float
    ratio: float


@dataclass
class CodecMoveResult:
    """Moves that change a codec on the way, against the same blocks moved raw: demotions
    that encode (CPU->DISK; GPU->CPU when CUDA is present, the GPU quantizing) and, with
    CUDA, promotions of compressed CPU blocks into the GPU tier (the payloads cross, the
    GPU decodes)."""

    codec: str
    block_bytes: int
    gbps: float  # uncompressed bytes a second
    raw_move_gbps: float
    ratio: float  # > 1: the codec's move is faster than the raw one (it saves more than it costs)
    path: str = "cpu->disk"


@dataclass
class FullTierResult:
    """Work into a full top tier (CPU over a disk, or GPU over the CPU) whose room is made
    by demoting as many blocks to the tier below (a promotion from there, a handoff's
    reservation, an engine's stores), against the same demotion (and promotion) run as
    plain batches into free room, and how long an engine's call that takes the pool lock
    (a lookup) waited meanwhile."""

    path: str
    block_bytes: int
    gbps: float  # bytes placed (promoted or reserved) a second
    sequential_gbps: float  # the baseline: the same bytes down, then (a promotion) up, as plain batches
    ratio: float
    lock_wait_p50_ms: float
    lock_wait_p99_ms: float


@dataclass
class CodecResult:
    codec: str
    size_ratio: float
    compress_gbps: float
    decompress_gbps: float
    max_abs_error: float
    device: str = "cpu"  # where it runs (on cuda: in batches, as GPU demotions and promotions do)
    # compressing on demotion pays when encoding costs less than writing the bytes it
    # saves: on disks slower than this (compress GB/s x the share of bytes saved)
    breakeven_disk_gbps: float = 0.0
    pays_vs_raw_write: bool = False  # ... against this run's raw disk write baseline


def _spec(block_mib: int) -> ModelSpec:
    # [layers, 2, block_size, kv_heads, head_dim] fp16; 1 MiB per layer-pair group of 4
    return ModelSpec(f"bench-{block_mib}m", block_size=256, num_layers=4 * block_mib, num_kv_heads=4, head_dim=64)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _filled_pool(block_mib: int, num_blocks: int, fsync: bool, workdir: str, name: str, gpu: bool):
    """An agent's block pool (GPU when asked and present, CPU, disk) holding num_blocks
    independent fp16 blocks of block_mib MiB, and a function that moves them all."""
    spec = _spec(block_mib)
    nbytes = spec.block_bytes
    total = nbytes * num_blocks
    tiers = []
    if gpu and cuda_available():
        tiers.append(MemoryTier(Tier.GPU, total + nbytes, nbytes // 16))
    tiers.append(MemoryTier(Tier.CPU, total + nbytes, nbytes // 16))
    tiers.append(DiskTier(os.path.join(workdir, f"{name}-{block_mib}"), 4 * total, fsync=fsync))
    pool = BlockPool(tiers, [spec])
    gen = torch.Generator().manual_seed(0)
    data = torch.randn((num_blocks, *spec.block_shape), generator=gen).to(torch.float16)
    hashes = [os.urandom(16) for _ in range(num_blocks)]
    # independent roots: each block is its own chain
    for i, h in enumerate(hashes):
        pool.insert_chain(spec.model_id, [h], lambda _i, i=i: data[i])
    mover = Mover(pool)

    def move_all(tier: Tier, codec: str | None = None):
        op = mover.run_op(mover.submit(hashes, tier, codec))
        if op.state != SUCCEEDED or op.num_failed_blocks:
            raise RuntimeError(f"move to {tier.label} failed: {op.error}")

    return pool, data, move_all


def bench_moves(block_mib: int, num_blocks: int, repeats: int, fsync: bool, workdir: str) -> list[MoveResult]:
    pool, data, move_all = _filled_pool(block_mib, num_blocks, fsync, workdir, "disk", gpu=True)
    nbytes = _spec(block_mib).block_bytes
    total = nbytes * num_blocks
    top = pool.top.tier

    results = []
    paths = [(Tier.CPU, Tier.DISK), (Tier.DISK, Tier.CPU)]
    if top == Tier.GPU:
        paths = [(Tier.GPU, Tier.CPU), (Tier.CPU, Tier.GPU)] + paths
    move_all(Tier.CPU)
    flat = data.view(torch.uint8).reshape(num_blocks, -1)
    raw_file = os.path.join(workdir, f"raw-{block_mib}.bin")
    host = flat.pin_memory() if cuda_available() else flat
    dev = torch.empty_like(flat, device="cuda") if cuda_available() else None

    def raw_write():
        # over the bytes of the previous run, as the slab overwrites its extents in place
        with open(raw_file, "r+b" if os.path.exists(raw_file) else "wb", buffering=0) as f:
            for i in range(num_blocks):
                f.write(memoryview(host[i].numpy()))
            if fsync:
                os.fsync(f.fileno())

    landing = torch.zeros_like(flat)  # touched once, like the slab pages a move lands in

    def raw_read():
        # every block lands at its own place in memory, as in a move; reading them all
        # into one reused buffer would keep it in the CPU cache, which no move can do
        with open(raw_file, "rb", buffering=0) as f:
            for i in range(num_blocks):
                f.readinto(memoryview(landing[i].numpy()))

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    baselines = {
        (Tier.CPU, Tier.DISK): raw_write,
        (Tier.DISK, Tier.CPU): raw_read,
        (Tier.CPU, Tier.GPU): h2d,
        (Tier.GPU, Tier.CPU): d2h,
    }
    raw_write()
    for src, dst in paths:

        def run(src=src, dst=dst):
            move_all(src)
            pool.drain_events()  # as the agent's sync does all along (see the module doc)
            t0 = time.perf_counter()
            move_all(dst)
            if dst == Tier.GPU or src == Tier.GPU:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        # interleaved, best of each: a noisy neighbour hits both sides alike
        times, base_times = [], []
        for _ in range(repeats):
            times.append(run())
            base_times.append(_best(baselines[(src, dst)], 1))
        t, tb = min(times), min(base_times)
        gbps, base = total / t / 1e9, total / tb / 1e9
        results.append(
            MoveResult(f"{src.label}->{dst.label}", nbytes, round(gbps, 3), round(base, 3), round(gbps / base, 3))
        )
    os.unlink(raw_file)
    return results


def _codec_moves(
    pool, move_all, names, setup, timed, repeats: int, block_bytes: int, num_blocks: int, path: str
) -> list[CodecMoveResult]:
    """Time move_all(*timed(name)) after move_all(*setup(name)) for each codec name (None:
    the raw move, the baseline), interleaved, best of `repeats` each; the event journal
    drained before each timed move, as the agent's sync keeps it."""
    best = {name: float("inf") for name in names}
    for _ in range(repeats):
        for name in names:
            move_all(*setup(name))
            pool.drain_events()
            t0 = time.perf_counter()
            move_all(*timed(name))
            best[name] = min(best[name], time.perf_counter() - t0)
    total = block_bytes * num_blocks
    return [
        CodecMoveResult(
            name,
            block_bytes,
            round(total / best[name] / 1e9, 3),
            round(total / best[None] / 1e9, 3),
            round(best[None] / best[name], 3),
            path,
        )
        for name in names[1:]
    ]


def bench_demotions(
    block_mib: int, num_blocks: int, repeats: int, fsync: bool, workdir: str, src: Tier = Tier.CPU
) -> list[CodecMoveResult]:
    """The agent's demotion (src -> the tier below) of the same blocks as they are and
    encoded with each codec (as a tier codec or `kvctl move --codec` does: codec threads
    encode while the blocks before are written; from the GPU, batches encoded there),
    GB/s of uncompressed KV."""
    pool, _, move_all = _filled_pool(block_mib, num_blocks, fsync, workdir, f"demote-{src.label}", gpu=src == Tier.GPU)
    dst = Tier(int(src) + 1)
    names = [None] + [c for c in codecs.available_codecs() if c != "none"]
    return _codec_moves(
        pool,
        move_all,
        names,
        lambda name: (src, "none"),  # back to raw fp16 in the slab
        lambda name: (dst, name),
        repeats,
        _spec(block_mib).block_bytes,
        num_blocks,
        f"{src.label}->{dst.label}",
    )


def bench_promotions(block_mib: int, num_blocks: int, repeats: int, fsync: bool, workdir: str) -> list[CodecMoveResult]:
    """With CUDA: the agent's promotion CPU->GPU of the same blocks held raw in the CPU
    tier and held compressed with each lossy codec (decoded into raw GPU blocks on the
    way: the payloads cross, the GPU decodes them in batches), GB/s of uncompressed KV."""
    pool, _, move_all = _filled_pool(block_mib, num_blocks, fsync, workdir, "promote", gpu=True)
    if pool.top.tier is not Tier.GPU:
        return []
    names = [None] + [c for c in codecs.available_codecs() if c in codecs.DECODE_BATCHED]
    return _codec_moves(
        pool,
        move_all,
        names,
        lambda name: (Tier.CPU, name or "none"),  # held in the CPU tier as this codec
        lambda name: (Tier.GPU, "none"),
        repeats,
        _spec(block_mib).block_bytes,
        num_blocks,
        "cpu->gpu",
    )


def bench_full_tier(
    block_mib: int, num_blocks: int, repeats: int, fsync: bool, workdir: str, gpu_device: str | None = None
) -> list[FullTierResult]:
    """A top tier full of num_blocks blocks over a tier holding num_blocks others: the CPU
    tier over a disk, or with `gpu_device` a GPU tier there over a CPU tier with room. (1)
    The lower ones promoted into it and back (each move pushes the other set down), best of
    2 x `repeats`, against the same bytes moved down and up as two batches into free room.
    (2) A handoff's reservation of num_blocks pages there (BlockPool.reserve_chain: the
    room made by pushing as many blocks down), and (3) an engine's stores of num_blocks new
    blocks in chains of 8 (insert_chain), each against moving as many down as one batch.
    An engine thread meanwhile calls num_leading (the pool lock) every 0.2 ms."""
    spec = _spec(block_mib)
    nbytes, total = spec.block_bytes, spec.block_bytes * num_blocks
    disk = DiskTier(os.path.join(workdir, f"full-{block_mib}-{gpu_device}"), 4 * total, fsync=fsync)
    if gpu_device is None:
        top, low, tiers = Tier.CPU, Tier.DISK, [MemoryTier(Tier.CPU, total, nbytes // 16, device="cpu"), disk]
    else:  # the CPU tier takes what the GPU pushes out
        top, low = Tier.GPU, Tier.CPU
        tiers = [
            MemoryTier(Tier.GPU, total, nbytes // 16, device=gpu_device),
            MemoryTier(Tier.CPU, 3 * total, nbytes // 16),
            disk,
        ]
    pool = BlockPool(tiers, [spec])
    gen = torch.Generator().manual_seed(0)
    data = torch.randn((2 * num_blocks, *spec.block_shape), generator=gen).to(torch.float16)
    hashes = [os.urandom(16) for _ in range(2 * num_blocks)]
    for i, h in enumerate(hashes):  # the first half spills to the tier below
        pool.insert_chain(spec.model_id, [h], lambda _i, i=i: data[i])
    sets = [hashes[:num_blocks], hashes[num_blocks:]]  # below, in the top tier

    def move(blocks, tier) -> float:
        pool.drain_events()
        t0 = time.perf_counter()
        outcomes = pool.move_blocks(blocks, tier)
        if not all(o.ok for o in outcomes):
            raise RuntimeError(f"a move to {tier.label} failed: {next(o.reason for o in outcomes if not o.ok)}")
        return time.perf_counter() - t0

    def reserve() -> float:  # a handoff's pages for num_blocks blocks, given back after
        t0 = time.perf_counter()
        _, _, handles = pool.reserve_chain(
            spec.model_id, [os.urandom(16) for _ in range(num_blocks)], [nbytes] * num_blocks, top
        )
        took = time.perf_counter() - t0
        pool.release_reserved(handles, top)
        return took

    def store() -> float:  # an engine's stores of num_blocks new blocks, chains of 8, dropped after
        roots, t0 = [], time.perf_counter()
        for at in range(0, num_blocks, 8):
            chain = [os.urandom(16) for _ in range(min(8, num_blocks - at))]
            pool.insert_chain(spec.model_id, chain, lambda i, at=at: data[at + i])
            roots.append(chain[0])
        took = time.perf_counter() - t0
        for root in roots:
            pool.drop(root)
        return took

    # each round: the blocks below come up into the full tier in one batch (kvcp), then the
    # same bytes as two batches (down, then the others up into the room made: the
    # baseline), the engine thread running through both; as many of each, interleaved
    swap_times, swap_waits, two, down_only = [], [], float("inf"), float("inf")
    for _ in range(repeats):  # sets[1] is in the top tier at the start of each round
        took, waits = _with_engine(pool, sets[1][:4], lambda: move(sets[0], top))
        swap_times.append(took)
        swap_waits.extend(waits)
        (down, up), _ = _with_engine(pool, sets[1][:4], lambda: (move(sets[0], low), move(sets[1], top)))
        down_only, two = min(down_only, down), min(two, down + up)
    reserves, stores = [], []
    for _ in range(repeats):  # sets[1] is in the top tier after an even number of swaps
        reserves.append(_with_engine(pool, sets[1][:4], reserve))
        move(sets[1], top)  # what it pushed out, back (not timed)
        stores.append(_with_engine(pool, sets[1][:4], store))
        move(sets[1], top)
    on = "" if top is Tier.CPU else f" {top.label}"
    return [
        _full_row(f"{low.label}->{top.label} (full)", nbytes, total, min(swap_times), two, swap_waits),
        _full_row(f"reserve{on} (full)", nbytes, total, min(t for t, _ in reserves), down_only, _all(reserves)),
        _full_row(f"store{on} (full)", nbytes, total, min(t for t, _ in stores), down_only, _all(stores)),
    ]


def _all(runs) -> list[float]:
    """The engine's waits over several (result, waits) runs."""
    return [w for _, waits in runs for w in waits]


def _with_engine(pool, hashes, fn):
    """fn() while an engine thread calls num_leading (the pool lock) every 0.2 ms: its
    result and the thread's waits (seconds)."""
    waits: list[float] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            pool.num_leading(hashes)
            waits.append(time.perf_counter() - t0)
            time.sleep(0.0002)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    try:
        return fn(), waits
    finally:
        stop.set()
        thread.join()


def _full_row(path: str, nbytes: int, total: int, seconds: float, baseline_seconds: float, waits) -> FullTierResult:
    waits = sorted(waits)
    return FullTierResult(
        path,
        nbytes,
        round(total / seconds / 1e9, 3),
        round(total / baseline_seconds / 1e9, 3),
        round(baseline_seconds / seconds, 3),
        round(waits[len(waits) // 2] * 1e3, 3) if waits else 0.0,
        round(waits[int(len(waits) * 0.99)] * 1e3, 3) if waits else 0.0,
    )


GPU_CODEC_BATCH = 16  # blocks a GPU encode takes at once in the benchmark (a 16 MiB batch)


def bench_codecs(repeats: int, disk_write_gbps: float = 0.0) -> list[CodecResult]:
    """Each codec on the host, one block at a time, and each lossy one on the GPU when
    CUDA is present, as a GPU->CPU demotion runs it: GPU_CODEC_BATCH blocks quantized
    together (codecs.encode_batch), the payloads copied to pinned host memory."""
    spec = _spec(1)
    gen = torch.Generator().manual_seed(1)
    host = torch.randn(spec.block_shape, generator=gen).to(torch.float16)
    raw = host.numel() * 2
    runs = [(name, "cpu") for name in codecs.available_codecs() if name != "none"]
    if cuda_available():
        runs += [(name, "cuda") for name in codecs.available_codecs() if name in codecs.BATCHED]
    out = []
    for name, device in runs:
        if device == "cpu":
            payload = codecs.encode(name, host)
            tc = _best(lambda name=name: codecs.encode(name, host), repeats)
            td = _best(
                lambda name=name, payload=payload: codecs.decode(name, payload, spec.block_shape, torch.float16),
                repeats,
            )
            back = codecs.decode(name, payload, spec.block_shape, torch.float16)
        else:
            batch = host.expand(GPU_CODEC_BATCH, *host.shape).contiguous().to(device)
            payloads = codecs.encode_batch(name, batch)
            payload = payloads[0]
            tc = _best(lambda name=name, batch=batch: codecs.encode_batch(name, batch), repeats) / GPU_CODEC_BATCH
            on_gpu = torch.stack(payloads).to(device)

            def gpu_decode(name=name, on_gpu=on_gpu):
                out = codecs.decode_batch(name, on_gpu, spec.block_shape, torch.float16)
                torch.cuda.synchronize()
                return out

            td = _best(gpu_decode, repeats) / GPU_CODEC_BATCH
            back = gpu_decode()[0].cpu()
        err = (back.float() - host.float()).abs().max().item()
        size_ratio, compress_gbps = raw / payload.numel(), raw / tc / 1e9
        breakeven = compress_gbps * max(0.0, 1.0 - 1.0 / size_ratio)
        out.append(
            CodecResult(
                name,
                round(size_ratio, 3),
                round(compress_gbps, 3),
                round(raw / td / 1e9, 3),
                round(err, 5),
                device,
                round(breakeven, 3),
                bool(disk_write_gbps) and breakeven > disk_write_gbps,
            )
        )
    return out


def run(block_mibs=(1, 4), num_blocks: int = 32, repeats: int = 3, fsync: bool = False, torch_threads: int = 1) -> dict:
    torch.set_num_threads(torch_threads)  # as the agent runs (kvcp-agent --torch-threads)
    with tempfile.TemporaryDirectory(prefix="kvcp-bench-tiers-") as workdir:
        moves = []
        for mib in block_mibs:
            moves += bench_moves(mib, max(4, num_blocks // mib), repeats, fsync, workdir)
        n = max(4, num_blocks // block_mibs[0])
        demotions = bench_demotions(block_mibs[0], n, repeats, fsync, workdir)
        promotions = []
        if cuda_available():
            demotions += bench_demotions(block_mibs[0], n, repeats, fsync, workdir, src=Tier.GPU)
            promotions = bench_promotions(block_mibs[0], n, repeats, fsync, workdir)
        full = bench_full_tier(block_mibs[0], n, repeats, fsync, workdir)
        if cuda_available():  # the same into a full GPU tier (pushing out to the CPU tier)
            full += bench_full_tier(block_mibs[0], n, repeats, fsync, workdir, gpu_device="cuda")
    writes = [m.baseline_gbps for m in moves if m.path == "cpu->disk"]
    return {
        "cuda": cuda_available(),
        "fsync": fsync,
        "torch_threads": torch_threads,
        "moves": [asdict(m) for m in moves],
        "disk_write_gbps": max(writes, default=0.0),
        "codecs": [asdict(c) for c in bench_codecs(repeats, max(writes, default=0.0))],
        "demotions": [asdict(d) for d in demotions],
        "promotions": [asdict(p) for p in promotions],
        "full_tier": [asdict(f) for f in full],
    }


def format_table(result: dict) -> str:
    lines = [
        f"block moves (cuda={result['cuda']}, fsync={result['fsync']})",
        f"{'path':12s} {'block':>8s} {'GB/s':>8s} {'raw GB/s':>9s} {'ratio':>6s}",
    ]
    for m in result["moves"]:
        lines.append(
            f"{m['path']:12s} {m['block_bytes'] >> 20:>6d}Mi {m['gbps']:>8.2f} {m['baseline_gbps']:>9.2f} {m['ratio']:>6.2f}"
        )
    lines += [
        "",
        f"codecs (fp16 block [4,2,256,4,64], torch threads {result.get('torch_threads', '-')}; on cuda:"
        f" {GPU_CODEC_BATCH} blocks a batch); compressing on"
        f" demotion pays on a disk slower than BREAKEVEN (this run's raw write: {result.get('disk_write_gbps', 0):.2f} GB/s)",
        f"{'codec':6s} {'enc on':>6s} {'size ratio':>10s} {'enc GB/s':>9s} {'dec GB/s':>9s} {'max |err|':>10s}"
        f" {'BREAKEVEN':>10s} {'PAYS':>5s}",
    ]
    for c in result["codecs"]:
        lines.append(
            f"{c['codec']:6s} {c.get('device', 'cpu'):>6s} {c['size_ratio']:>10.2f} {c['compress_gbps']:>9.2f}"
            f" {c['decompress_gbps']:>9.2f}"
            f" {c['max_abs_error']:>10.4f} {c['breakeven_disk_gbps']:>10.2f} {'yes' if c['pays_vs_raw_write'] else 'no':>5s}"
        )
    if result.get("demotions"):
        lines += [
            "",
            "moves with a codec (through the agent's move, GB/s of uncompressed KV; RATIO > 1: the"
            " codec costs less than the bytes it saves; cpu->gpu: compressed CPU blocks decoded on the GPU)",
            f"{'path':10s} {'codec':6s} {'block':>8s} {'GB/s':>8s} {'raw move':>9s} {'ratio':>6s}",
        ]
        for d in result["demotions"] + result.get("promotions", []):
            lines.append(
                f"{d.get('path', 'cpu->disk'):10s} {d['codec']:6s} {d['block_bytes'] >> 20:>6d}Mi {d['gbps']:>8.2f}"
                f" {d['raw_move_gbps']:>9.2f}"
                f" {d['ratio']:>6.2f}"
            )
    if result.get("full_tier"):
        lines += [
            "",
            "into a full tier (each block in pushes one out to the tier below; SEQUENTIAL: the same bytes down"
            " (then up, for a promotion) as plain batches; LOCK WAIT: an engine's lookup meanwhile)",
            f"{'path':17s} {'block':>6s} {'GB/s':>7s} {'sequential':>11s} {'ratio':>6s} {'lock wait p50/p99 ms':>21s}",
        ]
        for f in result["full_tier"]:
            lines.append(
                f"{f['path']:17s} {f['block_bytes'] >> 20:>4d}Mi {f['gbps']:>7.2f} {f['sequential_gbps']:>11.2f}"
                f" {f['ratio']:>6.2f} {f['lock_wait_p50_ms']:>10.3f} / {f['lock_wait_p99_ms']:.3f}"
            )
    return "\n".join(lines)
