"""Memory tiers: one preallocated slab of fixed-size pages, in host memory (CPU tier,
pinned when CUDA is present so copies to the GPU are DMA) or in CUDA memory (GPU tier).

A block takes ceil(stored_bytes / page_bytes) pages, so a compressed block takes fewer
pages than a raw one; the slab is allocated once, never a tensor per block. A handle is
the block's list of page indices. Freed pages go back so that the next allocation gets
them in ascending order again: most blocks sit in one contiguous run of pages, and
copies are a few large memcpys instead of a gather.

With `shared`, a CPU slab lives in a memfd (agent.store.shm) that a peer agent on the same
host can map for same-host handoff; with CUDA that memory is pinned in place
(cudaHostRegister), so the slab is both shared and DMA-able. Where either fails the slab
is private (pinned with CUDA) and `shared_slab` is None.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch

from agent.store.shm import SharedSlab
from protos.tier import Tier

log = logging.getLogger(__name__)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def gpu_memory_bytes(device: str) -> dict[str, int]:
    """A GPU's memory: `free` and `total` as the driver sees the device (every process's
    use counts against free: an engine's KV cache, other agents), `reserved` and
    `allocated` by this process's torch caching allocator (the GPU tier's slab is
    allocated; transient codec buffers come and go; reserved minus allocated is cached)."""
    free, total = torch.cuda.mem_get_info(device)
    return {
        "free": int(free),
        "total": int(total),
        "reserved": int(torch.cuda.memory_reserved(device)),
        "allocated": int(torch.cuda.memory_allocated(device)),
    }


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call we handled: torch checks it
    after its own calls and would raise it there (torch binds no cudaGetLastError)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _pin_in_place(t: torch.Tensor) -> str:
    """Page-lock a host tensor's memory for DMA (cudaHostRegister); '' or why it failed.
    Unregistered when the tensor goes, before its mapping can (views that outlive it copy
    as pageable memory): a later mapping at the same addresses would not register."""
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    # torch.cuda.CudaError is a RuntimeError; a torch without CUDA raises AssertionError
    except (RuntimeError, AttributeError, AssertionError) as exc:
        _clear_cuda_error()
        return str(exc) or type(exc).__name__
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return ""


def runs(pages: list[int]) -> list[tuple[int, int]]:
    """[3,4,5,9,10] -> [(3,6), (9,11)]: contiguous page runs as half-open ranges."""
    out: list[tuple[int, int]] = []
    for p in pages:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _one_run(pages: list[int]) -> bool:
    """Whether the pages are one ascending run. A free list hands out pages in the order
    blocks gave them back, so first and last a run apart say nothing of those between
    ([0, 1, 5, 2, 4] is not 0..4)."""
    first, last = pages[0], pages[-1]
    return last - first == len(pages) - 1 and pages == list(range(first, last + 1))


def paged_bytes(num_bytes: int, page_bytes: int) -> int:
    """What a block of `num_bytes` takes in a slab of `page_bytes` pages: whole pages, one
    at least (a compressed block's payload may end inside its last)."""
    return max(1, -(-num_bytes // page_bytes)) * page_bytes


class MemoryTier:
    def __init__(
        self, tier: Tier, capacity_bytes: int, page_bytes: int, device: str | None = None, shared: bool = False
    ):
        if page_bytes <= 0:
            raise ValueError("page_bytes must be positive")
        if capacity_bytes < page_bytes:
            raise ValueError(f"{tier.label} capacity {capacity_bytes} B is smaller than one page ({page_bytes} B)")
        self.tier = tier
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if tier == Tier.GPU else "cpu"
        self.device = device
        pin = device == "cpu" and cuda_available()
        self.shared_slab: SharedSlab | None = None
        if shared and device == "cpu":
            try:
                self.shared_slab = SharedSlab(self.num_pages * page_bytes, f"{tier.label}-slab")
            except OSError as exc:
                log.warning("the %s slab is private (no same-host shared memory): %s", tier.label, exc)
            slab = self.shared_slab
            why = _pin_in_place(slab.tensor) if slab is not None and pin else ""
            if why and slab is not None:
                log.warning("the %s slab is private: its shared memory could not be pinned (%s)", tier.label, why)
                slab.close()
                self.shared_slab = None
        if self.shared_slab is not None:
            self.slab = self.shared_slab.tensor
        else:
            # never torch.empty(pin_memory=True): the caching host allocator rounds a pinned
            # request up to a power of two (a 65 GiB slab would lock 128 GiB)
            self.slab = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=device)
            why = _pin_in_place(self.slab) if pin else ""
            if why:
                log.warning("the %s slab is not pinned (copies to the GPU are synchronous): %s", tier.label, why)
        self._base = self.slab.data_ptr()
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: pops ascend

    def close(self) -> None:
        if self.shared_slab is not None:
            self.shared_slab.close()

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    def footprint(self, num_bytes: int) -> int:
        return paged_bytes(num_bytes, self.page_bytes)

    def allocate(self, num_bytes: int, block_hash: bytes = b""):
        n = max(1, -(-num_bytes // self.page_bytes))
        if n > len(self._free):
            return None
        taken = self._free[-n:]  # the stack's top n, popped in one go (last first)
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, handle) -> None:
        self._free.extend(reversed(handle))

    def views(self, handle, num_bytes: int) -> list[torch.Tensor]:
        """The slab segments holding the first `num_bytes` of a block, in order (no copy)."""
        pb = self.page_bytes
        first = handle[0]
        if _one_run(handle):  # the common case: no run splitting
            return [self.slab[first * pb : first * pb + min(num_bytes, len(handle) * pb)]]
        out, left = [], num_bytes
        for start, end in runs(handle):
            if left <= 0:
                break
            n = min(left, (end - start) * pb)
            out.append(self.slab[start * pb : start * pb + n])
            left -= n
        return out

    def byte_runs(self, handle, num_bytes: int) -> list[tuple[int, int]]:
        """(address, length) of the slab runs holding the first `num_bytes` of a block, in
        order: what `views` covers, by arithmetic (no tensors; a handoff asks per block)."""
        pb, base = self.page_bytes, self._base
        first = handle[0]
        if _one_run(handle):
            return [(base + first * pb, min(num_bytes, len(handle) * pb))]
        out, left = [], num_bytes
        for start, end in runs(handle):
            if left <= 0:
                break
            n = min(left, (end - start) * pb)
            out.append((base + start * pb, n))
            left -= n
        return out

    def write(self, handle, data, meta=None) -> None:
        """`data`: a flat uint8 tensor that fits the handle's pages."""
        self.write_many([(handle, data, meta)])

    def write_many(self, items: list[tuple[object, torch.Tensor, object]]) -> list[None]:
        """write() of several blocks, [(handle, data, meta)]: every copy queued, then one
        synchronize if a GPU took part (each block is readable, and its source reusable,
        once this returns). A memory write has no per-block failure: [None] each."""
        devices = {torch.device(self.device)} if torch.device(self.device).type == "cuda" else set()
        for handle, data, _ in items:
            data = data.reshape(-1)
            offset = 0
            for seg in self.views(handle, data.numel()):
                seg.copy_(data[offset : offset + seg.numel()], non_blocking=True)
                offset += seg.numel()
            if data.device.type == "cuda":
                devices.add(data.device)
        for dev in devices:
            torch.cuda.synchronize(dev)
        return [None] * len(items)

    def read(self, handle, num_bytes: int) -> torch.Tensor:
        """A CPU copy of the first `num_bytes` stored under `handle`."""
        segs = self.views(handle, num_bytes)
        if len(segs) == 1:
            return segs[0].to("cpu", copy=True)
        out = torch.empty(sum(seg.numel() for seg in segs), dtype=torch.uint8)  # no GPU temporary (torch.cat)
        at = 0
        for seg in segs:
            out[at : at + seg.numel()].copy_(seg)
            at += seg.numel()
        return out
