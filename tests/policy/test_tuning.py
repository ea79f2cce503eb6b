"""CreditTuner: shadow caches pick the reuse credit that the recent lookups reward:
credits on shared documents among one-off prompts, none (recency) on multi-turn chat;
and recent-first eviction on a loop larger than the cache, only there."""

from __future__ import annotations

import pytest

from benchmarks import replay as rp
from controlplane.core.access_stats import AccessStats
from controlplane.core.tuning import CreditTuner
from protos.tier import Tier
from tests.policy.support import conversation_trace, loop_trace, synthetic_trace


def tune(raw: list[dict], fraction: float, sample: float = 1.0) -> CreditTuner:
    trace = [rp.Request(r["timestamp"], r["input_length"], tuple(r["hash_ids"])) for r in raw]
    stats = AccessStats()
    capacity = max(1, int(rp.unique_blocks(trace) * fraction))
    tuner = CreditTuner(capacity, max_shadow_blocks=max(1, int(capacity * sample)))
    for r in trace:
        keys = [x.to_bytes(16, "big") for x in r.hash_ids]
        stats.record_lookup(keys, r.timestamp_ms / 1000)
        tuner.observe(keys, r.timestamp_ms / 1000, stats)
    return tuner


def test_documents_among_one_off_prompts_want_credits():
    tuner = tune(synthetic_trace(num_requests=700, seed=3), 1 / 24)
    assert tuner.best() > 0
    scores = tuner.scores()
    assert scores[tuner.best()] > scores[0.0]


def test_multi_turn_chat_wants_recency():
    tuner = tune(conversation_trace(num_requests=600, seed=2), 1 / 24)
    assert tuner.best() == 0.0


@pytest.mark.parametrize("sample", [0.5])
def test_shadows_of_a_big_cluster_are_capped_and_still_choose(sample):
    docs = tune(synthetic_trace(num_requests=700, seed=3), 1 / 24, sample)
    chat = tune(conversation_trace(num_requests=600, seed=2), 1 / 24, sample)
    for tuner in (docs, chat):
        assert tuner.shadow_blocks == max(1, int(tuner.capacity_blocks * sample))
        assert all(len(sh) <= sh.capacity_blocks == tuner.shadow_blocks for sh in tuner.shadows)
    assert docs.best() > chat.best()  # documents want credits, chat (next to) none


def test_policy_with_tuning_keeps_up_with_lru_on_chat():
    raw = conversation_trace(num_requests=600, seed=4)
    trace = [rp.Request(r["timestamp"], r["input_length"], tuple(r["hash_ids"])) for r in raw]
    capacity = rp.unique_blocks(trace) // 24
    tuned = rp.replay("chat", capacity, trace=trace)
    assert tuned.policy_hit_ratio >= 0.97 * tuned.lru_hit_ratio
    fixed = rp.policy_run(trace, [(Tier.GPU, capacity)], rp.replay_policy(tune_reuse_credits=False))
    assert fixed.hit_tokens < tuned.policy_hit_ratio * tuned.input_tokens  # fixed credits lose on chat


def test_no_hits_yet_keeps_the_default():
    tuner = CreditTuner(10, default=2.0)
    assert tuner.best() == 2.0
    with pytest.raises(ValueError):
        CreditTuner(0)


def test_a_loop_larger_than_the_cache_turns_eviction_recent_first():
    loop = tune(loop_trace(), 0.4)
    assert loop.recent_first()
    assert loop.scan.score > 100 * max(loop.scores().values())  # recency shadows hit (next to) nothing
    for trace in (synthetic_trace(num_requests=700, seed=3), conversation_trace(num_requests=600, seed=2)):
        assert not tune(trace, 1 / 24).recent_first()


@pytest.mark.parametrize("fraction", [0.4, 0.2])
def test_policy_on_a_loop_matches_belady_where_lru_hits_nothing(fraction):
    raw = loop_trace()
    trace = [rp.Request(r["timestamp"], r["input_length"], tuple(r["hash_ids"])) for r in raw]
    capacity = int(rp.unique_blocks(trace) * fraction)
    result = rp.replay("loop", capacity, trace=trace)
    assert result.lru_hit_ratio == 0.0
    assert result.policy_hit_ratio >= 0.95 * result.belady_hit_ratio > 0
    assert result.recent_first_passes > 0
    off = rp.policy_run(trace, [(Tier.GPU, capacity)], rp.replay_policy(scan_resistance=False))
    assert off.hit_tokens == 0 and off.recent_first_passes == 0
