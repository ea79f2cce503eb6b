"""Integration: a real etcd, an in-process control plane and an agent with a disk tier.
The agent stores blocks that spill to disk, stops without deregistering, and a new
agent process (same id, same directory) recovers the disk blocks by checksum, reports
them to the control plane as disk-tier blocks and serves their original bytes."""

from __future__ import annotations

import pytest
import torch

from agent.server import DEMO_MODEL, Agent, AgentConfig
from cli.client import ControlPlaneClient
from protos.tier import Tier
from tests.helpers import wait_for

M = DEMO_MODEL
BS = M.block_size


@pytest.fixture
def controlplane(controlplane):
    """The control plane without its tier policy: these tests check where the agent itself
    put the blocks. A CPU tier of 2 blocks holding 2 is over its high watermark (a pass
    demoted one of them to disk: a lookup on a loaded machine saw ['cpu', 'disk']), and the
    restarted agent's empty CPU tier is room a pass fills with the disk blocks the test's
    lookups made hot."""
    controlplane.manager.policy_enabled = False
    return controlplane


def kv(n_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n_blocks, *M.block_shape), generator=g).to(torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def start_agent(etcd: str, disk_dir: str, agent_id: str = "restarter") -> Agent:
    return Agent(
        AgentConfig(
            agent_id=agent_id,
            listen="127.0.0.1:0",
            etcd=etcd,
            lease_ttl_seconds=3,
            stats_interval_seconds=0.2,
            cpu_capacity_bytes=2 * M.block_bytes,  # the rest spills to disk
            disk_dir=disk_dir,
            disk_capacity_bytes=64 * M.block_bytes,
        )
    ).start()


def tiers_of(client: ControlPlaneClient, agent_id: str) -> dict[str, int]:
    for a in client.list_agents():
        if a.agent_id == agent_id:
            return {t.tier: t.num_blocks for t in a.tiers}
    return {}


def hit(client: ControlPlaneClient, token_ids: list[int]) -> tuple[int, list[str]]:
    res = client.lookup(M.model_id, token_ids)
    return (res.agents[0].num_hit_blocks, res.agents[0].tiers) if res.agents else (0, [])


def test_restarted_agent_reports_and_serves_its_recovered_disk_tier(controlplane, etcd, tmp_path):
    disk_dir = str(tmp_path / "disk")
    prompt, data = tokens(6), kv(6)
    other, other_data = tokens(2, start=50_000), kv(2, seed=1)
    first = start_agent(etcd, disk_dir)
    try:
        first.engine.store(M.model_id, prompt, data)
        first.engine.store(M.model_id, other, other_data)  # pushes all of `prompt` to disk
        hashes = first.engine.hashes(M, prompt)
        assert [first.pool.tier_of(h) for h in hashes] == [Tier.DISK] * 6
        with ControlPlaneClient(controlplane.address) as c:
            wait_for(lambda: hit(c, prompt) == (6, ["disk"] * 6), what="the first agent's disk blocks indexed")
            assert hit(c, other) == (2, ["cpu"] * 2)
        first.disk.flush()
        old_session = first.link.session_id
    finally:
        first.stop(deregister=False)  # as if the process died: its lease outlives it a while

    second = start_agent(etcd, disk_dir)
    try:
        assert second.link.session_id != old_session
        assert [second.pool.tier_of(h) for h in hashes] == [Tier.DISK] * 6  # recovered at start
        with ControlPlaneClient(controlplane.address) as c:
            # the new inventory replaces the old: the CPU blocks died with the process
            wait_for(lambda: hit(c, other) == (0, []), what="the lost CPU blocks dropped from the index")
            assert hit(c, prompt) == (6, ["disk"] * 6)
            wait_for(lambda: tiers_of(c, "restarter").get("disk") == 6, what="the disk tier usage reported")
            assert tiers_of(c, "restarter").get("cpu") == 0
            assert [a.agent_id for a in c.list_agents()] == ["restarter"]
        res = second.engine.load(M.model_id, prompt)
        assert res.num_cached_tokens == 6 * BS and torch.equal(res.kv, data)
        assert res.tiers == (Tier.DISK,) * 6
        assert second.engine.lookup(M.model_id, other) == 0
    finally:
        second.stop()


def test_restart_with_a_corrupt_block_recovers_the_prefix_before_it(controlplane, etcd, tmp_path):
    disk_dir = str(tmp_path / "disk")
    prompt, data = tokens(4), kv(4, seed=2)
    first = start_agent(etcd, disk_dir, "scarred")
    try:
        first.engine.store(M.model_id, prompt, data)
        first.engine.store(M.model_id, tokens(2, start=70_000), kv(2, seed=3))
        hashes = first.engine.hashes(M, prompt)
        assert [first.pool.tier_of(h) for h in hashes] == [Tier.DISK] * 4
        meta = first.pool.blocks[hashes[2]]
        path, payload_at, _ = first.disk.location(meta.handle)
        last = payload_at + meta.stored_bytes - 1
        first.disk.flush()
    finally:
        first.stop(deregister=False)
    with open(path, "r+b") as f:  # a bit rots while the agent is down
        f.seek(last)
        byte = f.read(1)
        f.seek(last)
        f.write(bytes([byte[0] ^ 0x01]))

    second = start_agent(etcd, disk_dir, "scarred")
    try:
        assert second.pool.corrupt_blocks_total == 1
        assert set(second.pool.blocks) == set(hashes[:2])  # the corrupt block and its child are gone
        with ControlPlaneClient(controlplane.address) as c:
            wait_for(lambda: hit(c, prompt) == (2, ["disk"] * 2), what="the recovered prefix indexed")
        res = second.engine.load(M.model_id, prompt)
        assert res.num_cached_tokens == 2 * BS and torch.equal(res.kv, data[:2])
    finally:
        second.stop()


def test_parked_blocks_after_a_restart_reach_kvctl_agents(controlplane, etcd, tmp_path):
    """Disk blocks whose prefix was in memory wait after a restart (parked): their bytes
    count in the disk tier's used bytes, the blocks in no count. The agent reports them,
    and `kvctl agents` says why the disk tier is used with no blocks in it."""
    from cli import output

    disk_dir = str(tmp_path / "disk")
    prompt, data = tokens(2), kv(2, seed=4)
    first = start_agent(etcd, disk_dir, agent_id="parker")
    try:
        first.engine.store(M.model_id, prompt, data)  # both blocks fit the CPU tier
        head, tail = first.engine.hashes(M, prompt)
        assert first.pool.move_block(tail, Tier.DISK).ok  # its prefix stays in memory
        first.disk.flush()
    finally:
        first.stop(deregister=False)

    second = start_agent(etcd, disk_dir, agent_id="parker")
    try:
        assert second.pool.num_parked_blocks == 1
        with ControlPlaneClient(controlplane.address) as c:

            def disk_view():
                for a in c.list_agents():
                    if a.agent_id == "parker":
                        return next((t for t in a.tiers if t.tier == "disk"), None)
                return None

            wait_for(lambda: (v := disk_view()) is not None and v.num_parked_blocks == 1, what="parked block reported")
            view = disk_view()
            assert view.num_blocks == 0 and view.used_bytes > 0
            assert "[1 blocks parked after a restart]" in output.tier_cell(view)
            from dashboard import render

            assert render.parked_suffix(view) == " (+1 blocks parked after a restart)"  # the dashboard's tier lines
            # stored again by an engine: adopted, and the count goes
            second.engine.store(M.model_id, prompt, data)
            wait_for(lambda: (v := disk_view()) is not None and (v.num_blocks, v.num_parked_blocks) == (1, 0))
    finally:
        second.stop()
