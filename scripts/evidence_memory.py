"""Memory and speed of the tier policy's per-block evidence: AccessStats and the credit
tuner's shadow caches, filled as the leader's lookup path fills them.

Each lookup is a chain of 32-byte hashes sliced from one packed buffer, as
`Manager._drain_lookups` slices them (a fresh bytes object per block per lookup); the
workload mixes shared system prompts, popular documents, multi-turn sessions that grow
turn by turn and one-off prompts, so blocks are reused, re-admitted and evicted.

    PYTHONPATH=<checkout> python scripts/evidence_memory.py memory --lookups 60000
    PYTHONPATH=<checkout> python scripts/evidence_memory.py speed --lookups 20000

`memory` runs the trace twice under tracemalloc: AccessStats alone (bytes per tracked
block, the hashes included: it owns them), then AccessStats and a CreditTuner (the
tuner's bytes are the difference, per block its shadows hold). `speed` times
`record_lookup` and `observe` per lookup without tracemalloc. Whichever checkout is
first on PYTHONPATH is measured: run it on the old and the new code.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import time
import tracemalloc
from array import array

from controlplane.core.access_stats import AccessStats
from controlplane.core.tuning import CreditTuner

BLOCK_HASH_BYTES = 32


def make_trace(num_lookups: int, seed: int) -> tuple[list[array], int]:
    """Lookups as block ids (chains from the root), and the number of distinct blocks."""
    rng = random.Random(seed)
    next_id = 0

    def new_blocks(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [new_blocks(rng.randint(8, 32)) for _ in range(20)]
    docs = [rng.choice(systems) + new_blocks(rng.randint(20, 120)) for _ in range(3000)]
    sessions: list[list[int]] = []
    lookups = []
    for _ in range(num_lookups):
        r = rng.random()
        if r < 0.3:  # a question on a document, popular ones asked often
            doc = docs[min(int(rng.paretovariate(0.8)) - 1, len(docs) - 1)]
            chain = doc + new_blocks(rng.randint(1, 6))
        elif r < 0.75:  # a chat turn: the session's prefix grows
            if sessions and rng.random() < 0.85:
                i = rng.randrange(len(sessions))
                s = sessions[i]
                s += new_blocks(rng.randint(2, 12))
                chain = list(s)
                if len(s) > 250 or rng.random() < 0.08:
                    sessions[i] = sessions[-1]
                    sessions.pop()
            else:
                s = rng.choice(systems) + new_blocks(rng.randint(4, 16))
                sessions.append(s)
                chain = list(s)
        else:  # a one-off prompt
            chain = rng.choice(systems) + new_blocks(rng.randint(10, 80))
        lookups.append(array("q", chain))
    return lookups, next_id


def block_hashes(num_blocks: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "big"), digest_size=BLOCK_HASH_BYTES).digest() for i in range(num_blocks)]


def packed(lookup: array, hashes: list[bytes]) -> bytes:
    return b"".join([hashes[i] for i in lookup])


def sliced(buf: bytes) -> list[bytes]:
    """As Manager._drain_lookups: a fresh bytes object per block."""
    return [buf[i : i + BLOCK_HASH_BYTES] for i in range(0, len(buf), BLOCK_HASH_BYTES)]


def fill(lookups, hashes, with_tuner: bool, shadow_blocks: int, checkpoints: int):
    """Traced bytes held after each of `checkpoints` equal parts of the trace."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    stats = AccessStats()
    tuner = CreditTuner(shadow_blocks) if with_tuner else None
    every = max(len(lookups) // checkpoints, 1)
    points = []
    for n, lookup in enumerate(lookups, 1):
        keys = sliced(packed(lookup, hashes))
        now = n * 0.1
        stats.record_lookup(keys, now)
        if tuner is not None:
            tuner.observe(keys, now, stats)
        del keys
        if n % every == 0 or n == len(lookups):
            points.append(
                {
                    "lookups": n,
                    "bytes": tracemalloc.get_traced_memory()[0] - base,
                    "stats_blocks": len(stats),
                    "shadow_blocks": tuner.num_blocks() if tuner is not None else 0,
                }
            )
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del stats, tuner
    gc.collect()
    return points, peak


def memory(args) -> dict:
    lookups, num_blocks = make_trace(args.lookups, args.seed)
    hashes = block_hashes(num_blocks)
    alone, _ = fill(lookups, hashes, False, args.shadow_blocks, args.checkpoints)
    both, peak = fill(lookups, hashes, True, args.shadow_blocks, args.checkpoints)
    rows = []
    for a, b in zip(alone, both, strict=True):
        tuner_bytes = b["bytes"] - a["bytes"]
        rows.append(
            {
                "lookups": a["lookups"],
                "stats_blocks": a["stats_blocks"],
                "stats_bytes_per_block": round(a["bytes"] / a["stats_blocks"], 1),
                "shadow_blocks": b["shadow_blocks"],
                "shadow_bytes_per_block": round(tuner_bytes / b["shadow_blocks"], 1),
                "total_mib": round(b["bytes"] / 2**20, 1),
            }
        )
    return {
        "lookups": len(lookups),
        "blocks_named": sum(len(x) for x in lookups),
        "distinct_blocks": num_blocks,
        "shadow_capacity_blocks": args.shadow_blocks,
        "peak_mib": round(peak / 2**20, 1),
        "checkpoints": rows,
    }


def speed(args) -> dict:
    lookups, num_blocks = make_trace(args.lookups, args.seed)
    hashes = block_hashes(num_blocks)
    named = sum(len(x) for x in lookups)
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        stats = AccessStats()
        tuner = CreditTuner(args.shadow_blocks)
        record = observe = 0.0
        gc.collect()
        for n, lookup in enumerate(lookups, 1):
            keys = sliced(packed(lookup, hashes))
            now = n * 0.1
            t0 = time.perf_counter()
            stats.record_lookup(keys, now)
            t1 = time.perf_counter()
            tuner.observe(keys, now, stats)
            t2 = time.perf_counter()
            record += t1 - t0
            observe += t2 - t1
        best["record_lookup"] = min(best.get("record_lookup", float("inf")), record)
        best["observe"] = min(best.get("observe", float("inf")), observe)
        del stats, tuner
    return {
        "lookups": len(lookups),
        "blocks_named": named,
        "shadow_capacity_blocks": args.shadow_blocks,
        "record_lookup_us_per_lookup": round(best["record_lookup"] / len(lookups) * 1e6, 1),
        "observe_us_per_lookup": round(best["observe"] / len(lookups) * 1e6, 1),
        "record_lookup_ns_per_block": round(best["record_lookup"] / named * 1e9),
        "observe_ns_per_block": round(best["observe"] / named * 1e9),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["memory", "speed"])
    p.add_argument("--lookups", type=int, default=60000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shadow-blocks", type=int, default=1 << 18, help="The tuner's capacity (its shadows' size).")
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(json.dumps(memory(args) if args.what == "memory" else speed(args), indent=2))


if __name__ == "__main__":
    main()
