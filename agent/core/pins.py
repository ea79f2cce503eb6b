"""Pins as an agent enforces them: the control plane sends each pin (by block hashes or
by namespace) with its tier and expiry; the agent keeps them here and asks, for any
block, how it is protected *now*. A pin stops protecting at its expiry even if the
control plane is away, so no pin outlives its TTL on an agent. Expiries are on the
monotonic clock: a step of the wall clock (NTP, an operator) neither shortens nor
stretches a pin. Expired pins leave the table whenever a pin is added and before the
agent lists its pins to the control plane."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class AgentPin:
    pin_id: str
    tier: int  # Tier value: kept there or faster
    expires_monotonic_seconds: float  # time.monotonic() at expiry; 0: until unpinned
    namespace: str = ""  # a namespace pin when block_hashes is empty
    block_hashes: frozenset[bytes] = frozenset()
    version: str = ""  # the control plane's, reported back so it can tell a pin re-made under this id

    def active(self, now: float) -> bool:
        return not self.expires_monotonic_seconds or now < self.expires_monotonic_seconds


class PinTable:
    """Invariant: `_by_hash[h]` holds exactly the ids of prefix pins naming h, and
    `_by_namespace[ns]` the ids of namespace pins of ns. Not thread-safe (pool lock)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.pins: dict[str, AgentPin] = {}
        self._by_hash: dict[bytes, set[str]] = {}
        self._by_namespace: dict[str, set[str]] = {}
        self.changes = 0  # counts adds and removals: who cached an answer knows when it may differ
        self._next_expiry = math.inf

    def add(self, pin: AgentPin) -> None:
        self.expire()
        self.remove(pin.pin_id)
        self.pins[pin.pin_id] = pin
        self.changes += 1
        if pin.expires_monotonic_seconds:
            self._next_expiry = min(self._next_expiry, pin.expires_monotonic_seconds)
        if pin.block_hashes:
            for h in pin.block_hashes:
                self._by_hash.setdefault(h, set()).add(pin.pin_id)
        else:
            self._by_namespace.setdefault(pin.namespace, set()).add(pin.pin_id)

    def remove(self, pin_id: str) -> AgentPin | None:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return None
        self.changes += 1
        if pin.expires_monotonic_seconds == self._next_expiry:
            self._next_expiry = min(
                (p.expires_monotonic_seconds for p in self.pins.values() if p.expires_monotonic_seconds),
                default=math.inf,
            )
        if pin.block_hashes:
            for h in pin.block_hashes:
                ids = self._by_hash.get(h)
                if ids is not None:
                    ids.discard(pin_id)
                    if not ids:
                        del self._by_hash[h]
        else:
            ids = self._by_namespace.get(pin.namespace, set())
            ids.discard(pin_id)
            if not ids:
                self._by_namespace.pop(pin.namespace, None)
        return pin

    def tier_of(self, block_hash: bytes, namespace: str, now: float | None = None) -> int:
        """The fastest tier an active pin holds this block at; 0 when unpinned."""
        if not self.pins:
            return 0
        now = self.clock() if now is None else now
        best = 0
        for ids in (self._by_hash.get(block_hash, ()), self._by_namespace.get(namespace, ())):
            for pin_id in ids:
                pin = self.pins[pin_id]
                if pin.active(now) and (best == 0 or pin.tier < best):
                    best = pin.tier
        return best

    def next_expiry(self) -> float:
        """The monotonic time the first pin with a TTL expires (inf: none has one)."""
        return self._next_expiry

    def expire(self, now: float | None = None) -> list[str]:
        """Drop the pins past their expiry; returns their ids."""
        now = self.clock() if now is None else now
        gone = [p.pin_id for p in self.pins.values() if not p.active(now)]
        for pin_id in gone:
            self.remove(pin_id)
        return gone
