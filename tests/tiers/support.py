"""Shared pieces of the tier tests: a small fp16 model, a pool over a real CPU slab and
a real disk directory, and the pool's invariants checked against both stores."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from agent.core import codecs
from agent.core.block_pool import BlockPool
from agent.core.engine_api import KVEngineAPI
from agent.core.model_spec import ModelSpec
from agent.core.mover import Mover
from agent.store.disk_tier import GRANULE_BYTES, DiskHandle, DiskTier
from agent.store.memory_tier import MemoryTier
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier

SPEC = ModelSpec("tiny", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")
BS = SPEC.block_size
BLOCK_BYTES = SPEC.block_bytes  # 512


def kv(num_blocks: int, seed: int = 0, spec: ModelSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *spec.block_shape), generator=g).to(spec.torch_dtype)


def tokens(num_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_blocks * BS))


def make_pool(
    disk_dir: Path | str,
    cpu_blocks: int = 2,
    disk_bytes: int = 1 << 20,
    tier_codecs: dict[Tier, str] | None = None,
    page_bytes: int = BLOCK_BYTES // 16,  # as an agent pages a tier: 1/16 of a block
) -> BlockPool:
    """A CPU slab of `cpu_blocks` raw blocks over a disk tier in `disk_dir`."""
    cpu = MemoryTier(Tier.CPU, cpu_blocks * BLOCK_BYTES, page_bytes, device="cpu")
    return BlockPool([cpu, DiskTier(disk_dir, disk_bytes)], [SPEC], tier_codecs=tier_codecs)


def make_engine(pool: BlockPool, with_mover: bool = False) -> KVEngineAPI:
    return KVEngineAPI(pool, [SPEC], Mover(pool) if with_mover else None)


def hashes(engine: KVEngineAPI, token_ids: list[int]) -> list[bytes]:
    return engine.hashes(SPEC, token_ids)


def disk_of(pool: BlockPool) -> DiskTier:
    return pool.store_of[Tier.DISK]


@dataclass(frozen=True)
class BlockOnDisk:
    """Where a disk block's bytes are in the slab file."""

    path: Path
    offset: int  # its header (the magic)
    payload_offset: int
    payload_bytes: int

    @property
    def last_payload_byte(self) -> int:
        return self.payload_offset + self.payload_bytes - 1


def block_on_disk(pool: BlockPool, block_hash: bytes) -> BlockOnDisk:
    meta = pool.blocks[block_hash]
    assert meta.tier is Tier.DISK, f"block is in the {meta.tier.label} tier"
    path, payload_offset, _ = disk_of(pool).location(meta.handle)
    return BlockOnDisk(path, meta.handle.offset, payload_offset, meta.stored_bytes)


def blocks_on_disk(disk: DiskTier) -> list[int]:
    """Offsets of the blocks whose headers verify in the slab (what a restart would find
    before checking payloads)."""
    return [offset for offset, header in disk.headers() if header is not None]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def decoded(pool: BlockPool, block_hash: bytes) -> torch.Tensor:
    """A held block's decoded tensor straight from its tier (no touch, no reference)."""
    meta = pool.blocks[block_hash]
    spec = pool.models[meta.model_id]
    raw = pool.store_of[meta.tier].read(meta.handle, meta.stored_bytes)
    return codecs.decode(meta.codec, raw, spec.block_shape, spec.torch_dtype)


def check_pool(pool: BlockPool) -> None:
    """The pool's invariants, against what its memory and disk stores really hold."""
    if Tier.DISK in pool.store_of:
        disk_of(pool).drain()  # freed extents cleared and back in the allocator
    with pool.lock:
        blocks = dict(pool.blocks)
        for h, meta in blocks.items():
            assert meta.block_hash == h
            assert meta.parent_hash == ROOT_PARENT_HASH or meta.parent_hash in blocks, "a held block lost its parent"
            assert meta.num_children == sum(1 for m in blocks.values() if m.parent_hash == h and m.ready)
            assert meta.ready and meta.ref_count == 0 and not meta.moving and not meta.corrupt
            entry = (meta.last_access, h)
            # in the order, or set aside while a pin keeps it where it is (until the next
            # victim search, after a pin changed)
            aside = entry in pool._pinned_aside[meta.tier]
            current = pool._pinned_aside_key == pool._pins_key()
            assert entry in pool._lru[meta.tier] or (aside and (not current or pool.pin_tier(meta))), (
                "a block is missing from its tier's eviction order"
            )
        usage = {u.tier: u for u in pool.usage()}
        for store in pool.tiers:
            metas = [m for m in blocks.values() if m.tier == store.tier]
            u = usage[store.tier]
            assert u.num_blocks == len(metas)
            assert u.uncompressed_bytes == sum(m.num_bytes for m in metas)
            assert u.stored_bytes == sum(m.stored_bytes for m in metas)
            assert u.saved_bytes == sum(store.footprint(m.num_bytes) - store.footprint(m.stored_bytes) for m in metas)
            assert u.used_bytes <= u.capacity_bytes
            # what the blocks themselves take: every held block's pages or extent, exactly
            assert u.blocks_used_bytes == sum(store.footprint(m.stored_bytes) for m in metas)
            if isinstance(store, MemoryTier):
                used: list[int] = []
                for m in metas:
                    pages = m.handle.tolist() if torch.is_tensor(m.handle) else list(m.handle)
                    assert len(pages) == max(1, -(-m.stored_bytes // store.page_bytes))
                    used += pages
                free = list(store._free)
                assert len(set(used)) == len(used), "a page is allocated twice"
                assert not set(used) & set(free), "a page is both held and free"
                assert sorted(used + free) == list(range(store.num_pages)), "a page leaked"
            else:
                assert all(isinstance(m.handle, DiskHandle) for m in metas)
                # recovered blocks parked until their prefix is stored again hold their extents too
                parked = [m for waiting in pool._parked.values() for m in waiting if m.tier == store.tier]
                assert not {m.block_hash for m in parked} & set(blocks), "a block both parked and held"
                metas = metas + parked
                extents = sorted((m.handle.offset, m.handle.offset + m.handle.footprint_bytes) for m in metas)
                assert all(a[1] <= b[0] for a, b in zip(extents, extents[1:], strict=False)), (
                    "two blocks share an extent"
                )
                assert all(end <= store.slab_bytes for _, end in extents)
                assert store.used_bytes == sum(m.handle.footprint_bytes for m in metas)
                assert u.blocks_used_bytes == sum(m.handle.footprint_bytes for m in metas if m not in parked)
                free = store._extents.free_granules * GRANULE_BYTES
                assert free + store.used_bytes == store.slab_bytes, "slab space leaked"
    if Tier.DISK in pool.store_of:
        disk = disk_of(pool)
        with pool.lock:
            on_disk = set(blocks_on_disk(disk))
            held = {m.handle.offset for m in pool.blocks.values() if m.tier is Tier.DISK}
            held |= {m.handle.offset for waiting in pool._parked.values() for m in waiting if m.tier is Tier.DISK}
        assert on_disk == held, "blocks in the slab differ from the disk blocks held"


# ---- what each lossy codec promises --------------------------------------------------
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
FP16_TINY = 2.0**-25  # half the spacing of fp16 subnormals


def fp16_err(v: torch.Tensor) -> torch.Tensor:
    """How far rounding `v` to fp16 may move it (scales and minimums are stored as fp16;
    a scale below 2^-14 is subnormal there and keeps only an absolute precision)."""
    return torch.maximum(v.abs() * 2.0**-11, torch.tensor(FP16_TINY))


def out_err(x: torch.Tensor) -> torch.Tensor:
    """How far rounding the decoded value back to x's dtype may move it."""
    tiny = FP16_TINY if x.dtype == torch.float16 else 0.0
    return torch.maximum(x.float().abs() * HALF_ULP[x.dtype], torch.tensor(tiny))


def block(shape, dtype, seed: int = 0, magnitude: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * magnitude).to(dtype)


def roundtrip(codec: str, x: torch.Tensor) -> torch.Tensor:
    payload = codecs.encode(codec, x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    y = codecs.decode(codec, payload, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype
    return y


def int8_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element: half the scale of its (layer, k/v, token, head) row, the scale
    being amax / 127 as the fp16 it is stored as (and quantized with: at most one fp16
    step above), plus the output dtype's rounding."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    return (scale + fp16_err(scale)) / 2 + out_err(x) + 1e-7


def int4_group_len(n: int) -> int:
    """The codec's grouping: at most 128 per group, split evenly (130 -> 2 x 65)."""
    g_count = max(1, math.ceil(n / codecs.INT4_GROUP))
    return math.ceil(n / g_count)


def int4_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element: half its group's scale, (max - min) / 15, plus the fp16 rounding of
    the stored scale (times 15 steps) and minimum, plus the output dtype's rounding.
    Keys group along tokens (per channel), values along head_dim (per token)."""
    xf = x.float()
    bound = torch.empty_like(xf)
    for kv, axis in ((0, 1), (1, 3)):  # axis within x[:, kv] = [L, T, H, D]
        part = xf[:, kv]
        n = part.shape[axis]
        g = int4_group_len(n)
        for start in range(0, n, g):
            sl = part.narrow(axis, start, min(g, n - start))
            lo, hi = sl.amin(dim=axis, keepdim=True), sl.amax(dim=axis, keepdim=True)
            scale = (hi - lo) / 15.0
            b = scale / 2 + 15 * fp16_err(scale) + fp16_err(lo)
            bound[:, kv].narrow(axis, start, sl.shape[axis]).copy_(b.expand_as(sl))
    return bound + out_err(x) + 1e-6


def fp8_bound(x: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: relative error 2^-4 for normal values; below the
    smallest normal (2^-6, in units of the row scale amax / 448, as the fp16 it is
    stored as and quantized with) the spacing is 2^-9."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 448.0
    return xf.abs() * 2.0**-4 + (scale + fp16_err(scale)) * 2.0**-10 + out_err(x) + 1e-7


def error_bound(codec: str, x: torch.Tensor) -> torch.Tensor:
    """Per element of block x: how far the codec's round trip may move it."""
    if codec in ("none", "zstd"):
        return torch.zeros_like(x, dtype=torch.float32)
    return {"int8": int8_bound, "int4": int4_bound, "fp8": fp8_bound}[codec](x)
