"""Distributed locks under /kvcp/v1/locks/<name>: a key created only if absent (one
transaction), attached to a lease refreshed while held, so a holder that dies releases
the lock within the lease TTL. Used for exclusive scopes such as a namespace cleanup."""

from __future__ import annotations

import logging
import threading
import time

from protos import etcd_keys

log = logging.getLogger(__name__)


class EtcdLock:
    def __init__(
        self,
        client,
        name: str,
        holder: str,
        ttl_seconds: int = 10,
        also_absent: tuple[str, ...] = (),
        drain_prefix: str = "",
    ):
        """`also_absent`: keys that must not exist either when the lock is taken (in the
        same transaction). `drain_prefix`: once taken, the lock counts as held only when no
        other key under that prefix remains (holders that `also_absent` our key stop new
        ones; this waits for those already in). Together: a scope lock over sub-scopes."""
        self._client = client
        self.also_absent = also_absent
        self.drain_prefix = drain_prefix
        self.key = etcd_keys.LOCKS_PREFIX + name
        self.holder = holder
        self.ttl_seconds = ttl_seconds
        self._lease = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self.held = False  # False again once another holder took the key after our lease lapsed
        self.lost_total = 0  # times the lease lapsed while held
        self._lapsed = False  # the lease lapsed and the key is not ours again yet
        self._swap = threading.Lock()  # the lease swap of a retake against release()

    def try_acquire(self) -> bool:
        lease, _ = self._take()
        if lease is None:
            return False
        self._lease = lease
        self.held = True
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh, name=f"lock {self.key}", daemon=True)
        self._refresher.start()
        return True

    def _take(self):
        """(lease, "") when the key (and none of `also_absent`) was absent and is now ours
        under a new lease; (None, who holds it) otherwise. The keys are read first: a
        waiter that finds them taken asks etcd one read, not a lease granted, a write and a
        revoke each time it looks (every 0.1 s while it waits)."""
        c = self._client
        keys = (self.key, *self.also_absent)
        _, responses = c.transaction(compare=[], success=[c.transactions.get(k) for k in keys], failure=[])
        if held := self._holders_of(responses):
            return None, held
        lease = c.lease(self.ttl_seconds)
        won, responses = c.transaction(
            compare=[c.transactions.create(k) == 0 for k in keys],
            success=[c.transactions.put(self.key, self.holder, lease)],
            failure=[c.transactions.get(k) for k in keys],
        )
        if won:
            return lease, ""
        lease.revoke()  # taken between the read and the write
        return None, self._holders_of(responses) or "?"

    @staticmethod
    def _holders_of(responses) -> str:
        return ", ".join(r[0][0].decode(errors="replace") for r in responses if r)

    def acquire(self, timeout_seconds: float, cancelled=lambda: False) -> bool:
        """Wait for the lock until the deadline or `cancelled()`; etcd unreachable meanwhile
        is waited out like a taken lock (other etcd errors raise)."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline and not cancelled():
            try:
                if (self._lease is not None or self.try_acquire()) and self._drained():
                    return True
            except Exception as exc:
                if not etcd_keys.is_unreachable(exc):
                    raise
                # etcd away for a moment: a waiter keeps its place until the deadline
            time.sleep(0.1)
        self.release()  # taken but not drained in time: let the others go on
        return False

    def _holders_inside(self) -> list[str]:
        """Holders of other keys under `drain_prefix` (sub-scope locks), by value."""
        if not self.drain_prefix:
            return []
        return [
            value.decode(errors="replace")
            for value, meta in self._client.get_prefix(self.drain_prefix)
            if meta.key.decode() != self.key
        ]

    def _drained(self) -> bool:
        if not self.drain_prefix:
            return True
        return all(meta.key.decode() == self.key for _, meta in self._client.get_prefix(self.drain_prefix))

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_seconds / 3):
            lease = self._lease
            if lease is None:  # released meanwhile
                return
            try:
                if etcd_keys.refresh_within(lease, self.ttl_seconds) > 0:
                    continue
            except Exception as exc:  # noqa: BLE001 - etcd away: the lease may lapse meanwhile
                log.debug("refreshing the lease of lock %s: %s", self.key, exc)
                continue
            self._retake()

    def _retake(self) -> None:
        """The lease lapsed (etcd was away longer than its TTL): the key went with it and
        another holder may have taken it. Take it again where it is free; otherwise say
        that the scope is no longer held exclusively (a sub-scope lock taken meanwhile,
        for a lock that waits for those to drain, counts too)."""
        if not self._lapsed:
            self._lapsed = True
            self.lost_total += 1
            log.warning("lock %s held by %s lapsed with its lease", self.key, self.holder)
        try:
            lease, other = self._take()
        except Exception as exc:  # noqa: BLE001 - etcd away again: the next refresh tries again
            log.debug("lock %s not taken again yet: %s", self.key, exc)
            return
        if lease is not None:
            with self._swap:
                if self._stop.is_set():  # released meanwhile
                    lease.revoke()
                    return
                self._lease = lease
            self._lapsed = False
            try:
                inside = self._holders_inside()
            except Exception as exc:  # noqa: BLE001 - not known: said as taken again
                log.debug("listing the holders inside lock %s: %s", self.key, exc)
                inside = []
            if not inside:
                log.warning("lock %s held by %s was taken again", self.key, self.holder)
                return
            # kept (no new one starts inside), but those that did run beside this holder;
            # said before `held` turns: whoever sees it False finds the reason logged
            log.error(
                "lock %s held by %s lapsed with its lease and was taken again, but %s started inside its scope "
                "meanwhile: they may run side by side",
                self.key,
                self.holder,
                ", ".join(inside),
            )
            self.held = False
            return
        log.error(
            "lock %s held by %s lapsed with its lease and %s has taken it: the two may now run side by side",
            self.key,
            self.holder,
            other,
        )
        self.held = False
        self._stop.set()

    def release(self) -> None:
        with self._swap:
            self._stop.set()
            self.held = False
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.revoke()  # deletes the key with it
            except Exception:  # noqa: BLE001 - it expires by itself then
                pass
