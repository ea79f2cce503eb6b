"""Regressions the chaos run found, each checked on its own.

An agent serving two models of different block sizes: the tier policy counted its
capacity in blocks of the larger model, took a tier of small blocks for overfull and
evicted nearly all of it on every pass (the chaos run's agents dropped to a few percent
of their cache, and the hit ratio with them)."""

from __future__ import annotations

import time

import torch

from agent.core.model_spec import ModelSpec
from agent.server import DEMO_MODEL
from protos.tier import Tier
from tests.helpers import wait_for

BIG = ModelSpec("big", block_size=32, num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")  # 1 MiB blocks


def test_policy_sizes_a_tier_by_the_blocks_it_holds(controlplane, make_agent):
    m = DEMO_MODEL
    # passes every 0.5 s instead of 2 s (the pass is the same): the few passes below are
    # counted, not slept for
    controlplane.manager.policy_interval_seconds = 0.5
    a = make_agent("two-models", models=[m, BIG], cpu_capacity_bytes=4 << 20)
    n = 25
    for i in range(8):  # 200 small blocks: 1.6 MiB of 4 MiB, far under the watermarks
        prompt = list(range(100_000 * i, 100_000 * i + n * m.block_size))
        a.engine.store(m.model_id, prompt, torch.zeros((n, *m.block_shape), dtype=torch.float16))

    def cpu_blocks() -> int:
        return next(t.num_blocks for t in a.pool.usage() if t.tier == Tier.CPU)

    wait_for(lambda: controlplane.cluster.index.num_agent_blocks("two-models") == 8 * n, 15, 0.2, "indexed")
    passes = controlplane.manager.policy_passes_total
    wait_for(lambda: controlplane.manager.policy_passes_total >= passes + 3, 15, 0.05, "a few policy passes")
    time.sleep(0.5)  # what the last pass sent has landed on the agent
    assert cpu_blocks() == 8 * n
