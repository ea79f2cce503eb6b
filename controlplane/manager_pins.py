"""The leader's pins (part of controlplane.manager.Manager): made, released and listed in
etcd and memory; expired on time, tied to an owner's lease, re-applied to every agent
that lacks them, reloaded from etcd and watched for deletes other writers make."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from functools import partial

from controlplane.core.cluster import AgentCommand, AgentRecord
from controlplane.core.pins import Pin, check_quota, new_pin, one_per_id, same_request
from controlplane.core.scope import Scope, block_bytes
from controlplane.manager_state import ManagerState
from controlplane.store.durable import LeaseNotFound, pin_from_json, pin_key, pin_to_json
from protos import errors, etcd_keys
from protos.block_hash import BLOCK_HASH_BYTES
from protos.namespaces import check_namespace
from protos.tier import Tier
from protos.units import parse_size

log = logging.getLogger(__name__)

UNPINNED_REMEMBERED_SECONDS = 60.0  # far longer than a reload's read of etcd can take


def _applied(rec: AgentRecord, pin_id: str, version: str) -> None:
    rec.applied_pins[pin_id] = version


def _unapplied(rec: AgentRecord, pin_id: str) -> None:
    rec.applied_pins.pop(pin_id, None)


class PinControl(ManagerState):
    """Pins, mixed into Manager (whose state and lock they share: see Manager.__init__)."""

    # ---- pins -----------------------------------------------------------------------
    def quota_of(self, namespace: str) -> int | None:
        raw = self.policy.get(f"{etcd_keys.QUOTA_POLICY_PREFIX}{namespace}")
        return parse_size(raw) if raw else None

    def pin(
        self,
        scope: Scope,
        min_tier: Tier,
        ttl_seconds: float,
        owner: str = "",
        owner_lease_id: int = 0,
        pin_id: str = "",
    ) -> Pin:
        """A new pin; with a `pin_id` chosen by the caller, a retry of the same request
        returns the pin the first try made (found in memory, or in etcd where the first
        try's answer was lost after etcd took it) and another request under that id is
        ALREADY_EXISTS."""
        self.ensure_loaded()
        packed, namespace = self.resolve(scope, per="pin")
        if not packed and scope.model_id:  # agents hold a namespace pin over every model's blocks in it
            raise errors.InvalidArgument(
                "scope.model_id", "a namespace pin covers every model's blocks in it; give a prefix to pin one model's"
            )
        if scope.agent_id and scope.agent_id not in {r.agent_id for r, _ in self.cluster.agents()}:
            raise errors.NotFound(f"scope.agent_id: no agent {scope.agent_id!r} is registered")
        if packed:
            pinned_bytes = len(packed) // BLOCK_HASH_BYTES * block_bytes(self._model(scope.model_id))
        else:
            pinned_bytes = self.cluster.namespace_bytes(namespace, scope.agent_id)
        # etcd lease ids are int64: a larger one names no lease (and etcd's client cannot send it)
        if owner_lease_id and (owner_lease_id >= 1 << 63 or not self.durable.lease_alive(owner_lease_id)):
            raise self._lease_gone(owner_lease_id)
        pin = new_pin(
            namespace,
            scope.model_id,
            packed,
            min_tier,
            ttl_seconds,
            owner,
            owner_lease_id,
            scope.agent_id,
            pinned_bytes,
            self.clock(),
            pin_id,
        )
        with self._lock:
            earlier = self._store_pin(pin, namespace)
        if earlier is not None:  # a retry: the pin exists (sent to its agents again, harmlessly)
            self._apply_pins_now()
            return earlier
        self.cluster.events.publish("pin_created", self._describe(pin), pin_id=pin.pin_id)
        self._apply_pins_now()
        return pin

    def _store_pin(self, pin: Pin, namespace: str) -> Pin | None:
        """Store a new pin (None), or return the live pin its caller-chosen id already
        names for the same request: one this leader holds, or one etcd took although the
        answer to the first try was lost (adopted). Under _lock."""
        now = self.clock()
        earlier = self.pins.get(pin.pin_id)
        if earlier is not None and earlier.active(now):
            return self._same_pin(earlier, pin)
        check_quota(
            list(self.pins.values()), pin, self.quota_of(namespace), partial(self.cluster.namespace_bytes, namespace)
        )
        key, value = pin_key(pin), pin_to_json(pin)
        lease_id = pin.owner_lease_id
        # an expired pin of ours under this id is simply replaced; else create only if free
        try:
            held = self.durable.create(key, value, lease_id) if earlier is None else b""
        except LeaseNotFound:  # the owner's lease ended since it was checked
            raise self._lease_gone(lease_id) from None
        if held:
            try:
                stored = pin_from_json(held)
            except (ValueError, KeyError):
                stored = None
            if stored is not None and stored.active(now):
                self.pins[stored.pin_id] = stored
                return self._same_pin(stored, pin)
        if held is not None:  # a pin past its TTL under this id, or none that parses: replaced
            # (an expired one of ours in another namespace: its key goes in the same write)
            try:
                self.durable.put(key, value, lease_id, replacing=pin_key(earlier) if earlier is not None else "")
            except LeaseNotFound:
                raise self._lease_gone(lease_id) from None
        self.pins[pin.pin_id] = pin
        self._unpinned.pop(pin.pin_id, None)  # made again under its id: the reload may list it
        return None

    @staticmethod
    def _lease_gone(lease_id: int) -> errors.InvalidArgument:
        return errors.InvalidArgument(
            "owner_lease_id", f"lease {lease_id} (0x{lease_id:x}) does not exist or has expired"
        )

    @staticmethod
    def _same_pin(earlier: Pin, pin: Pin) -> Pin:
        if not same_request(earlier, pin):
            raise errors.AlreadyExists(
                f"pin_id: pin {pin.pin_id!r} exists with another scope, tier, TTL or owner "
                "(kvctl pins lists it; choose another id)"
            )
        return earlier

    @staticmethod
    def _describe(pin: Pin) -> str:
        what = f"{pin.num_blocks} blocks of {pin.model_id}" if pin.block_hashes else f"namespace {pin.namespace}"
        ttl = (
            f", expires in {pin.expires_unix_seconds - pin.created_unix_seconds:.0f}s"
            if pin.expires_unix_seconds
            else ""
        )
        return f"pin {pin.pin_id}: {what} at >= {pin.min_tier.label}{ttl}"

    def unpin(self, pin_id: str) -> Pin:
        self.ensure_loaded()
        with self._lock:
            pin = self.pins.get(pin_id)
            if pin is None:
                raise errors.NotFound(f"pin_id: no pin {pin_id!r} (kvctl pins lists them)")
            self.durable.delete(pin_key(pin))
            del self.pins[pin_id]
            self._unpinned[pin_id] = time.monotonic()
            self._pin_refusals.clear()  # a lifted pin may free what an agent refused
        self.cluster.events.publish("pin_removed", f"pin {pin_id} removed", pin_id=pin_id)
        self._apply_pins_now()
        return pin

    def _apply_pins_now(self) -> None:
        """After a pin or unpin is stored: send it to the agents at once. The change is
        made whatever happens here (the caller must hear so, not an error): a failure is
        logged and the reconcile loop's next pass sends it."""
        try:
            self._apply_pins(self.clock())
        except Exception:  # noqa: BLE001 - see above
            log.exception("sending pins to agents failed; the next reconcile pass sends them")

    def list_pins(self, namespace: str = "") -> list[Pin]:
        if namespace:
            check_namespace(namespace, "namespace")  # "a b" names no namespace: say so, not "no pins"
        now = self.clock()
        with self._lock:
            found = sorted(
                (p for p in self.pins.values() if p.active(now) and (not namespace or p.namespace == namespace)),
                key=lambda p: p.created_unix_seconds,
            )
        # a namespace pin covers what its namespace holds now (it grows with it), as its
        # quota check counts it, not what it held when it was made
        return [
            dataclasses.replace(p, pinned_bytes=self.cluster.namespace_bytes(p.namespace, p.agent_id))
            if p.whole_namespace
            else p
            for p in found
        ]

    def pinned_blocks(self, agent_id: str, block_hashes: Sequence[bytes]) -> set[bytes]:
        """Which of these blocks an active prefix pin holds on `agent_id` (Route: a decode
        agent's pinned blocks are not in its free bytes). A namespace pin's blocks are
        known only where an agent's own pins kept them from a policy pass. Never takes
        the manager's lock (Pin and Unpin hold it across etcd writes; Route answers from
        memory): the pins are read as one snapshot, their index rebuilt when they change."""
        if not block_hashes:
            return set()
        now = self.clock()
        pins = list(self.pins.values())  # (one C call: a consistent snapshot under the GIL)
        ids = [id(p) for p in pins]
        with self._pinned_index_lock:
            cached = self._pinned_by_block
            if cached is None or cached[0] != ids:
                index: dict[bytes, list[Pin]] = {}
                for p in pins:
                    for i in range(0, len(p.block_hashes), BLOCK_HASH_BYTES):
                        index.setdefault(p.block_hashes[i : i + BLOCK_HASH_BYTES], []).append(p)
                # the pins themselves are kept with their ids, so no id is reused meanwhile
                cached = self._pinned_by_block = (ids, pins, index)
        index = cached[2]
        refused = self._pin_refusals.get(agent_id, {})  # what its own pins (namespaces too) kept
        out = set()
        for h in block_hashes:
            kept = refused.get(h)
            if (kept is not None and kept[1] > now) or any(
                p.active(now) and p.applies_to(agent_id) for p in index.get(h, ())
            ):
                out.add(h)
        return out

    def _apply_pins(self, now: float) -> None:
        """Send every connected agent the pins it should hold and lacks (or holds in another
        version: a pin made again under its id replaces the agent's copy); unpin the rest."""
        with self._apply_lock:
            self._apply_pins_locked(now)

    def _apply_pins_locked(self, now: float) -> None:
        with self._lock:
            pins = [p for p in self.pins.values() if p.active(now)]
        for rec in self.cluster.connected_agents():
            want = {p.pin_id: p for p in pins if p.applies_to(rec.agent_id)}
            # a copy: a new stream's Hello replaces the record's dict meanwhile
            # what was sent is noted on the stream it went to only: a new stream's Hello
            # between the send and the note (another thread) restarts the record from what
            # the agent holds, which a note meant for the old stream must not change
            for pin_id in [i for i in list(rec.applied_pins) if i not in want]:
                sent = self.cluster.send_on_stream(
                    rec.agent_id, AgentCommand(f"unpin-{pin_id}", "unpin", pin_id=pin_id)
                )
                if sent:
                    self.cluster.note_on_stream(rec.agent_id, sent, partial(_unapplied, pin_id=pin_id))
            for pin_id, p in want.items():
                if rec.applied_pins.get(pin_id) == p.version:
                    continue
                cmd = AgentCommand(
                    f"pin-{pin_id}",
                    "pin",
                    block_hashes=p.block_hashes,
                    tier=int(p.min_tier),
                    namespace=p.namespace if p.whole_namespace else "",
                    pin_id=pin_id,
                    pin_version=p.version,
                    expires_unix_seconds=p.expires_unix_seconds,
                )
                sent = self.cluster.send_on_stream(rec.agent_id, cmd)
                if sent:
                    self.cluster.note_on_stream(rec.agent_id, sent, partial(_applied, pin_id=pin_id, version=p.version))

    def _expire_pins(self, now: float) -> None:
        with self._lock:
            expired = [p for p in self.pins.values() if not p.active(now)]
        for p in expired:
            try:
                self.durable.delete_pin(p)  # not a pin made again under its id meanwhile
            except errors.KvcpError as exc:
                log.warning("could not delete expired pin %s yet: %s", p.pin_id, exc)
                continue  # agents stop honouring it at its expiry anyway; retried next pass
            with self._lock:
                if self.pins.get(p.pin_id) is not p:
                    continue  # made again under its id while this pass swept: the new one stays
                del self.pins[p.pin_id]
                self._pin_refusals.clear()  # a lifted pin may free what an agent refused
            self.pins_expired_total += 1
            self.cluster.events.publish("pin_expired", f"pin {p.pin_id} expired (TTL)", pin_id=p.pin_id)

    def _delete_stale_pins(self, stale: list[Pin]) -> None:
        """Older pins under an id that a newer pin holds (in another namespace): deleted
        (each only while it is the version read), so no load prefers them."""
        for p in stale:
            try:
                self.durable.delete_pin(p)
            except errors.KvcpError as exc:
                log.warning("could not delete pin %s's older copy in namespace %s yet: %s", p.pin_id, p.namespace, exc)

    def _watch_pins(self) -> None:
        """A pin key deleted in etcd (its owner's lease ended) brings the reload forward to
        this loop's next turn, instead of the next resync up to `resync_seconds` later:
        the pin is lifted from agents within about a tenth of a second of its lease."""
        with self._lock:
            if self._pins_watch is not None or not hasattr(self.durable, "watch_deletes"):
                return
            self._pins_watch_generation += 1
            generation = self._pins_watch = self._pins_watch_generation  # "opening"

        def reload_now() -> None:
            self._next_reload = 0.0

        def ended() -> None:  # on the watch's thread, maybe before watch_deletes returns
            with self._lock:
                if self._pins_watch == generation:
                    self._pins_watch = self._pins_watch_id = None  # watched again at the next turn

        try:
            watch_id = self.durable.watch_deletes(etcd_keys.PINS_PREFIX, reload_now, ended)
        except errors.Unavailable as exc:
            log.debug("cannot watch pins yet: %s", exc)
            ended()
            return
        with self._lock:
            if self._pins_watch == generation:  # not ended meanwhile
                self._pins_watch_id = watch_id

    def _unwatch_pins(self) -> None:
        """A follower does not reload pins: its watch goes (it is opened again on leading)."""
        with self._lock:
            watch_id, self._pins_watch, self._pins_watch_id = self._pins_watch_id, None, None
        if watch_id is not None and hasattr(self.durable, "cancel_watch"):
            self.durable.cancel_watch(watch_id)

    def _reload_pins(self) -> None:
        """Level-triggered: etcd is the truth (a pin tied to an owner lease vanishes with it)."""
        with self._lock:
            before = dict(self.pins)  # a pin created (or made again) after the read below is not 'gone'
        stored, stale = one_per_id(self.durable.load_pins())
        self._delete_stale_pins(stale)
        with self._lock:
            gone = [pid for pid, p in before.items() if self.pins.get(pid) is p and pid not in stored]
            for pid in gone:
                del self.pins[pid]
                self._pin_refusals.clear()  # a lifted pin may free what an agent refused
            cutoff = time.monotonic() - UNPINNED_REMEMBERED_SECONDS
            self._unpinned = {pid: at for pid, at in self._unpinned.items() if at > cutoff}
            for pid, p in stored.items():
                if pid not in self._unpinned:  # (read before its unpin deleted it)
                    self.pins.setdefault(pid, p)
        for pid in gone:
            self.cluster.events.publish("pin_removed", f"pin {pid} released (owner lease gone)", pin_id=pid)
