"""Memory tiers: one preallocated slab of fixed-size slots, in host memory (CPU tier,
pinned when CUDA is present so copies to the GPU are DMA) or in CUDA memory (GPU tier).
A slot holds one block's bytes; the slab is allocated once, never a tensor per block."""

from __future__ import annotations

import torch

from protos.tier import Tier


def cuda_available() -> bool:
    return torch.cuda.is_available()


class MemoryTier:
    def __init__(self, tier: Tier, capacity_bytes: int, slot_bytes: int, device: str | None = None):
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        if capacity_bytes < slot_bytes:
            raise ValueError(f"{tier.label} capacity {capacity_bytes} B is smaller than one block ({slot_bytes} B)")
        self.tier = tier
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        if device is None:
            device = "cuda" if tier == Tier.GPU else "cpu"
        pin = device == "cpu" and cuda_available()
        self.slab = torch.empty((self.num_slots, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin)
        self._free = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, data: torch.Tensor) -> None:
        """`data`: a flat uint8 tensor of at most slot_bytes."""
        self.slab[slot, : data.numel()].copy_(data, non_blocking=False)

    def read(self, slot: int, num_bytes: int) -> torch.Tensor:
        return self.slab[slot, :num_bytes].clone()
