"""Helpers for the policy tests: hashes, views built from plain dicts, an agent that
applies decide's actions one by one and checks each against the prefix invariants, and
a generator of Mooncake-format traces."""

from __future__ import annotations

import json
import random
from pathlib import Path

from controlplane.core.access_stats import AccessStats
from controlplane.core.policy import AgentView, ClusterView, Demote, Evict, Pins, Promote, TierView
from protos.block_hash import ROOT_PARENT_HASH
from protos.tier import Tier


def h(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def view(
    agents: dict[str, dict[Tier, tuple[int, dict[bytes, bytes]]]],
    stats: AccessStats,
    pins: Pins | None = None,
    turnover_seconds: float | None = None,
) -> ClusterView:
    """agents: {agent_id: {tier: (capacity_blocks, {block: parent})}}"""
    return ClusterView(
        agents=tuple(
            AgentView(a, tuple(TierView(t, cap, dict(blocks)) for t, (cap, blocks) in sorted(tiers.items())))
            for a, tiers in agents.items()
        ),
        stats=stats,
        pins=pins or Pins(),
        turnover_seconds=turnover_seconds,
    )


class FakeAgent:
    """The blocks of one agent by tier; `apply` executes actions in order and asserts
    that each step keeps the prefix invariants and the pins."""

    def __init__(self, av: AgentView, pins: Pins):
        self.agent_id = av.agent_id
        self.capacity = {tv.tier: tv.capacity_blocks for tv in av.tiers}
        self.tier_of: dict[bytes, Tier] = {}
        self.parent: dict[bytes, bytes] = {}
        for tv in av.tiers:
            for b, p in tv.blocks.items():
                self.tier_of[b] = tv.tier
                self.parent[b] = p
        self.pins = pins
        self.evicted: list[bytes] = []
        self.demoted: list[tuple[bytes, Tier, Tier]] = []
        self.shrunk: set[Tier] = set()  # tiers blocks left downwards (demoted or dropped)

    def children(self, b: bytes) -> list[bytes]:
        return [c for c, p in self.parent.items() if p == b and c in self.tier_of]

    def used(self, tier: Tier) -> int:
        return sum(1 for t in self.tier_of.values() if t is tier)

    def apply(self, action) -> None:
        assert action.agent_id == self.agent_id
        if isinstance(action, Evict):
            for b in action.block_hashes:
                assert b in self.tier_of, "evicts a block the agent does not hold"
                assert self.pins.min_tier(b) is None, "evicts a pinned block"
                assert not self.children(b), "evicts a parent before its cached children"
                self.shrunk.add(self.tier_of.pop(b))
                self.evicted.append(b)
        elif isinstance(action, Demote):
            assert action.to_tier > action.from_tier
            for b in action.block_hashes:
                assert self.tier_of.get(b) is action.from_tier
                pin = self.pins.min_tier(b)
                assert pin is None or action.to_tier <= pin, "demotes below a pin's tier"
                for c in self.children(b):
                    assert self.tier_of[c] >= action.to_tier, "demotes a parent past a child"
                self.tier_of[b] = action.to_tier
                self.demoted.append((b, action.from_tier, action.to_tier))
                self.shrunk.add(action.from_tier)
        elif isinstance(action, Promote):
            for b in action.block_hashes:
                assert self.tier_of.get(b, Tier.REMOTE) > action.to_tier
                self.tier_of[b] = action.to_tier
        else:
            raise AssertionError(f"unknown action {action!r}")

    def check_prefix_closed(self) -> None:
        for b in self.tier_of:
            p = self.parent[b]
            assert p == ROOT_PARENT_HASH or p in self.tier_of, "a held block lost its parent"


# ---- traces -------------------------------------------------------------------------------
def write_trace(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def synthetic_trace(
    num_requests: int = 1200,
    num_docs: int = 40,
    doc_blocks: tuple[int, int] = (8, 24),
    zipf_s: float = 1.1,
    one_off_share: float = 0.5,
    session_share: float = 0.15,
    seed: int = 7,
) -> list[dict]:
    """Shared documents with Zipf popularity (each request: a document plus a fresh
    question block), one-off long prompts that are never asked for again, and chat
    sessions whose next turn extends the previous prompt. Block ids are assigned in
    order of first appearance, as in Mooncake traces."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs: list[list[int] | None] = [None] * num_docs
    doc_len = [rng.randint(*doc_blocks) for _ in range(num_docs)]
    weights = [1.0 / (k + 1) ** zipf_s for k in range(num_docs)]
    sessions: list[list[int]] = []
    out = []
    t = 0
    for _ in range(num_requests):
        t += rng.randint(50, 400)
        u = rng.random()
        if u < one_off_share:
            ids = fresh(rng.randint(10, 30))
        elif u < one_off_share + session_share:
            if sessions and rng.random() < 0.7:
                s = rng.randrange(len(sessions))
                ids = sessions[s] + fresh(rng.randint(1, 3))
                sessions[s] = ids
            else:
                ids = fresh(rng.randint(4, 12))
                sessions.append(ids)
        else:
            d = rng.choices(range(num_docs), weights)[0]
            if docs[d] is None:
                docs[d] = fresh(doc_len[d])
            ids = docs[d] + fresh(1)
        input_length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        out.append({"timestamp": t, "input_length": input_length, "output_length": 16, "hash_ids": ids})
    return out


def conversation_trace(num_requests: int = 800, seed: int = 1, new_session_share: float = 0.3) -> list[dict]:
    """Multi-turn chat: each turn re-sends the whole conversation (all but its partial
    last block) plus new blocks; recently active sessions are likelier to continue, and
    a long session's prefix, reused at every turn, dies with it."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = [fresh(4) for _ in range(5)]
    active: list[list[int]] = []
    out = []
    t = 0
    for _ in range(num_requests):
        t += rng.randint(50, 400)
        if not active or rng.random() < new_session_share:
            ids = system[rng.randrange(len(system))] + fresh(rng.randint(3, 10))
            active.append(ids)
            if len(active) > 60:
                active.pop(0)
        else:
            k = len(active) - 1 - min(int(rng.expovariate(1 / 8)), len(active) - 1)
            ids = active[k][:-1] + fresh(rng.randint(4, 11))
            active[k] = ids
            if len(ids) > 150:
                active.pop(k)
        input_length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        out.append({"timestamp": t, "input_length": input_length, "output_length": 16, "hash_ids": ids})
    return out


def loop_trace(num_prompts: int = 200, blocks_per_prompt: int = 4, rounds: int = 5) -> list[dict]:
    """A batch job cycling through the same prompts in the same order, round after round
    (every block comes back once per round: a loop as long as all its blocks)."""
    out = []
    t = 0
    for _ in range(rounds):
        for p in range(num_prompts):
            ids = [p * 100 + k for k in range(blocks_per_prompt)]
            out.append({"timestamp": t, "input_length": 512 * blocks_per_prompt, "output_length": 8, "hash_ids": ids})
            t += 50
    return out
