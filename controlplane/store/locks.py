"""Distributed locks under /kvcp/v1/locks/<name>: a key created only if absent (one
transaction), attached to a lease refreshed while held, so a holder that dies releases
the lock within the lease TTL. Used for exclusive scopes such as a namespace cleanup."""

from __future__ import annotations

import threading
import time

from protos import etcd_keys


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

    def try_acquire(self) -> bool:
        c = self._client
        lease = c.lease(self.ttl_seconds)
        won, _ = c.transaction(
            compare=[c.transactions.create(k) == 0 for k in (self.key, *self.also_absent)],
            success=[c.transactions.put(self.key, self.holder, lease)],
            failure=[],
        )
        if not won:
            lease.revoke()
            return False
        self._lease = lease
        self._stop.clear()
        self._refresher = threading.Thread(target=self._refresh, name=f"lock {self.key}", daemon=True)
        self._refresher.start()
        return True

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

    def _drained(self) -> bool:
        if not self.drain_prefix:
            return True
        return all(meta.key.decode() == self.key for _, meta in self._client.get_prefix(self.drain_prefix))

    def holder_now(self) -> str:
        value, _ = self._client.get(self.key)
        return value.decode() if value else ""

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_seconds / 3):
            try:
                self._lease.refresh()
            except Exception:  # noqa: BLE001 - etcd away: the lease may lapse; nothing else to do
                pass

    def release(self) -> None:
        self._stop.set()
        if self._lease is not None:
            try:
                self._lease.revoke()  # deletes the key with it
            except Exception:  # noqa: BLE001 - it expires by itself then
                pass
            self._lease = None
