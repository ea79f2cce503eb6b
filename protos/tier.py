"""The one `Tier` enum of kvcp, as plain Python for code that must not import generated
protobuf modules (`controlplane.core`, `agent.core`). Values equal `kvcp.v1.Tier`;
a test checks that they stay equal."""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    """Storage tiers, fastest first."""

    GPU = 1
    CPU = 2
    DISK = 3
    REMOTE = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Tier:
        tier = cls.__members__.get(text.strip().upper())
        if tier is None or tier is cls.REMOTE:  # REMOTE is reported, never asked for
            names = "|".join(t.label for t in cls if t is not cls.REMOTE)
            raise ValueError(f"unknown tier {text!r}; expected one of {names}")
        return tier
