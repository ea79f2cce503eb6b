"""Found by a review of the tiers: a long prompt's chain (thousands of blocks) is
dropped without recursion; an evict counts every block it removed, each in its tier; a
pin that arrives while its blocks are on their way down stops them at the switch."""

from __future__ import annotations

import threading
import time

import pytest

from agent.core.block_pool import BlockPool
from agent.core.journal import REMOVED
from agent.server import Agent, AgentConfig
from agent.store.disk_tier import DiskTier
from agent.store.memory_tier import MemoryTier
from protos.block_hash import ROOT_PARENT_HASH
from protos.kvcp.v1 import agent_pb2
from protos.tier import Tier
from tests.tiers.support import BLOCK_BYTES, SPEC, block_on_disk, flip_byte, hashes, kv, make_engine, make_pool, tokens


def check_invariants(pool: BlockPool) -> None:
    """Prefix-closed, children counted, nothing left moving or referenced, each tier's
    usage what its blocks add up to (any tier kind)."""
    blocks = pool.blocks
    for h, meta in blocks.items():
        assert meta.parent_hash == ROOT_PARENT_HASH or meta.parent_hash in blocks, "a held block lost its parent"
        assert meta.num_children == sum(1 for m in blocks.values() if m.parent_hash == h)
        assert not meta.moving and meta.ref_count == 0 and meta.ready
    for u in pool.usage():
        metas = [m for m in blocks.values() if m.tier == u.tier]
        assert u.num_blocks == len(metas) and u.stored_bytes == sum(m.stored_bytes for m in metas)


def test_a_corrupt_block_with_thousands_of_descendants_is_a_miss_not_a_recursion_error(tmp_path):
    n = 1500  # a 24k-token prompt at 16 tokens a block
    pool = BlockPool(
        [MemoryTier(Tier.CPU, 8 * BLOCK_BYTES, BLOCK_BYTES, device="cpu"), DiskTier(tmp_path, 64 << 20)], [SPEC]
    )
    e = make_engine(pool)
    toks = tokens(n)
    e.store(SPEC.model_id, toks, kv(n))
    other = tokens(2, start=10**6)
    e.store(SPEC.model_id, other, kv(2, seed=9))
    hs = hashes(e, toks)
    at = block_on_disk(pool, hs[0])
    flip_byte(at.path, at.payload_offset)
    assert e.load(SPEC.model_id, toks).num_cached_tokens == 0
    assert not any(h in pool.blocks for h in hs)  # the block and every descendant went
    assert e.load(SPEC.model_id, other).num_cached_tokens == 2 * SPEC.block_size
    assert e.store(SPEC.model_id, tokens(3, start=2 * 10**6), kv(3, seed=3)).num_stored_blocks == 3
    check_invariants(pool)
    # a commanded evict of a long chain's root: the same, all or nothing
    e.store(SPEC.model_id, toks, kv(n))
    assert pool.drop(hashes(e, toks)[0]) and not any(h in pool.blocks for h in hs)
    check_invariants(pool)


def test_an_evict_counts_each_block_it_removed_in_its_own_tier(tmp_path):
    pool = make_pool(tmp_path, cpu_blocks=2)
    e = make_engine(pool)
    e.store(SPEC.model_id, tokens(4), kv(4))
    hs = hashes(e, tokens(4))
    tiers = [pool.tier_of(h) for h in hs]
    assert tiers == [Tier.DISK, Tier.DISK, Tier.CPU, Tier.CPU]
    pool.drain_events()
    assert pool.drop(hs[0])
    removed = sum(g.num_blocks for b in pool.drain_events() if b.kind == REMOVED for g in b.groups)
    assert removed == 4 and not pool.blocks
    assert dict(pool.commanded_evictions_total) == {Tier.CPU: 2, Tier.DISK: 2} | {
        t: 0 for t in pool.commanded_evictions_total if t not in (Tier.CPU, Tier.DISK)
    }


@pytest.mark.parametrize("how", ["move", "room for a store"])
def test_a_pin_arriving_while_its_blocks_go_down_keeps_them_up(tmp_path, monkeypatch, how):
    """The pin is checked when a move starts; one made while the bytes are written to the
    disk (a MOVE command, or the demotion that makes room for an engine's store) must
    stop the switch: the blocks stay at the pin's tier."""
    cpu_blocks = 8 if how == "move" else 4
    agent = Agent(
        AgentConfig(
            agent_id="race",
            models=[SPEC],
            cpu_capacity_bytes=cpu_blocks * BLOCK_BYTES,
            page_bytes=BLOCK_BYTES,
            disk_dir=str(tmp_path / "disk"),
            disk_capacity_bytes=1 << 20,
        )
    )
    try:
        toks = tokens(2)
        agent.engine.store(SPEC.model_id, toks, kv(2), namespace="legal-kb")
        hs = agent.engine.hashes(SPEC, toks)
        entered, release = threading.Event(), threading.Event()
        write_many = DiskTier.write_many

        def slow_write_many(self, items):
            entered.set()
            release.wait(5)
            return write_many(self, items)

        monkeypatch.setattr(DiskTier, "write_many", slow_write_many)
        if how == "move":
            agent.mover.submit(hs, Tier.DISK, kind="move", op_id="demote-1")
            t = threading.Thread(target=agent.mover.run_once, args=(1.0,))
        else:
            agent.engine.store(SPEC.model_id, tokens(2, start=500), kv(2, seed=1))  # the CPU tier is full
            t = threading.Thread(target=agent.engine.store, args=(SPEC.model_id, tokens(2, start=900), kv(2, seed=2)))
        t.start()
        assert entered.wait(5)
        pin = agent_pb2.Command(
            op_id="pin-1", kind=agent_pb2.COMMAND_KIND_PIN, pin_id="keep", namespace="legal-kb", tier=int(Tier.CPU)
        )
        agent.link.handle_command(1, pin)
        release.set()
        t.join(10)
        monkeypatch.setattr(DiskTier, "write_many", write_many)
        while agent.mover.run_once(0.2):
            pass
        assert [agent.pool.tier_of(h) for h in hs] == [Tier.CPU, Tier.CPU]
        check_invariants(agent.pool)
    finally:
        agent.stop()  # closes its disk tier and frees its transfer engine


def test_a_namespace_that_could_not_reach_the_disk_is_refused_at_store_and_the_longest_names_fit(tmp_path):
    """A namespace is written into each block's record on disk: one the control plane
    would refuse (64+ characters, a '/') is INVALID_ARGUMENT at the engine's store, with
    nothing stored, instead of blocks dropped at their first demotion. The longest model
    id and namespace allowed fit a disk block's header."""
    from agent.core.engine_api import KVEngineAPI
    from agent.core.model_spec import MAX_MODEL_ID_BYTES, ModelSpec
    from protos import errors

    pool = make_pool(tmp_path / "a", cpu_blocks=2)
    e = make_engine(pool)
    for bad in ("t" * 64, "a/b", "-lead"):
        with pytest.raises(errors.InvalidArgument, match="namespace"):
            e.store(SPEC.model_id, tokens(2), kv(2), namespace=bad)
    assert not pool.blocks
    with pytest.raises(ValueError, match="model_id"):
        ModelSpec("m" * (MAX_MODEL_ID_BYTES + 1), 4, 2, 2, 8)
    big = ModelSpec("m" * MAX_MODEL_ID_BYTES, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    cpu = MemoryTier(Tier.CPU, 2 * BLOCK_BYTES, BLOCK_BYTES, device="cpu")
    pool = BlockPool([cpu, DiskTier(tmp_path / "b", 1 << 20)], [big])
    e = KVEngineAPI(pool, [big])
    ns = "n" * 63
    e.store(big.model_id, tokens(2), kv(2, spec=big), namespace=ns)
    e.store(big.model_id, tokens(2, start=500), kv(2, seed=1, spec=big))  # pushes the first two to disk
    hs = e.hashes(big, tokens(2))
    assert [pool.tier_of(h) for h in hs] == [Tier.DISK, Tier.DISK]
    assert e.load(big.model_id, tokens(2)).num_cached_tokens == 8


def test_a_move_of_more_than_its_tier_holds_says_how_many_did_not_stay(tmp_path, monkeypatch):
    """Moving 12 blocks into a CPU tier of 4, 4 at a time: each batch makes room by
    demoting what is least recently used, which was what the earlier batches brought in.
    The move reports the blocks that stayed as done and the rest as failed, saying why,
    not 12 of 12 done; and its done count never goes down (it reported 8 done, then 4 at
    the end: a review): what a move brought in stays while it runs, the rest find no room."""
    import agent.core.mover as mover_module
    from agent.core.mover import Mover

    monkeypatch.setattr(mover_module, "BATCH_BLOCKS", 4)
    pool = make_pool(tmp_path, cpu_blocks=4, disk_bytes=4 << 20)
    e = make_engine(pool)
    toks = tokens(12)
    e.store(SPEC.model_id, toks, kv(12))
    hs = hashes(e, toks)
    assert sum(pool.tier_of(h) is Tier.DISK for h in hs) == 8
    real = pool.move_blocks
    monkeypatch.setattr(pool, "move_blocks", lambda *a, **k: time.sleep(0.21) or real(*a, **k))
    mover = Mover(pool)
    seen: list[int] = []
    mover.on_update = lambda op: seen.append(op.num_done_blocks)
    op = mover.submit(hs, Tier.CPU, kind="move", op_id="m1")
    mover.run_once(1.0)
    in_cpu = sum(pool.tier_of(h) is Tier.CPU for h in hs)
    assert op.num_done_blocks == in_cpu == 4 and op.num_failed_blocks == 8, (
        op.num_done_blocks,
        op.num_failed_blocks,
        in_cpu,
    )
    assert [pool.tier_of(h) for h in hs[:4]] == [Tier.CPU] * 4  # the first batch stayed
    assert "cannot hold them all" in op.error, op.error
    assert len(seen) > 2 and seen == sorted(seen), seen  # progress went out while it ran, never down
    assert sum(m.ref_count for m in pool.blocks.values()) == 0  # let go of at the end
    check_invariants(pool)
