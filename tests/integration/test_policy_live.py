"""The tier policy in the live reconcile loop: with watermarks set through the admin API,
the control plane demotes an agent's CPU tier into its disk tier down to the low
watermark, leaves pinned blocks where they are, and the index follows."""

from __future__ import annotations

import time

import torch

from agent.server import DEMO_MODEL
from cli.client import ControlPlaneClient
from protos.block_hash import hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import wait_for

M = DEMO_MODEL
BS = M.block_size


def tiered_agent(make_agent, agent_id: str, cpu_blocks: int, tmp_path):
    """An agent with a CPU tier of `cpu_blocks` blocks over a disk tier."""
    return make_agent(
        agent_id,
        cpu_capacity_bytes=cpu_blocks * M.block_bytes,
        disk_dir=str(tmp_path / "d"),
        disk_capacity_bytes=1 << 24,
        page_bytes=M.block_bytes,
    )


def test_policy_demotes_to_low_watermark_and_respects_pins(controlplane, make_agent, tmp_path):
    a = tiered_agent(make_agent, "pol", 20, tmp_path)
    kv = torch.zeros((4, *M.block_shape), dtype=torch.float16)
    prompts = [list(range(10_000 * i, 10_000 * i + 4 * BS)) for i in range(4)]  # 16 blocks: 80% of CPU
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.6", "cpu.low_watermark": "0.4"})
        for p in prompts:
            a.engine.store(M.model_id, p, kv)
        # the control plane knows the model once it has seen the agent (a pin before is NOT_FOUND)
        wait_for(lambda: any(m["model_id"] == M.model_id for m in c.stats().models), 20, what="model known")
        pin = c.pin(model_id=M.model_id, token_ids=prompts[0], min_tier="cpu", ttl_seconds=120)
        for p in prompts[:2]:
            c.lookup(M.model_id, p)  # evidence: these two are reused

        def cpu_blocks():
            return next(t.num_blocks for t in a.pool.usage() if t.tier == Tier.CPU)

        wait_for(lambda: cpu_blocks() <= 8, 15, 0.2, "CPU tier down to its low watermark (8 of 20 blocks)")
        pinned = split_hashes(hash_prefix(M.model_id, prompts[0], BS))
        assert all(a.pool.tier_of(h) == Tier.CPU for h in pinned)
        wait_for(
            lambda: sum(m.tiers.count("disk") for m in c.lookup(M.model_id, prompts[3]).agents) > 0,
            10,
            0.2,
            "the index shows demoted blocks on disk",
        )
        assert a.engine.load(M.model_id, prompts[3]).num_cached_tokens == 4 * BS  # still served, from disk
        assert controlplane.manager.policy_actions_total > 0
        # what the demotions moved, as the agent counts it, reaches kvctl stats / the dashboard
        wait_for(lambda: c.stats().tier_moved_bytes_total >= 8 * M.block_bytes, 5, 0.2, "moved bytes reported")
        stats = c.stats()  # the policy's latest pass, as kvctl stats shows it
        assert stats.policy_passes_total > 0 and stats.policy_recent_first is False
        assert stats.policy_reuse_credit_turnovers == controlplane.manager.policy_credit_turnovers
        c.unpin(pin.pin_id)


def test_a_tier_filled_over_its_high_watermark_is_brought_down_before_the_periodic_pass(
    controlplane, make_agent, tmp_path
):
    """The workload can fill the band between the watermarks in about a second: an
    agent's report of a tier over its high watermark (after it answered the last pass's
    commands) brings a pass at once instead of at the next periodic one."""
    a = tiered_agent(make_agent, "urgent", 20, tmp_path)
    kv = torch.zeros((4, *M.block_shape), dtype=torch.float16)
    manager = controlplane.manager

    def cpu_blocks():
        return next(t.num_blocks for t in a.pool.usage() if t.tier == Tier.CPU)

    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.6", "cpu.low_watermark": "0.4"})
        for i in range(4):  # 16 blocks: 80% of CPU, over 60%
            a.engine.store(M.model_id, list(range(10_000 * i, 10_000 * i + 4 * BS)), kv)
        wait_for(lambda: cpu_blocks() <= 8, 15, 0.2, "first demotion to the low watermark")
        manager.policy_interval_seconds = 3600.0  # no periodic pass from here on
        manager._next_policy = manager.clock() + 3600.0
        passes = manager.policy_passes_total
        for i in range(4, 8):  # 8 + 16 blocks: full, then the agent's own room-making
            a.engine.store(M.model_id, list(range(10_000 * i, 10_000 * i + 4 * BS)), kv)
        wait_for(lambda: cpu_blocks() <= 8, 10, 0.2, "CPU tier back to its low watermark without a periodic pass")
        assert manager.policy_passes_total > passes
        quiet = manager.policy_passes_total
        time.sleep(2.0)  # under the watermark: no more passes (each would copy the agent's blocks)
        assert manager.policy_passes_total == quiet


def test_a_gpu_pin_on_an_agent_without_a_gpu_makes_no_pass_decide_for_it(controlplane, make_agent, tmp_path):
    """Its blocks in the agent's fastest tier are as far up as they can go: `decide` has
    nothing to do, so the pass should not copy the agent's blocks out every 2 s for it."""
    a = tiered_agent(make_agent, "nogpu", 20, tmp_path)
    kv = torch.zeros((2, *M.block_shape), dtype=torch.float16)
    prompt = list(range(2 * BS))
    a.engine.store(M.model_id, prompt, kv)
    manager = controlplane.manager
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: any(m["model_id"] == M.model_id for m in c.stats().models), 20, what="model known")
        c.pin(model_id=M.model_id, token_ids=prompt, min_tier="gpu", ttl_seconds=120)
        passes, decided = manager.policy_passes_total, manager.policy_agents_decided_total
        # the same passes every 0.5 s instead of every 2 s: the three are counted, not timed
        manager.policy_interval_seconds = 0.5
        manager._next_policy = min(manager._next_policy, manager.clock() + 0.5)
        wait_for(lambda: manager.policy_passes_total >= passes + 3, 15, 0.05, "three passes")
        assert manager.policy_agents_decided_total == decided
        assert all(t == "cpu" for t in c.lookup(M.model_id, prompt).agents[0].tiers)


def test_a_tier_pins_hold_over_its_watermark_does_not_bring_a_pass_at_every_report(controlplane, make_agent, tmp_path):
    """Nothing can leave it: a pass that found nothing to do is not brought forward again
    by the agent's next report (each pass copies the agent's blocks out of the index);
    the periodic pass looks again."""
    a = tiered_agent(make_agent, "held", 10, tmp_path)
    kv = torch.zeros((8, *M.block_shape), dtype=torch.float16)
    prompt = list(range(8 * BS))
    manager = controlplane.manager
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.6", "cpu.low_watermark": "0.4"})
        a.engine.store(M.model_id, prompt, kv)  # 8 of 10 blocks: over 60 %
        wait_for(lambda: any(m["model_id"] == M.model_id for m in c.stats().models), 20, what="model known")
        c.pin(model_id=M.model_id, token_ids=prompt, min_tier="cpu", ttl_seconds=120)
        wait_for(lambda: len(a.pool.pins.pins) == 1, 10, 0.1, "pin applied")
        manager.policy_interval_seconds = 3600.0
        manager._next_policy = manager.clock()  # one periodic pass now, then none
        wait_for(lambda: manager._next_policy > manager.clock() + 60, 10, 0.1, "the periodic pass ran")
        decided = manager.policy_agents_decided_total
        time.sleep(2.0)  # ten reports of the tier over its watermark
        assert manager.policy_agents_decided_total - decided <= 1
        assert next(t.num_blocks for t in a.pool.usage() if t.tier == Tier.CPU) == 8  # pinned: all stay
