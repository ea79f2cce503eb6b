"""A PIN command as an agent executes it (ControlPlaneLink.handle_command on an
in-process Agent: real pool, CPU slab, disk directory; no control plane): a pin sent
with an expiry already past protects nothing, also on a machine booted moments ago
(its monotonic clock is small: the time left, negative, must not become "no expiry")."""

from __future__ import annotations

import time

import pytest

from agent.server import Agent, AgentConfig
from protos.kvcp.v1 import agent_pb2
from protos.tier import Tier
from tests.tiers.support import BLOCK_BYTES, SPEC, kv, tokens

PIN = agent_pb2.COMMAND_KIND_PIN


@pytest.fixture
def agent(tmp_path) -> Agent:
    """Built, not started: nothing listens and nothing talks to etcd."""
    return Agent(
        AgentConfig(
            agent_id="cmd",
            models=[SPEC],
            cpu_capacity_bytes=8 * BLOCK_BYTES,
            page_bytes=BLOCK_BYTES // 16,
            disk_dir=str(tmp_path / "disk"),
            disk_capacity_bytes=1 << 20,
        )
    )


def test_a_pin_past_its_expiry_protects_nothing_on_a_machine_just_booted(agent):
    toks = tokens(1)
    assert agent.engine.store(SPEC.model_id, toks, kv(1)).num_stored_blocks == 1
    h = agent.engine.hashes(SPEC, toks)[0]
    agent.pool.pins.clock = lambda: 5.0  # booted 5 s ago
    past = time.time() - 60  # expired a minute ago (a control plane sending only its absolute expiry)
    cmd = agent_pb2.Command(
        op_id="op-p", kind=PIN, block_hashes=h, tier=int(Tier.CPU), pin_id="old", expires_unix_seconds=past
    )
    agent.link.handle_command(1, cmd)
    assert agent.pool.pin_tier(agent.pool.blocks[h]) == 0, "a pin past its expiry holds (for ever)"
