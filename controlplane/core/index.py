"""The global block index: which agents hold which block, and in which tier.

It lives in the leader's memory and is rebuilt from agents' inventories; etcd never
holds it. Keys are 16-byte chained block digests (protos.block_hash), so a prefix
lookup is a walk down the request's digests, no tree needed: a digest already names its
whole prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protos.tier import Tier


@dataclass(frozen=True)
class AgentMatch:
    """How much of a prefix one agent holds: its leading `num_hit_blocks` blocks,
    `tiers[i]` being the tier of block i on that agent."""

    agent_id: str
    num_hit_blocks: int
    tiers: bytes

    def tier_list(self) -> list[Tier]:
        return [Tier(t) for t in self.tiers]


class BlockIndex:
    """Replicas of blocks across agents.

    Invariant: `_replicas[h][a] == t` exactly when `_by_agent[a][h] == t`; no empty
    inner dicts are kept in `_replicas`. Not thread-safe: the owner (Cluster) locks.
    """

    def __init__(self) -> None:
        self._replicas: dict[bytes, dict[str, int]] = {}
        self._by_agent: dict[str, dict[bytes, int]] = {}

    # ---- mutation -------------------------------------------------------------------
    def add(self, agent_id: str, block_hashes: Iterable[bytes], tier: Tier) -> None:
        """Record that `agent_id` holds these blocks in `tier` (a tier change if already held)."""
        mine = self._by_agent.setdefault(agent_id, {})
        t = int(tier)
        replicas = self._replicas
        for h in block_hashes:
            mine[h] = t
            holders = replicas.get(h)
            if holders is None:
                replicas[h] = {agent_id: t}
            else:
                holders[agent_id] = t

    def remove(self, agent_id: str, block_hashes: Iterable[bytes]) -> None:
        mine = self._by_agent.get(agent_id)
        if not mine:
            return
        for h in block_hashes:
            if mine.pop(h, None) is None:
                continue
            holders = self._replicas[h]
            del holders[agent_id]
            if not holders:
                del self._replicas[h]

    def drop_agent(self, agent_id: str) -> int:
        """Forget everything `agent_id` holds; returns the number of replicas dropped."""
        mine = self._by_agent.pop(agent_id, None)
        if not mine:
            return 0
        for h in mine:
            holders = self._replicas[h]
            del holders[agent_id]
            if not holders:
                del self._replicas[h]
        return len(mine)

    def replace_agent(self, agent_id: str, blocks: dict[bytes, int]) -> None:
        """Swap in a full inventory: afterwards the agent holds exactly `blocks`."""
        old = self._by_agent.get(agent_id, {})
        gone = [h for h in old if h not in blocks]
        self.remove(agent_id, gone)
        mine = self._by_agent.setdefault(agent_id, {})
        replicas = self._replicas
        for h, t in blocks.items():
            if mine.get(h) == t:
                continue
            mine[h] = t
            holders = replicas.get(h)
            if holders is None:
                replicas[h] = {agent_id: t}
            else:
                holders[agent_id] = t

    # ---- queries --------------------------------------------------------------------
    def lookup(self, block_hashes: list[bytes]) -> list[AgentMatch]:
        """Per agent, the number of leading blocks of the prefix it holds; longest first."""
        tiers: dict[str, bytearray] = {}
        alive: set[str] = set()
        replicas = self._replicas
        for i, h in enumerate(block_hashes):
            holders = replicas.get(h)
            if not holders:
                break
            if i == 0:
                for a, t in holders.items():
                    tiers[a] = bytearray((t,))
                alive = set(holders)
                continue
            for a in list(alive):
                t = holders.get(a)
                if t is None:
                    alive.discard(a)
                else:
                    tiers[a].append(t)
            if not alive:
                break
        matches = [AgentMatch(a, len(ts), bytes(ts)) for a, ts in tiers.items()]
        matches.sort(key=lambda m: (-m.num_hit_blocks, m.agent_id))
        return matches

    def holders(self, block_hash: bytes) -> dict[str, Tier]:
        return {a: Tier(t) for a, t in self._replicas.get(block_hash, {}).items()}

    def agent_blocks(self, agent_id: str) -> dict[bytes, int]:
        return dict(self._by_agent.get(agent_id, {}))

    def num_agent_blocks(self, agent_id: str) -> int:
        return len(self._by_agent.get(agent_id, ()))

    @property
    def num_blocks(self) -> int:
        return len(self._replicas)

    @property
    def num_replicas(self) -> int:
        return sum(len(m) for m in self._by_agent.values())

    def agents(self) -> list[str]:
        return list(self._by_agent)
