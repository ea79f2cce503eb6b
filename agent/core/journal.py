"""Block events waiting to go to the control plane, batched and sequence-numbered.

Each drained batch takes the next sequence number. A full inventory supersedes every
pending event (`reset`), so while the control plane is away the journal only needs to
remember that an inventory is due; it is capped instead of growing without bound.
The owner (BlockPool) calls everything under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.tier import Tier

STORED = 1
REMOVED = 2


@dataclass
class EventGroup:
    model_id: str
    tier: Tier
    block_hashes: bytearray = field(default_factory=bytearray)
    parent_hashes: bytearray = field(default_factory=bytearray)
    num_blocks: int = 0


@dataclass
class EventBatch:
    seq: int
    kind: int  # STORED or REMOVED
    groups: list[EventGroup]

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)


class EventJournal:
    def __init__(self, max_pending: int = 200_000):
        self.max_pending = max_pending
        self.last_seq = 0
        # one more each inventory: a stream drains events only while the latest inventory
        # is its own (one replaced by a new stream, its call dead, took them into the void)
        self.generation = 0
        self.overflowed = False
        self._pending: list[tuple[int, str, Tier, bytes, bytes]] = []
        self.wake = threading.Event()
        # block hash -> the tier another holder of this agent's blocks has it in, or None
        # (agent.core.vllm_events.ExternalBlocks: an engine's blocks indexed by tokens)
        self.other_tier: Callable[[bytes], Tier | None] | None = None

    def record(
        self, kind: int, model_id: str, tier: Tier, block_hash: bytes, parent_hash: bytes, merged: bool = False
    ) -> None:
        """`merged`: the caller already accounted for `other_tier` (an engine's own events)."""
        if not merged and self.other_tier is not None:
            # the same block may also be held by the engine (its KV events, indexed by
            # tokens): the agent holds it while either does, in the faster of the two
            other = self.other_tier(block_hash)
            if other is not None:
                kind, tier = STORED, other if kind == REMOVED else min(tier, other)
        if len(self._pending) >= self.max_pending:
            # drop them, and skip a sequence number so the control plane sees the gap
            # and asks for an inventory, which carries the state
            self._pending.clear()
            self.overflowed = True
            self.last_seq += 1
        self._pending.append((kind, model_id, tier, block_hash, parent_hash))
        if not self.wake.is_set():  # set() takes a lock and notifies: once per drain is enough
            self.wake.set()

    def reset(self) -> int:
        """Drop pending events (an inventory is being taken); returns its seq."""
        self._pending.clear()
        self.overflowed = False
        self.generation += 1
        return self.last_seq

    def drain(self, max_blocks: int = 8192, generation: int | None = None) -> list[EventBatch]:
        """Pending events as batches: one batch per run of one kind, groups per run of
        (model, tier), so the order of events on one block is kept. `generation`: the
        one of the caller's inventory; none when a later inventory was taken since."""
        if generation is not None and generation != self.generation:
            return []
        taken, self._pending = self._pending[:max_blocks], self._pending[max_blocks:]
        if not self._pending:
            self.wake.clear()
        batches: list[EventBatch] = []
        for kind, model_id, tier, h, parent in taken:
            if not batches or batches[-1].kind != kind:
                self.last_seq += 1
                batches.append(EventBatch(self.last_seq, kind, []))
            groups = batches[-1].groups
            if not groups or groups[-1].model_id != model_id or groups[-1].tier != tier:
                groups.append(EventGroup(model_id, tier))
            g = groups[-1]
            g.block_hashes += h
            g.parent_hashes += parent
            g.num_blocks += 1
        return batches

    @property
    def num_pending(self) -> int:
        return len(self._pending)
