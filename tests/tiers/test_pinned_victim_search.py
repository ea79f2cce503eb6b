"""A full tier whose oldest blocks are pinned: the victim search used to pop and push every
pinned entry again for each block that needed room, so one new block cost O(pinned) under
the pool lock (a soak test, 2026-12-07: a namespace pin grown past the CPU tiers took the
demo's workload from 5 requests/s to under 1; here 13 ms a block against 0.08 ms
unpinned). Entries a pin keeps in place are set aside until a pin changes or expires."""

from __future__ import annotations

import time

from agent.core.engine_api import KVEngineAPI
from agent.core.pins import AgentPin
from agent.store.disk_tier import DiskTier
from protos.tier import Tier
from tests.tiers.support import SPEC, hashes, kv, make_pool, tokens

PINNED_PROMPTS = 50  # of 40 blocks: 2,000 pinned blocks, older than everything else
PROMPT = 40


def _full_tier_with_pinned_old_blocks(tmp_path, ttl_seconds: float = 0.0):
    probe = DiskTier(tmp_path / "probe", 1 << 20)
    footprint = probe.footprint(SPEC.block_bytes)
    probe.close()
    pool = make_pool(tmp_path / "d", cpu_blocks=16, disk_bytes=(PINNED_PROMPTS + 5) * PROMPT * footprint)
    engine = KVEngineAPI(pool, [SPEC], None)
    for p in range(PINNED_PROMPTS):
        engine.store(SPEC.model_id, tokens(PROMPT, start=p * 1000), kv(PROMPT, seed=p), namespace="kb")
    expires = time.monotonic() + ttl_seconds if ttl_seconds else 0.0
    with pool.lock:
        pool.pins.add(AgentPin("keep", int(Tier.CPU), expires, "kb"))
    return pool, engine


def _store_unpinned(engine, n_prompts: int, start: int) -> list[bytes]:
    out = []
    for p in range(n_prompts):
        toks = tokens(PROMPT, start=start + p * 1000)
        engine.store(SPEC.model_id, toks, kv(PROMPT, seed=p))
        out += hashes(engine, toks)
    return out


def test_pinned_blocks_are_looked_at_once_not_per_block_stored(tmp_path):
    pool, engine = _full_tier_with_pinned_old_blocks(tmp_path)
    looked, real = [0], pool.pin_tier

    def counted(meta):
        looked[0] += 1
        return real(meta)

    pool.pin_tier = counted
    _store_unpinned(engine, 20, start=10_000_000)  # 800 blocks, most needing a victim on disk
    pinned = PINNED_PROMPTS * PROMPT
    # each pinned entry once (set aside), plus the unpinned ones examined: far from 800 x 2,000
    assert looked[0] < 3 * pinned, f"{looked[0]} pin lookups for 800 blocks stored past {pinned} pinned ones"
    kept = [h for h, m in pool.blocks.items() if m.namespace == "kb"]
    assert len(kept) == pinned, "a pinned block was evicted"


def test_pinned_blocks_set_aside_are_evictable_again_once_unpinned(tmp_path):
    pool, engine = _full_tier_with_pinned_old_blocks(tmp_path)
    _store_unpinned(engine, 5, start=10_000_000)  # the pinned entries go aside
    with pool.lock:
        pool.pins.remove("keep")
    _store_unpinned(engine, 10, start=20_000_000)
    left = sum(1 for m in pool.blocks.values() if m.namespace == "kb")
    assert left < PINNED_PROMPTS * PROMPT, "the oldest blocks stayed after their pin went: still set aside"


def test_pinned_blocks_set_aside_are_evictable_again_once_their_pin_expires(tmp_path):
    pool, engine = _full_tier_with_pinned_old_blocks(tmp_path, ttl_seconds=1.0)
    _store_unpinned(engine, 5, start=10_000_000)
    assert sum(1 for m in pool.blocks.values() if m.namespace == "kb") == PINNED_PROMPTS * PROMPT
    time.sleep(1.1)  # the pin expires: nobody removes it from the table
    _store_unpinned(engine, 10, start=20_000_000)
    left = sum(1 for m in pool.blocks.values() if m.namespace == "kb")
    assert left < PINNED_PROMPTS * PROMPT, "the oldest blocks stayed after their pin expired"
