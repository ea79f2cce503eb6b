"""A disk tier on a file system with less room than --disk-capacity asked (a small
volume, or one other files fill): the tier counts as the size the file system can give,
so stores and demotions find it full and make room there (dropping its coldest blocks)
instead of failing every write with ENOSPC; repeated write failures are said once per
10 s. Real tmpfs mounts (root); skipped where mounting is not allowed."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from agent.store.disk_tier import GRANULE_BYTES
from tests.tiers.support import SPEC, disk_of, hashes, kv, make_engine, make_pool, tokens


@pytest.fixture
def small_fs(request, tmp_path):
    """A tmpfs of 4 MiB (or `@pytest.mark.parametrize("small_fs", [MiB], indirect=True)`)."""
    mount = tmp_path / "small"
    mount.mkdir()
    size = f"size={getattr(request, 'param', 4)}m"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_tier_larger_than_its_file_system_counts_as_what_fits(small_fs: Path, caplog):
    pool = make_pool(small_fs / "disk", cpu_blocks=2, disk_bytes=64 << 20)
    disk = disk_of(pool)
    assert disk.configured_capacity_bytes == 64 << 20
    assert disk.capacity_bytes <= (4 << 20) and disk.capacity_bytes % GRANULE_BYTES == 0
    assert "has room for 2 MiB of the 64 MiB asked" in caplog.text or "has room for 3 MiB" in caplog.text
    engine = make_engine(pool)
    stored = []
    for i in range(24):  # ~3x what the file system holds, in 512-block prompts of 256 KiB
        toks, data = tokens(512, start=i * 100_000), kv(512, seed=i)
        engine.store(SPEC.model_id, toks, data)
        stored.append((toks, data))
    assert disk.write_errors_total == 0  # the tier was full before the file system was
    assert pool.move_failures_total == 0
    # every block still held loads back exactly; the newest prompt is whole
    for toks, data in stored:
        got = engine.load(SPEC.model_id, toks)
        n = got.num_cached_tokens // SPEC.block_size
        assert torch.equal(got.kv[:n], data[:n])
    assert engine.load(SPEC.model_id, stored[-1][0]).num_cached_tokens == len(stored[-1][0])
    pool.close()


def test_space_taken_by_others_after_start_is_found_by_the_first_failed_write(small_fs: Path):
    pool = make_pool(small_fs / "disk", cpu_blocks=2, disk_bytes=3 << 20)
    disk = disk_of(pool)
    assert disk.capacity_bytes == disk.configured_capacity_bytes  # 3 of 4 MiB: it fits, at first
    hog = small_fs / "hog"
    hog.write_bytes(b"\xff" * (3 << 20))  # another program fills the volume
    engine = make_engine(pool)
    for i in range(12):
        engine.store(SPEC.model_id, tokens(256, start=i * 100_000), kv(256, seed=i))
    assert disk.capacity_bytes < disk.configured_capacity_bytes
    assert disk.write_errors_total <= 2 * 256  # the writes of the batch that hit ENOSPC, not every later one
    errors_then = disk.write_errors_total
    for i in range(12, 20):
        engine.store(SPEC.model_id, tokens(256, start=i * 100_000), kv(256, seed=i))
    assert disk.write_errors_total == errors_then  # full, not failing
    os.remove(hog)  # space given back: the tier grows to what was asked again
    disk._fitted_monotonic = time.monotonic() - 10.0
    engine.store(SPEC.model_id, tokens(4, start=9_000_000), kv(4, seed=99))
    assert disk.capacity_bytes == disk.configured_capacity_bytes
    held = [h for h in hashes(engine, tokens(4, start=9_000_000)) if pool.tier_of(h) is not None]
    assert held  # the new blocks were stored
    pool.close()


@pytest.mark.parametrize("small_fs", [16], indirect=True)
def test_fragmented_free_space_does_not_fail_write_after_write(small_fs: Path):
    """Blocks freed above 3/4 full stay in the slab (not punched) for reuse, and count as
    room; bigger blocks cannot use those runs and go into holes, which need the file
    system's blocks: every such write failed with ENOSPC while the tier said it had room
    (a review). After one ENOSPC the free runs are punched and the tier refitted; one soon
    after counts the tier full at what it holds."""
    from agent.core.blocks import BlockMeta
    from agent.store.disk_tier import DiskTier
    from protos.block_hash import ROOT_PARENT_HASH
    from protos.tier import Tier

    disk = DiskTier(small_fs / "d", 64 << 20)
    n = 0

    def put(num_bytes: int) -> str:
        nonlocal n
        n += 1
        h = n.to_bytes(16, "little")
        handle = disk.allocate(num_bytes, h)
        if handle is None:
            return "full"
        meta = BlockMeta(h, ROOT_PARENT_HASH, "m", num_bytes, Tier.DISK, handle, "none", num_bytes)
        err = disk.write_many([(handle, torch.randint(0, 256, (num_bytes,), dtype=torch.uint8), meta)])[0]
        if err is not None:
            disk.free(handle)
            return "ENOSPC"
        small.append(handle)
        return "ok"

    small: list = []
    while put(60_000) == "ok":
        pass
    for handle in small[::5]:  # a fifth freed: still above 3/4 full, nothing punched
        disk.free(handle)
    disk.drain()
    results = [put(200_000) for _ in range(30)]  # bigger blocks: the 60 KB runs do not fit them
    assert results.count("ENOSPC") <= 2, results  # 25 of 30 failed before
    assert disk.write_errors_total <= 2 and "full" in results
    disk.close()


def test_a_first_write_error_for_space_just_after_start_does_not_shrink_the_tier(tmp_path, monkeypatch):
    """One ENOSPC within seconds of the tier's start (its first fit) was taken for a second
    one soon after an ENOSPC: the tier was cut to the bytes the failed batch counted (a
    review). A first one only refits it to its file system."""
    import errno

    from protos.tier import Tier

    pool = make_pool(tmp_path / "disk", cpu_blocks=8)
    engine = make_engine(pool)
    toks = tokens(6)
    engine.store(SPEC.model_id, toks, kv(6))
    disk = disk_of(pool)
    real = os.pwritev

    def full(fd, bufs, offset):
        if fd == disk.fd:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", full)
    pool.move_blocks(hashes(engine, toks), Tier.DISK)
    monkeypatch.setattr(os, "pwritev", real)
    disk.drain()
    assert disk.capacity_bytes == disk.configured_capacity_bytes  # the file system has room
