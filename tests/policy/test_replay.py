"""Trace replay: the hit semantics and the baselines on tiny hand-made traces with
known answers, the calibration figures on the shipped trace (when present), the
`kvcp-bench replay` command, and the policy beating LRU on a generated trace."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import replay as rp
from benchmarks.main import main as bench_main
from protos.tier import Tier
from tests.policy.support import synthetic_trace, write_trace

SHIPPED = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"
KEYS = {
    "policy_hit_ratio",
    "lru_hit_ratio",
    "belady_hit_ratio",
    "infinite_hit_ratio",
    "capacity_blocks",
    "unique_blocks",
    "policy_vs_lru",
    "policy_vs_belady",
    "tier_hit_ratio",
}


def req(ids, input_length=None, t=0):
    return rp.Request(t, input_length if input_length is not None else 512 * len(ids), tuple(ids))


# ---- hit semantics and baselines ----------------------------------------------------------
def test_hit_tokens_count_leading_blocks_and_the_partial_last_one():
    r = req([1, 2, 3], input_length=1200)
    assert [rp.hit_tokens(r, n) for n in range(4)] == [0, 512, 1024, 1200]
    assert rp.hit_tokens(req([1, 2], input_length=700), 2) == 700
    assert rp.hit_tokens(req([1, 2, 3], input_length=600), 2) == 600  # min(input_length, 512 * hits)
    assert [rp.block_tokens(r, p) for p in range(3)] == [512, 512, 176]
    # block ids past input_length (a trace whose ids run on) add nothing: per-block tokens
    # always sum to the request's hit tokens, so per-tier hits add up to the total
    long = req([1, 2, 3, 4], input_length=600)
    assert [rp.block_tokens(long, p) for p in range(4)] == [512, 88, 0, 0]
    assert sum(rp.block_tokens(long, p) for p in range(3)) == rp.hit_tokens(long, 3)


def test_a_trace_whose_block_ids_are_not_prefix_chains_replays_tiered_to_the_end():
    """Block 4 starts a prompt after it followed block 3 in another: its parent sat in a
    slower tier than it, decide found no tail, and the tiered replay ended on an
    AssertionError (a review). The agent's own safety net trims such a tier now, counted."""
    trace = [req([1, 2, 3, 4, 5]), req([1, 2, 3, 4, 5]), req([1, 2, 3]), req([1, 2, 3, 4, 5]), req([4, 5]), req([5])]
    result = rp.replay("not-chains", tiers=[(Tier.GPU, 2), (Tier.CPU, 2)], trace=trace)
    assert result.safety_net_blocks > 0
    assert 0 < result.policy_hit_ratio <= result.infinite_hit_ratio
    assert sum(result.tier_hit_ratio.values()) == pytest.approx(result.policy_hit_ratio, abs=1e-9)
    consistent = [req([1, 2, 3, 4, 5]), req([1, 2, 3]), req([1, 2, 3, 4, 5]), req([1, 6]), req([1, 2])]
    assert rp.replay("chains", tiers=[(Tier.GPU, 2), (Tier.CPU, 2)], trace=consistent).safety_net_blocks == 0


def test_belady_trims_after_a_request_is_admitted_whole():
    """Trimmed block by block, block 2 of request 3 still said "next use: now" and could
    not go, though it is never used again (MIN: 2 of 6 blocks' tokens hit; was 1: a review)."""
    trace = [req([2]), req([3]), req([1, 2]), req([1]), req([3])]
    assert rp.belady_hit_ratio(trace, 2) == 1024 / 3072


def test_lru_belady_and_infinite_on_a_hand_made_trace():
    # capacity 2: [1,2] twice, a one-off [3], then [1,2] again
    trace = [req([1, 2]), req([1, 2]), req([3], input_length=100), req([1, 2])]
    total = 1024 * 3 + 100
    # LRU: the one-off evicts block 1 (least recently used): the last request misses
    assert rp.lru_hit_ratio(trace, 2) == 1024 / total
    # MIN evicts the block never used again (the one-off itself)
    assert rp.belady_hit_ratio(trace, 2) == 2048 / total
    assert rp.infinite_hit_ratio(trace) == 2048 / total
    assert rp.next_uses(trace) == [[1, 1], [3, 3], [math.inf], [math.inf, math.inf]]
    # told that the one-off is dead, LRU keeps [1, 2]; told the counts, so does LFU
    # told each class's reuse statistics (fitted on this trace), the one-off's class is
    # likelier to stay unused than the pair's: it goes
    assert rp.oracle_bounds(trace, 2) == {
        "dead_block_oracle": 2048 / total,
        "total_count_oracle": 2048 / total,
        "hindsight_class_oracle": 2048 / total,
    }


def test_prefix_semantics_a_hole_early_kills_later_hits():
    # LRU with capacity 2 keeps the two most recent blocks [2, 3] of [1, 2, 3]: no prefix
    trace = [req([1, 2, 3]), req([1, 2, 3])]
    assert rp.lru_hit_ratio(trace, 2) == 0.0
    # MIN on blocks: all three are next used by the same request; ties go to the block
    # earliest in its prompt, so it keeps [2, 3] too (block MIN ignores prefix structure)
    assert rp.belady_hit_ratio(trace, 2) == 0.0
    # the policy shrinks chains from the tail: it keeps [1, 2]
    run = rp.policy_run(trace, [(Tier.GPU, 2)])
    assert run.hit_tokens == 1024


def test_partial_prefix_hit_and_lru_recency():
    trace = [req([1, 2, 3], 1200), req([1, 2, 4], 1300), req([5]), req([1, 2, 3], 1200)]
    total = 1200 + 1300 + 512 + 1200
    # capacity 4, LRU: after [5] the cache is {2, 4, 1, 5}... block 3 was evicted first
    assert rp.lru_hit_ratio(trace, 4) == (1024 + 1024) / total
    assert rp.infinite_hit_ratio(trace) == (1024 + 1200) / total
    assert rp.belady_hit_ratio(trace, 4) == (1024 + 1200) / total


@pytest.mark.skipif(not SHIPPED.exists(), reason="the shipped trace is not checked out next to the repo")
def test_baselines_match_the_calibration_figures_of_the_design():
    trace = rp.load_trace(SHIPPED)
    assert rp.unique_blocks(trace) == 43924
    assert round(rp.infinite_hit_ratio(trace), 4) == 0.6512
    assert round(rp.lru_hit_ratio(trace, 2745), 4) == 0.1832
    assert round(rp.belady_hit_ratio(trace, 2745), 4) == 0.4353
    assert round(rp.lru_hit_ratio(trace, 686), 4) == 0.0629
    assert round(rp.belady_hit_ratio(trace, 686), 4) == 0.2231


# ---- the policy -----------------------------------------------------------------------------
def test_policy_beats_lru_on_shared_documents_with_one_off_prompts():
    raw = synthetic_trace(num_requests=700, seed=3)
    trace = [rp.Request(r["timestamp"], r["input_length"], tuple(r["hash_ids"])) for r in raw]
    capacity = rp.unique_blocks(trace) // 24
    result = rp.replay("generated", capacity, trace=trace)
    assert result.policy_hit_ratio >= 1.2 * result.lru_hit_ratio
    assert result.lru_hit_ratio > 0
    assert result.policy_hit_ratio <= result.infinite_hit_ratio
    # the replay keeps the tier within capacity after every request (checked inside)
    assert result.evicted_blocks > 0


@pytest.mark.parametrize("make", ["documents", "chat"])
def test_timestamps_that_tie_do_not_collapse_the_policy(make):
    """Traces with coarse or no timestamps (many requests at one time): blocks whose clock
    times tie are ordered by their last lookup, not by hash (which evicted by block id)."""
    from tests.policy.support import conversation_trace

    raw = synthetic_trace(num_requests=500, seed=3) if make == "documents" else conversation_trace(500, seed=2)
    trace = [rp.Request(0, r["input_length"], tuple(r["hash_ids"])) for r in raw]
    result = rp.replay("no-timestamps", rp.unique_blocks(trace) // 16, trace=trace)
    assert result.policy_hit_ratio >= 0.95 * result.lru_hit_ratio > 0


def test_tiered_replay_counts_hits_in_any_tier():
    raw = synthetic_trace(num_requests=300, seed=5)
    trace = [rp.Request(r["timestamp"], r["input_length"], tuple(r["hash_ids"])) for r in raw]
    flat = rp.replay("generated", 300, trace=trace)
    tiered = rp.replay("generated", tiers=[(Tier.GPU, 50), (Tier.CPU, 100), (Tier.DISK, 150)], trace=trace)
    assert tiered.capacity_blocks == 300 and tiered.lru_hit_ratio == flat.lru_hit_ratio
    assert set(tiered.tier_hit_ratio) == {"gpu", "cpu", "disk"}
    assert math.isclose(sum(tiered.tier_hit_ratio.values()), tiered.policy_hit_ratio)
    assert tiered.demoted_blocks > 0 and tiered.tier_hit_ratio["cpu"] > 0
    # requests whose block ids run past their input length: tiers still add up
    ragged = [rp.Request(r.timestamp_ms, max(r.input_length // 3, 1), r.hash_ids) for r in trace]
    tiered = rp.replay("ragged", tiers=[(Tier.GPU, 50), (Tier.CPU, 100), (Tier.DISK, 150)], trace=ragged)
    assert math.isclose(sum(tiered.tier_hit_ratio.values()), tiered.policy_hit_ratio)


def test_store_events_alone_rank_blocks_by_store_time():
    """Evidence "events" (a vLLM fleet known by its KV events): no lookups reach the
    policy, only when blocks were stored. Capacity 4: A (2 blocks) stored at t=0, B (2) at
    t=1, then A hit at t=2 (a hit is no event), C (2) at t=3 evicts the oldest store, A;
    with no evidence at all the victims are whatever sorts first by hash."""
    trace = [req([1, 2], t=0), req([3, 4], t=1000), req([1, 2], t=2000), req([5, 6], t=3000), req([1, 2], t=4000)]
    events = rp.PolicyReplay([(Tier.GPU, 4)], evidence="events")
    hits = [events.step(r) for r in trace]
    assert hits == [0, 0, 1024, 0, 0]
    # A came back at t=4 (a miss) and was stored again: B, now the oldest store, went
    assert set(events.held[Tier.GPU]) == {rp._key(x) for x in (1, 2, 5, 6)}
    assert set(events.stored) == set(events.held[Tier.GPU])  # stamps leave with their blocks
    lookups = rp.PolicyReplay([(Tier.GPU, 4)])
    assert [lookups.step(r) for r in trace] == [0, 0, 1024, 0, 1024]  # A was asked for again: B goes
    with pytest.raises(ValueError, match="evidence"):
        rp.PolicyReplay([(Tier.GPU, 4)], evidence="rumours")


# ---- the command ----------------------------------------------------------------------------
@pytest.fixture
def trace_file(tmp_path):
    return write_trace(tmp_path / "trace.jsonl", synthetic_trace(num_requests=200, seed=11))


def test_replay_command_json(trace_file):
    out = CliRunner().invoke(
        bench_main, ["replay", str(trace_file), "--capacity-blocks", "100", "--oracles", "-o", "json"]
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert KEYS | {f"{k}_oracle_hit_ratio" for k in ("dead_block", "total_count", "hindsight_class")} <= set(data)
    assert 0 <= data["hindsight_class_oracle_hit_ratio"] <= data["infinite_hit_ratio"]
    assert data["capacity_blocks"] == 100 and data["unique_blocks"] > 100
    assert 0 <= data["lru_hit_ratio"] <= data["belady_hit_ratio"] <= data["infinite_hit_ratio"] <= 1


def test_replay_command_table_fractions_tiers_and_settings(trace_file):
    out = CliRunner().invoke(
        bench_main,
        [
            "replay",
            str(trace_file),
            "--capacity-fraction",
            "1/16",
            "--capacity-fraction",
            "5%",
            "--set",
            "max_reuse_credits=2",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "POLICY" in out.output and "BELADY" in out.output
    assert sum(1 for line in out.output.splitlines() if "x  gpu=" in line) == 2  # one row per capacity
    out = CliRunner().invoke(bench_main, ["replay", str(trace_file), "--tiers", "gpu=20,cpu=40,disk=60", "-o", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["tiers"] == {"gpu": 20, "cpu": 40, "disk": 60} and data["capacity_blocks"] == 120
    assert set(data["tier_hit_ratio"]) == {"gpu", "cpu", "disk"}


def test_a_trace_lru_hits_nothing_in_reports_no_ratio(tmp_path):
    """A loop of 4 two-block prompts through a cache of 2 blocks: LRU never hits, so there
    is no ratio to LRU (JSON null, n/a in the table), never an Infinity JSON cannot carry."""
    path = tmp_path / "loop.jsonl"
    lines = [
        json.dumps(
            {"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [10 * (i % 4), 10 * (i % 4) + 1]}
        )
        for i in range(40)
    ]
    path.write_text("\n".join(lines) + "\n")
    out = CliRunner().invoke(bench_main, ["replay", str(path), "--capacity-blocks", "2", "-o", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert data["lru_hit_ratio"] == 0 and data["policy_vs_lru"] is None
    table = CliRunner().invoke(bench_main, ["replay", str(path), "--capacity-blocks", "2"])
    assert table.exit_code == 0 and "n/a" in table.output and "inf" not in table.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tiers", "gpu=10,tpu=5"], "unknown tier 'tpu'"),
        (["--tiers", "gpu=ten"], "not a number of blocks"),
        (["--capacity-fraction", "2"], "fraction in (0, 1]"),
        (["--set", "gpu.high_watermark=2"], "--set[gpu.high_watermark]"),
        (["--set", "nonsense"], "expected KEY=VALUE"),
        (["--capacity-blocks", "0"], "0"),
    ],
)
def test_replay_command_rejects_bad_input(trace_file, args, words):
    out = CliRunner().invoke(bench_main, ["replay", str(trace_file), *args])
    assert out.exit_code != 0
    assert words in out.output
    assert "Traceback" not in out.output


def test_replay_command_rejects_a_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1}\n')
    out = CliRunner().invoke(bench_main, ["replay", str(bad)])
    assert out.exit_code != 0 and "bad.jsonl:2" in out.output


GOOD = '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n'


@pytest.mark.parametrize(
    "second, words",
    [
        ('{"timestamp": NaN, "input_length": 10, "hash_ids": [2]}', "timestamp must be a finite number"),
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [' + str(1 << 130) + "]}", "at most 128 bits"),
        ('{"timestamp": 1, "input_length": 10, "hash_ids": [3', "bad.jsonl:2"),  # a truncated last line
    ],
)
def test_replay_command_names_the_bad_line(tmp_path, second, words):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + second + "\n")
    out = CliRunner().invoke(bench_main, ["replay", str(bad)])
    assert out.exit_code != 0 and words in out.output and "Traceback" not in out.output


def test_a_gzipped_trace_is_read(tmp_path):
    import gzip

    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(gzip.compress((GOOD * 2).encode()))
    assert len(rp.load_trace(trace)) == 2


def test_the_shipped_conversation_trace_loads():
    trace = rp.load_trace(Path(__file__).parents[2] / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl.gz")
    assert len(trace) == 12031 and rp.unique_blocks(trace) == 182790


@pytest.mark.parametrize("fraction", [1 / 16, 1 / 64])
def test_policy_is_not_below_lru_on_the_arxiv_trace_piece(fraction):
    """A third trace the policy was not developed on (shared system prompts, many
    requests per timestamp): at least LRU's hits, at most Belady's."""
    trace = rp.load_trace(Path(__file__).parents[2] / "benchmarks" / "traces" / "mooncake_arxiv_trace_part.jsonl.gz")
    assert len(trace) == 1000 and rp.unique_blocks(trace) == 10037
    result = rp.replay("arxiv", trace=trace, capacity_fraction=fraction)
    assert result.lru_hit_ratio <= result.policy_hit_ratio <= result.belady_hit_ratio


def test_a_trace_with_a_byte_order_mark_is_read(tmp_path):
    trace = tmp_path / "bom.jsonl"
    trace.write_bytes("\ufeff".encode() + (GOOD * 3).encode())
    assert len(rp.load_trace(trace)) == 3


def test_console_script_runs(trace_file):
    exe = Path(sys.executable).with_name("kvcp-bench")
    proc = subprocess.run(
        [str(exe), "replay", str(trace_file), "--capacity-blocks", "64", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert KEYS <= set(json.loads(proc.stdout))


def test_hindsight_class_bound_learns_which_class_comes_back():
    """Long prompts come back, short one-offs never: a ranking by class keeps the long
    ones where LRU, flooded by the one-offs between their uses, loses them."""
    trace = []
    for i in range(60):
        trace.append(req([1000 + (i % 3) * 10 + j for j in range(4)], input_length=40_000))  # 3 long ones, reused
        trace.append(req([50_000 + i * 10 + j for j in range(4)], input_length=2_000))  # one-offs
    assert rp.lru_hit_ratio(trace, 12) == 0.0
    assert rp.hindsight_class_hit_ratio(trace, 12) == rp.belady_hit_ratio(trace, 12) == rp.infinite_hit_ratio(trace)


@pytest.fixture(scope="module")
def other_shapes(tmp_path_factory):
    """scripts/synthetic_traces.py's three shapes (RAG documents by a drifting Zipf law,
    multi-turn chats, hot prompts among one-off scans), 3,000 requests each."""
    out = tmp_path_factory.mktemp("shapes")
    script = Path(__file__).parents[2] / "scripts" / "synthetic_traces.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(out), "--requests", "3000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {name: rp.load_trace(out / f"{name}.jsonl") for name in ("zipf_docs", "sessions", "scan_mix")}


@pytest.mark.parametrize("shape", ["zipf_docs", "sessions", "scan_mix"])
def test_policy_holds_at_least_lru_on_other_trace_shapes(other_shapes, shape):
    """Shapes the policy was not written on: at least LRU's hits (within 1 % where LRU is
    near what history tells: chats that end at random), at most Belady's; on a scan mix,
    clearly more than LRU, which keeps every one-off long prompt."""
    result = rp.replay(shape, trace=other_shapes[shape], capacity_fraction=1 / 64)
    assert 0.99 * result.lru_hit_ratio <= result.policy_hit_ratio <= result.belady_hit_ratio, result
    if shape == "scan_mix":
        assert result.policy_hit_ratio >= 1.15 * result.lru_hit_ratio, result
