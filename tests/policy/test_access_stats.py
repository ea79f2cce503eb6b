"""AccessStats keeps its per-block history out of the cyclic garbage collector's sight.

A full collection walks every object the collector tracks and stops every thread while
it does, lookups included. The lookup history grows to millions of blocks on a busy
leader, so it must not add a tracked object per block (each would also count towards
the growth that starts the next full collection)."""

from __future__ import annotations

import gc

from controlplane.core.access_stats import AccessStats


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_recording_lookups_adds_no_tracked_object_per_block():
    stats = AccessStats(max_tracked_blocks=4096)
    chains = [[_h(c * 128 + i) for i in range(128)] for c in range(64)]  # 8192 blocks, made before counting
    before = _tracked()
    for c, chain in enumerate(chains):
        stats.record_lookup(chain, float(c))
    for c, chain in enumerate(chains[-16:]):  # named again: updated in place
        stats.record_lookup(chain, 100.0 + c)
    grown = _tracked() - before
    assert len(stats) == 4096
    assert grown < 64, f"{grown} more objects tracked by the garbage collector for 4096 blocks"


def test_history_read_back_and_forgotten_oldest_first():
    stats = AccessStats(max_tracked_blocks=3)
    stats.record_lookup([_h(1), _h(2)], 10.0)
    stats.record_lookup([_h(1)], 12.0)
    first = stats.get(_h(1))
    assert first is not None
    assert (first.first_seen_seconds, first.last_access_seconds, first.num_lookups, first.last_lookup) == (
        10.0,
        12.0,
        2,
        2,
    )
    assert first.num_reuses == 1 and first.block_hash == _h(1)
    stats.record_lookup([_h(1)], 11.0)  # an earlier clock reading does not move the last access back
    again = stats.get(_h(1))
    assert again is not None and again.last_access_seconds == 12.0 and again.num_lookups == 3
    stats.record_lookup([_h(3), _h(4)], 13.0)  # over the cap: 2, the least recently named, goes
    assert stats.get(_h(2)) is None and len(stats) == 3
    stats.record_lookup([_h(5)], 14.0)  # its slot is taken again, with a fresh history
    fresh = stats.get(_h(5))
    assert fresh is not None and (fresh.first_seen_seconds, fresh.num_lookups, fresh.block_hash) == (14.0, 1, _h(5))
    assert stats.get(_h(1)) is None  # 1 was the oldest now
