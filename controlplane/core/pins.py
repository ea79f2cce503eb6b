"""Pins as the control plane keeps them: durable intent ("keep this prefix, or this
namespace, at tier >= T until the TTL or unpin"), stored in etcd, enforced by sending
each pin to the agents it concerns.

Pure values and rules; etcd and commands live in controlplane.store / reconciler."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from protos import errors
from protos.namespaces import check_namespace
from protos.tier import Tier
from protos.units import human_bytes

_PIN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PIN_BLOCKS = 1 << 16
MIN_TTL_SECONDS = 1.0  # a shorter pin would lapse before agents could apply it
MAX_TTL_SECONDS = 365 * 24 * 3600.0
MAX_OWNER_CHARS = 256


@dataclass(frozen=True)
class Pin:
    """Invariant: a pin names either blocks (`block_hashes`, packed) or a whole
    namespace (no hashes), never neither; `expires_unix_seconds` is 0 only when an
    owner lease bounds its life."""

    pin_id: str
    namespace: str
    model_id: str
    block_hashes: bytes
    min_tier: Tier
    created_unix_seconds: float
    expires_unix_seconds: float
    owner: str = ""
    owner_lease_id: int = 0
    agent_id: str = ""
    pinned_bytes: int = 0

    @property
    def whole_namespace(self) -> bool:
        return not self.block_hashes

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes) // 16

    def active(self, now: float) -> bool:
        return not self.expires_unix_seconds or now < self.expires_unix_seconds

    def applies_to(self, agent_id: str) -> bool:
        return not self.agent_id or self.agent_id == agent_id

    @property
    def version(self) -> str:
        """Tells this pin from another made under the same id (a refresh after it expired,
        an unpin and a new pin): agents report it back, so the control plane resends a pin
        whose id an agent holds with another version."""
        return repr(self.created_unix_seconds)


def _duration(seconds: float) -> str:
    """400d, 1.5h, 0.5ms: as kvctl's --ttl is written."""
    if not math.isfinite(seconds):
        return str(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if abs(seconds) >= size:
            return f"{_short(seconds / size)}{unit}"
    return f"{_short(seconds * 1000)}ms"


def _short(value: float) -> str:
    """100000 as 100000 (not 1e+05), 1.5 as 1.5, 1/3 as 0.3333."""
    return f"{value:.0f}" if value >= 1e4 else f"{value:.4g}"


def new_pin(
    namespace: str,
    model_id: str,
    block_hashes: bytes,
    min_tier: Tier,
    ttl_seconds: float,
    owner: str,
    owner_lease_id: int,
    agent_id: str,
    pinned_bytes: int,
    now: float | None = None,
    pin_id: str = "",
) -> Pin:
    """`pin_id` empty: a fresh random id."""
    now = time.time() if now is None else now
    ns = check_namespace(namespace)
    if len(owner) > MAX_OWNER_CHARS:
        raise errors.InvalidArgument("owner", f"at most {MAX_OWNER_CHARS} characters")
    if pin_id and not _PIN_ID_RE.fullmatch(pin_id):
        raise errors.InvalidArgument("pin_id", f"{pin_id!r} is not a pin id (letters, digits, . _ -; at most 64)")
    if not math.isfinite(ttl_seconds) or ttl_seconds < 0 or ttl_seconds > MAX_TTL_SECONDS:
        raise errors.InvalidArgument("ttl_seconds", f"{_duration(ttl_seconds)} is not between 1s and 365d")
    if 0 < ttl_seconds < MIN_TTL_SECONDS:
        raise errors.InvalidArgument(
            "ttl_seconds", f"{_duration(ttl_seconds)} is under the 1s minimum (agents could not apply the pin in time)"
        )
    if not ttl_seconds and not owner_lease_id:
        raise errors.InvalidArgument("ttl_seconds", "a pin needs a TTL, or an owner lease that bounds its life")
    if min_tier not in (Tier.GPU, Tier.CPU, Tier.DISK):
        raise errors.InvalidArgument("min_tier", "must be gpu, cpu or disk")
    if len(block_hashes) // 16 > MAX_PIN_BLOCKS:
        raise errors.InvalidArgument("scope.block_hashes", f"at most {MAX_PIN_BLOCKS} blocks per pin")
    return Pin(
        pin_id=pin_id or uuid.uuid4().hex[:12],
        namespace=ns,
        model_id=model_id,
        block_hashes=block_hashes,
        min_tier=min_tier,
        created_unix_seconds=now,
        expires_unix_seconds=now + ttl_seconds if ttl_seconds else 0.0,
        owner=owner,
        owner_lease_id=owner_lease_id,
        agent_id=agent_id,
        pinned_bytes=pinned_bytes,
    )


def same_request(a: Pin, b: Pin) -> bool:
    """Do two pins say the same thing (a retried Pin call), whenever each was made?"""
    ttl_a = a.expires_unix_seconds - a.created_unix_seconds if a.expires_unix_seconds else 0.0
    ttl_b = b.expires_unix_seconds - b.created_unix_seconds if b.expires_unix_seconds else 0.0
    return (a.namespace, a.model_id, a.block_hashes, a.min_tier, a.owner, a.owner_lease_id, a.agent_id) == (
        b.namespace,
        b.model_id,
        b.block_hashes,
        b.min_tier,
        b.owner,
        b.owner_lease_id,
        b.agent_id,
    ) and abs(ttl_a - ttl_b) <= 1e-6 * max(ttl_a, ttl_b, 1.0)


def one_per_id(pins: list[Pin]) -> tuple[dict[str, Pin], list[Pin]]:
    """The pins etcd holds, one per id: the newest made (a pin id made again in another
    namespace, where the old key could not be deleted), and the others, to be deleted."""
    chosen: dict[str, Pin] = {}
    others: list[Pin] = []
    for p in pins:
        held = chosen.get(p.pin_id)
        if held is None or p.created_unix_seconds > held.created_unix_seconds:
            chosen[p.pin_id] = p
            if held is not None:
                others.append(held)
        else:
            others.append(p)
    return chosen, others


def pinned_bytes_of(pins: list[Pin], namespace: str, now: float, namespace_bytes: Callable[[str], int]) -> int:
    """What the namespace's live pins hold, a namespace's own blocks once. A whole-namespace
    pin covers whatever the namespace holds now on the agents it applies to
    (`namespace_bytes(agent_id)`, "" for every agent), not what it held when it was made:
    it grows as the namespace does; several namespace pins (everywhere, or on some agents)
    count those blocks once. Pins of blocks count their blocks in full: the namespace is
    their label, and the blocks they name need not be stored under it, so a namespace pin
    does not cover them; a block several of them name counts once (once per agent named,
    for pins on single agents that no pin of it everywhere covers). Pins past their TTL
    count for nothing, even before the sweep deletes them."""
    live = [p for p in pins if p.namespace == namespace and p.active(now)]
    whole = [p for p in live if p.whole_namespace]
    if any(not p.agent_id for p in whole):  # the namespace everywhere
        covered = max([namespace_bytes("")] + [p.pinned_bytes for p in whole if not p.agent_id])
    else:
        agents = {p.agent_id for p in whole}
        covered = sum(max([namespace_bytes(a)] + [p.pinned_bytes for p in whole if p.agent_id == a]) for a in agents)
    return covered + _prefix_pins_bytes([p for p in live if not p.whole_namespace])


def _prefix_pins_bytes(pins: list[Pin]) -> int:
    """Bytes of the blocks these pins name, each (model, block) once where a pin holds it
    everywhere, else once per agent pinned on (two pins of one prompt took the quota twice)."""
    everywhere: dict[tuple[str, bytes], int] = {}
    on_agents: dict[tuple[str, bytes], dict[str, int]] = {}
    for p in pins:
        if not p.num_blocks:
            continue
        per_block = p.pinned_bytes // p.num_blocks
        raw = p.block_hashes
        for i in range(0, len(raw), 16):
            key = (p.model_id, raw[i : i + 16])
            if not p.agent_id:
                everywhere[key] = max(everywhere.get(key, 0), per_block)
            else:
                agents = on_agents.setdefault(key, {})
                agents[p.agent_id] = max(agents.get(p.agent_id, 0), per_block)
    total = sum(everywhere.values())
    for key, agents in on_agents.items():
        if key not in everywhere:
            total += sum(agents.values())
    return total


def check_quota(pins: list[Pin], new: Pin, quota_bytes: int | None, namespace_bytes: Callable[[str], int]) -> None:
    """Reject a pin that would take its namespace beyond its quota (nothing changes); a
    pin that adds nothing (its bytes already pinned, see pinned_bytes_of) is not refused."""
    if quota_bytes is None:
        return
    now = new.created_unix_seconds
    before = pinned_bytes_of(pins, new.namespace, now, namespace_bytes)
    after = pinned_bytes_of([*pins, new], new.namespace, now, namespace_bytes)
    if after > quota_bytes and after > before:
        raise errors.ResourceExhausted(
            f"pin quota of namespace {new.namespace!r} exceeded: {human_bytes(before)} pinned + "
            f"{human_bytes(after - before)} asked > quota {human_bytes(quota_bytes)}; "
            f"unpin something or raise quota.{new.namespace}"
        )
