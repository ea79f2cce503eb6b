"""Same-run comparisons on a CUDA machine (the chunk and promotion tables of docs/tiers.md):

1. GPU<->CPU moves of 32 x 1 MiB and 8 x 4 MiB blocks through the agent's Mover, for
   several chunkings of a batch (first chunk, largest chunk), against one bulk `copy_` of
   the same bytes between pinned host memory and the GPU; best of 15, interleaved.
2. Promotions of 32 x 1 MiB blocks held in the CPU tier raw and compressed (int8, int4,
   fp8) into the GPU tier, decoded on the GPU in batches and (GPU batch off) on the host;
   best of 5, interleaved.

    PYTHONPATH=. python scripts/gpu_compare.py
"""

from __future__ import annotations

import tempfile
import time

import torch

import agent.core.block_moves as bp  # the copy chunk and GPU batch sizes the moves read
from benchmarks.tiers import _filled_pool, _spec
from protos.tier import Tier

CHUNKINGS = [(8 << 20, 8 << 20), (4 << 20, 4 << 20), (2 << 20, 8 << 20), (1 << 20, 8 << 20), (2 << 20, 16 << 20)]


def chunk_sweep() -> None:
    for mib, n in ((1, 32), (4, 8)):
        total = _spec(mib).block_bytes * n
        pool, data, move_all = _filled_pool(mib, n, False, tempfile.mkdtemp(), "c", gpu=True)
        host = data.view(torch.uint8).reshape(n, -1).pin_memory()
        dev = torch.empty_like(host, device="cuda")

        def bulk(to: Tier, host=host, dev=dev) -> float:
            t = time.perf_counter()
            if to == Tier.GPU:
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        best: dict = {}
        for _ in range(15):
            for cfg in CHUNKINGS:
                bp.COPY_FIRST_CHUNK_BYTES, bp.COPY_CHUNK_BYTES = cfg
                for to in (Tier.CPU, Tier.GPU):
                    pool.drain_events()
                    t = time.perf_counter()
                    move_all(to)
                    best[(cfg, to)] = min(best.get((cfg, to), 9), time.perf_counter() - t)
            for to in (Tier.CPU, Tier.GPU):
                best[("bulk", to)] = min(best.get(("bulk", to), 9), bulk(to))
        for to in (Tier.CPU, Tier.GPU):
            b = best[("bulk", to)]
            ratios = ", ".join(f"first {c[0] >> 20}M max {c[1] >> 20}M: {b / best[(c, to)]:.2f}" for c in CHUNKINGS)
            print(f"{mib} MiB ->{to.label}: bulk {total / b / 1e9:.1f} GB/s; {ratios}")
    bp.COPY_FIRST_CHUNK_BYTES, bp.COPY_CHUNK_BYTES = 2 << 20, 8 << 20


def promotions() -> None:
    n = 32
    total = _spec(1).block_bytes * n
    pool, _, move_all = _filled_pool(1, n, False, tempfile.mkdtemp(), "p", gpu=True)
    best: dict = {}
    for _ in range(5):
        for codec in ("none", "int8", "int4", "fp8"):
            for gpu_decode in (True, False):
                bp.GPU_ENCODE_BATCH_BYTES = 16 << 20
                move_all(Tier.CPU, codec)  # encoded on the GPU
                bp.GPU_ENCODE_BATCH_BYTES = 16 << 20 if gpu_decode else 0  # 0: no GPU batch, the host decodes
                pool.drain_events()
                t = time.perf_counter()
                move_all(Tier.GPU, "none")
                best[(codec, gpu_decode)] = min(best.get((codec, gpu_decode), 9), time.perf_counter() - t)
                bp.GPU_ENCODE_BATCH_BYTES = 16 << 20
    for codec in ("none", "int8", "int4", "fp8"):
        gpu, host = total / best[(codec, True)] / 1e9, total / best[(codec, False)] / 1e9
        print(f"promote cpu({codec})->gpu 1 MiB: gpu decode {gpu:.2f} GB/s, host decode {host:.2f} GB/s")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("gpu_compare: CUDA is not available here")
    torch.set_num_threads(1)
    chunk_sweep()
    promotions()
