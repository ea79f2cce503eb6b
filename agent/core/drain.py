"""What a drained agent hands off, in which order, and to whom (agent.drain_run runs it:
`kvctl drain`, before a rolling upgrade takes the agent down).

A prefix is a chain of blocks from a root (a block whose parent is not held here) to a
leaf (a block no block held here names as its parent); one handoff carries it, and the
blocks it shares with a chain sent before are found present at the destination and not
sent again. Chains holding a pinned block go first, then the most recently used (by their
leaf's last access), so a drain cut short (no room left, a cancel) has moved what serves most. The chains of one root go
to one destination, so a shared prefix (a system prompt) travels once; roots are dealt to
the destinations in turn, the roomiest first, and a chain whose destination is full or
failing goes to the next one with room. A destination is sent at most the bytes it had
free: a drain fills free space and pushes out none of the destination's own blocks. Nor
more than it has free when each chain arrives: the handoffs Route sends it meanwhile take
room too, and it refuses the drain's blocks past the line where its tier policy would drop
blocks. Such a destination is full (sent nothing more) until the drain reopens it: the
chains that found every destination that could take them full wait, and are tried again
(agent.drain_run backs off between tries, for a bounded time) as room frees there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agent.core.blocks import BlockMeta

# a destination that failed this many chains in a row (each after the handoff's own
# retries and fallback path) is given up for the rest of the drain
MAX_FAILED_CHAINS_IN_A_ROW = 3


@dataclass(frozen=True)
class DrainChain:
    model_id: str
    block_hashes: tuple[bytes, ...]  # root first
    stored_bytes: tuple[int, ...]  # each block's, as stored here (what a handoff sends)
    last_access: int  # the leaf's (the pool's access clock)
    pinned: bool = False  # holds a pinned block: goes first


def drain_chains(
    blocks: Iterable[BlockMeta], model_id: str = "", pinned: frozenset[bytes] = frozenset()
) -> list[DrainChain]:
    """The chains of the visible blocks (of `model_id`, or every model): those holding a
    pinned block first (an operator said they matter), then most recently used first.
    Every visible block is in at least one chain (but blocks on a cycle of parents, which
    chained digests never make)."""
    held = {m.block_hash: m for m in blocks if m.visible and (not model_id or m.model_id == model_id)}
    parents = {m.parent_hash for m in held.values()}
    chains = []
    for leaf in held.values():
        if leaf.block_hash in parents:
            continue
        chain, seen = [leaf], {leaf.block_hash}
        while (parent := held.get(chain[-1].parent_hash)) is not None and parent.block_hash not in seen:
            chain.append(parent)  # (a parent cycle, which digests never make, ends the walk)
            seen.add(parent.block_hash)
        chain.reverse()
        chains.append(
            DrainChain(
                leaf.model_id,
                tuple(m.block_hash for m in chain),
                tuple(m.stored_bytes for m in chain),
                leaf.last_access,
                any(m.block_hash in pinned for m in chain),
            )
        )
    chains.sort(key=lambda c: (not c.pinned, -c.last_access, c.block_hashes))
    return chains


def _as_is(destination: str, num_bytes: int) -> int:
    return num_bytes


@dataclass
class DrainPlan:
    """Where each chain goes, and what each destination has taken so far. `destinations`
    come roomiest first, with the bytes each had free; `serves`: the models each one
    serves, where known (a destination left out is tried with every model); `footprint`:
    what a block of so many stored bytes takes at a destination (whole pages of its slab,
    each its own size: a compressed block's payload may end inside its last page), which
    is what that destination is charged.

    A chain's cost at a destination is what that destination was not sent yet: a chain
    that follows its root elsewhere (the root's destination full or failing) carries its
    shared prefix again, and that counts against the second destination's room."""

    destinations: Sequence[str]
    free_bytes: Sequence[int]
    serves: dict[str, frozenset[str]] = field(default_factory=dict)
    footprint: Callable[[str, int], int] = _as_is  # (destination, stored bytes) -> bytes taken there
    sent_bytes: dict[str, int] = field(default_factory=dict)
    given_up: dict[str, str] = field(default_factory=dict)  # destination -> why
    _failed_in_a_row: dict[str, int] = field(default_factory=dict)
    _by_root: dict[bytes, str] = field(default_factory=dict)
    _sent: dict[str, set[bytes]] = field(default_factory=dict)  # destination -> blocks it was sent
    _next: int = 0
    _refused: set[str] = field(default_factory=set)  # full past their drop line, until reopen()

    def __post_init__(self) -> None:
        self._free = dict(zip(self.destinations, self.free_bytes, strict=False))

    def takes(self, destination: str, model_id: str) -> bool:
        known = self.serves.get(destination)
        return known is None or model_id in known

    def need(self, destination: str, chain: DrainChain) -> int:
        """What the blocks of `chain` a handoff to `destination` sends take there: those
        it was not sent yet."""
        sent = self._sent.get(destination, set())
        return sum(
            self.footprint(destination, n)
            for h, n in zip(chain.block_hashes, chain.stored_bytes, strict=True)
            if h not in sent
        )

    def landed(self, destination: str, chain: DrainChain, num_present: int, num_blocks: int) -> int:
        """What a handoff of `chain` to `destination` that found its first `num_present`
        blocks there and sent those up to `num_blocks` takes there (took's `sent_bytes`)."""
        return sum(self.footprint(destination, n) for n in chain.stored_bytes[num_present:num_blocks])

    def order(self, chain: DrainChain) -> list[str]:
        """The destinations to try for a chain: its root's first (dealt in turn, among
        those serving its model, on the root's first chain), then the others serving it,
        each only while it has room for what the chain would send it and is not given up."""
        serving = [d for d in self.destinations if self.takes(d, chain.model_id)]
        first = self._by_root.get(chain.block_hashes[0])
        if first is None and serving:
            first = serving[self._next % len(serving)]
            self._next += 1
            self._by_root[chain.block_hashes[0]] = first
        ordered = [first] + [d for d in serving if d != first] if first else []
        return [d for d in ordered if d not in self.given_up and self.room(d) >= self.need(d, chain)]

    def room(self, destination: str) -> int:
        """What `destination` may be sent yet: none while it is full, else what it had free
        less what it was sent."""
        return 0 if destination in self._refused else self._budget(destination)

    def _budget(self, destination: str) -> int:
        return self._free.get(destination, 0) - self.sent_bytes.get(destination, 0)

    def took(self, destination: str, chain: DrainChain, sent_bytes: int, num_blocks: int | None = None) -> None:
        """`destination` holds the chain's first `num_blocks` (all of it: None) now."""
        self._by_root[chain.block_hashes[0]] = destination  # its siblings follow it there
        self.sent_bytes[destination] = self.sent_bytes.get(destination, 0) + sent_bytes
        self._sent.setdefault(destination, set()).update(chain.block_hashes[:num_blocks])
        self._failed_in_a_row[destination] = 0

    def full(self, destination: str) -> None:
        """`destination` refused a chain past its drop line: other handoffs took the room it
        had left (what it had free when the drain began overstates it now, by how much only
        it knows). It is sent nothing more until `reopen`."""
        self._refused.add(destination)

    @property
    def full_destinations(self) -> list[str]:
        """Those full (refused past their line) and not given up, in the plan's order."""
        return [d for d in self.destinations if d in self._refused and d not in self.given_up]

    def waits_for_room(self, chain: DrainChain) -> bool:
        """Might `chain` go once room frees? A destination serving its model is full, and
        what it had free less what it was sent would still take the chain."""
        return any(
            self.takes(d, chain.model_id) and self._budget(d) >= self.need(d, chain) for d in self.full_destinations
        )

    def reopen(self) -> list[str]:
        """Try the full destinations again (room may have freed there), each up to what it
        had free less what it was sent, as before it refused: that is the room the control
        plane holds for this drain there, and no more; the destination's next Reserve says
        whether the chain fits as its tiers stand then (a refusal costs that round trip,
        nothing is written). Returns those reopened."""
        reopened = self.full_destinations
        self._refused.clear()
        return reopened

    def failed(self, destination: str, reason: str, permanent: bool = False) -> None:
        n = self._failed_in_a_row[destination] = self._failed_in_a_row.get(destination, 0) + 1
        if permanent or n >= MAX_FAILED_CHAINS_IN_A_ROW:
            self.given_up[destination] = reason

    @property
    def exhausted(self) -> bool:
        """No destination is left to try now (each given up, out of room, or full)."""
        return all(d in self.given_up or self.room(d) <= 0 for d in self.destinations)
