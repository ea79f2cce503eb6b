"""What a fragmented disk tier costs, with and without compaction: one agent's block
pool (a small CPU slab over a real disk slab in a temporary directory) serving two models
whose blocks differ in size, prompts drawn from a Zipf popularity; every request loads
its cached prefix and stores the rest, as an engine does. Reports, per mode, the hit
ratio (blocks found over blocks asked), the disk tier's mean fill (the extents its blocks
take over its capacity, sampled every request after warm-up once the tier first had to
push a block out) and the blocks pushed out of it.

    python scripts/disk_fragmentation.py --requests 6000 [-o json]

"off" disables compaction (allocations push blocks out until a free run fits, as before
it was built); `--cleanup-every N` drops every block of the first model each N requests
(an operator's `kvctl cleanup --model`), leaving holes among the large model's blocks;
"on" is the pool as it ships, with the background step run every
`--step-every` requests as the agent's thread would.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from agent.core import block_pool as block_pool_module
from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.model_spec import ModelSpec
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier
from protos.tier import Tier


def models(head_dims: list[int]) -> list[ModelSpec]:
    """One model per head_dim (a block of 16 tokens, 2 layers, 2 KV heads: 256 B per unit
    of head_dim), named m<head_dim>; the first is the one --cleanup-every drops."""
    return [
        ModelSpec(f"m{d}", block_size=16, num_layers=2, num_kv_heads=2, head_dim=d, dtype="float16") for d in head_dims
    ]


def run(mode: str, a: argparse.Namespace) -> dict:
    rng = np.random.default_rng(a.seed)
    saved = block_pool_module.COMPACT_TRIES_PER_ALLOCATION
    if mode == "off":
        block_pool_module.COMPACT_TRIES_PER_ALLOCATION = 0
    try:
        with tempfile.TemporaryDirectory() as d:
            disk = DiskTier(d, a.disk_mib << 20)
            cpu = MemoryTier(Tier.CPU, a.cpu_mib << 20, 512, device="cpu")
            specs = models(a.head_dims)
            pool = BlockPool([cpu, disk], specs)
            engine = KVEngineAPI(pool, specs)
            kv = {m.model_id: torch.zeros((a.blocks_per_prompt, *m.block_shape), dtype=m.torch_dtype) for m in specs}
            ranks = np.arange(1, a.prompts + 1, dtype=np.float64)
            p = ranks**-a.zipf
            p /= p.sum()
            asked = found = 0
            fills: list[float] = []
            evicted_before = 0
            t0 = time.perf_counter()
            for i in range(a.requests):
                prompt = int(rng.choice(a.prompts, p=p))
                model = specs[prompt % len(specs)]
                toks = list(range(prompt * 100_000, prompt * 100_000 + a.blocks_per_prompt * model.block_size))
                hit = engine.lookup(model.model_id, toks) // model.block_size
                if hit:
                    engine.load(model.model_id, toks, max_blocks=hit)
                if hit < a.blocks_per_prompt:
                    data = kv[model.model_id][hit:]
                    data.fill_(float(i % 7))
                    engine.store(model.model_id, toks, data, first_block=hit)
                if a.cleanup_every and i % a.cleanup_every == a.cleanup_every - 1:
                    pool.cleanup(0.0, model_id=specs[0].model_id)  # an operator's cleanup of one model: holes
                if a.step_every and mode == "on" and i % a.step_every == 0:
                    pool.compact_disk()
                if i == a.warmup:
                    evicted_before = pool.evictions_total[Tier.DISK]
                if i >= a.warmup:
                    asked += a.blocks_per_prompt
                    found += hit
                    if pool.evictions_total[Tier.DISK]:  # full once: what it holds from then on
                        usage = {u.tier: u for u in pool.usage()}[Tier.DISK]
                        fills.append(usage.used_bytes / disk.capacity_bytes)
            seconds = time.perf_counter() - t0
            out = {
                "mode": mode,
                "hit_ratio": found / asked if asked else 0.0,
                "disk_mean_fill": float(np.mean(fills)) if fills else 0.0,
                "disk_evictions": pool.evictions_total[Tier.DISK] - evicted_before,
                "compactions": getattr(disk, "compactions_total", 0),
                "relocated_bytes": getattr(disk, "relocated_bytes_total", 0),
                "seconds": seconds,
            }
            disk.close()
            return out
    finally:
        block_pool_module.COMPACT_TRIES_PER_ALLOCATION = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=6000)
    p.add_argument("--warmup", type=int, default=1500)
    p.add_argument("--prompts", type=int, default=3000)
    p.add_argument("--blocks-per-prompt", type=int, default=4)
    p.add_argument("--zipf", type=float, default=0.9)
    p.add_argument("--cpu-mib", type=int, default=1)
    p.add_argument("--disk-mib", type=int, default=16)
    p.add_argument("--step-every", type=int, default=50, help="requests between background steps (0: none)")
    p.add_argument(
        "--head-dims",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[8, 200],
        help="one model per head_dim, comma separated: blocks of 256 B x head_dim (default 8,200: 2 and 50 KiB)",
    )
    p.add_argument(
        "--cleanup-every", type=int, default=0, help="requests between cleanups of the first model (0: none)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    a = p.parse_args()
    rows = [run(mode, a) for mode in ("off", "on")]
    if a.output == "json":
        print(json.dumps({"results": rows}, indent=2))
        return
    print(
        f"{'MODE':>4} {'HIT_RATIO':>9} {'DISK_FILL':>9} {'DISK_EVICTED':>12} {'COMPACTIONS':>11} {'RELOCATED':>10} {'SECONDS':>7}"
    )
    for r in rows:
        print(
            f"{r['mode']:>4} {r['hit_ratio']:9.4f} {r['disk_mean_fill']:9.3f} {r['disk_evictions']:12d} "
            f"{r['compactions']:11d} {r['relocated_bytes'] / 2**20:9.1f}M {r['seconds']:7.1f}"
        )
    off, on = rows
    if off["hit_ratio"]:
        print(
            f"hit ratio on/off: {on['hit_ratio'] / off['hit_ratio']:.3f}x; disk fill on/off: "
            f"{on['disk_mean_fill'] / max(off['disk_mean_fill'], 1e-9):.3f}x"
        )


if __name__ == "__main__":
    main()
