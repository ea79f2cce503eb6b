"""Pages reserved for a handoff still arriving are in a tier's used bytes but hold no
block yet. The policy sizes a tier in blocks by what its blocks take: when it divided
used bytes by blocks, a decode agent receiving a handoff looked fuller than it was, and a
pass dropped its own blocks while the handoff landed (found by the drain's review).
Real etcd, control plane and agents; the handoff paced so its reservation stays open."""

from __future__ import annotations

import time

import torch

from agent.dataplane import DataPlaneConfig
from agent.server import DEMO_MODEL
from cli.client import ControlPlaneClient
from tests.helpers import wait_for

M = DEMO_MODEL


def tokens(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * M.block_size))


def test_a_handoff_arriving_does_not_make_the_policy_drop_the_destinations_blocks(controlplane, make_agent):
    capacity_blocks, own_blocks, incoming = 20, 16, 4  # 80 %, then 100 % while 4 are reserved
    pace = DataPlaneConfig(link_bytes_per_second=M.block_bytes / 2)  # ~8 s for the 4 blocks
    src = make_agent("rp-src", dataplane=pace)
    dst = make_agent("rp-dst", cpu_capacity_bytes=capacity_blocks * M.block_bytes, shm_handoff=False)
    own = tokens(own_blocks, start=900_000)
    dst.engine.store(M.model_id, own, torch.ones((own_blocks, *M.block_shape), dtype=torch.float16))
    prompt = tokens(incoming, start=950_000)
    src.engine.store(M.model_id, prompt, torch.ones((incoming, *M.block_shape), dtype=torch.float16))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: c.lookup(M.model_id, token_ids=own).best_agent_id == "rp-dst", what="indexed")
        # the source's prompt too (a Transfer asked before its blocks were indexed is refused:
        # "holds no block of this prefix", a clean-clone CI run's failure)
        wait_for(lambda: c.lookup(M.model_id, token_ids=prompt).best_agent_id == "rp-src", what="prompt indexed")
        op = c.transfer(M.model_id, "rp-src", "rp-dst", token_ids=prompt, deadline_seconds=60)

        def reserved() -> bool:  # the destination reports the reservation's pages as used
            tier = {a.agent_id: a for a in c.list_agents()}["rp-dst"].tiers[0]
            return tier.used_bytes == (own_blocks + incoming) * M.block_bytes and tier.num_blocks == own_blocks

        wait_for(reserved, 10, 0.05, what="the reservation reported")
        time.sleep(1.5)  # policy passes see it (reports every 0.2 s; one over a watermark is urgent)
        # Checked while the reservation is open: once the handoff lands the tier holds 20 of
        # 20 blocks, over its high watermark, and a pass rightly drops down to the low one.
        held_while_reserved = dst.engine.load(M.model_id, own).num_cached_tokens
        assert c.get_operation(op.op_id).state == "RUNNING", "the handoff landed before the check: pace it slower"
        assert held_while_reserved == len(own), "the policy dropped its own blocks while the handoff arrived"
        assert c.wait_operation(op.op_id, 60).state == "SUCCEEDED"
    low_blocks = int(0.90 * capacity_blocks)  # the default low watermark
    assert dst.pool.usage()[0].num_blocks >= low_blocks, "a pass dropped past the low watermark after landing"
