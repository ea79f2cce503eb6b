"""`kvcp-bench tiers` as a user runs it (the console script, tiny sizes): every move path,
codec, demotion and promotion row (and the rows into a full tier) is there, measured, and
its ratio is the ratio of its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent.core import codecs


def consistent(ratio: float, num: float, den: float, step: float = 5e-4) -> bool:
    """`ratio` is num / den up to the rounding of all three to 3 decimals (a slow, loaded
    machine's small GB/s figures make that rounding more than 0.01 of the ratio)."""
    low = (num - step) / (den + step)
    high = (num + step) / max(den - step, 1e-12)
    return low - step <= ratio <= high + step


def test_tiers_benchmark_json_has_moves_codecs_and_demotions():
    exe = Path(sys.executable).with_name("kvcp-bench")
    run = subprocess.run(
        [str(exe), "tiers", "--block-mib", "1", "--blocks", "4", "--repeats", "1", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert {m["path"] for m in data["moves"]} >= {"cpu->disk", "disk->cpu"}
    lossy = [c for c in codecs.available_codecs() if c != "none"]
    assert [c["codec"] for c in data["codecs"] if c["device"] == "cpu"] == lossy
    assert [d["codec"] for d in data["demotions"] if d["path"] == "cpu->disk"] == lossy
    # promotions into the GPU tier (compressed CPU blocks decoded there) with CUDA only
    decoded_on_gpu = [c for c in lossy if c in codecs.DECODE_BATCHED] if data["cuda"] else []
    assert [p["codec"] for p in data["promotions"]] == decoded_on_gpu
    for d in data["demotions"] + data["promotions"]:
        assert d["block_bytes"] == 1 << 20 and d["gbps"] > 0 and d["raw_move_gbps"] > 0
        assert consistent(d["ratio"], d["gbps"], d["raw_move_gbps"]), d
    # into a full tier: a promotion, a handoff's reservation, an engine's stores; the lock wait
    assert [f["path"] for f in data["full_tier"]] == ["disk->cpu (full)", "reserve (full)", "store (full)"]
    for f in data["full_tier"]:
        assert f["gbps"] > 0 and f["sequential_gbps"] > 0 and 0 <= f["lock_wait_p50_ms"] <= f["lock_wait_p99_ms"]
        assert consistent(f["ratio"], f["gbps"], f["sequential_gbps"]), f
    table = subprocess.run(
        [str(exe), "tiers", "--block-mib", "1", "--blocks", "4", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert table.returncode == 0 and "moves with a codec" in table.stdout and "reserve (full)" in table.stdout


def test_the_full_tier_rows_run_over_a_gpu_tier_too(tmp_path):
    """The rows a CUDA machine adds (a GPU tier full, pushing out to the CPU tier), run
    here on a host slab standing in for the GPU: each measured, ratios consistent."""
    from benchmarks.tiers import bench_full_tier

    rows = bench_full_tier(1, 4, 1, False, str(tmp_path), gpu_device="cpu")
    assert [r.path for r in rows] == ["cpu->gpu (full)", "reserve gpu (full)", "store gpu (full)"]
    for r in rows:
        assert r.gbps > 0 and r.sequential_gbps > 0 and consistent(r.ratio, r.gbps, r.sequential_gbps), r
