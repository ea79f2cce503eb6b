"""The agent's membership in etcd: `/kvcp/v1/agents/<agent_id>` under a lease.

The lease is refreshed every ttl/3. If it was lost (etcd restarted, a long pause), a
new lease is granted and the key rewritten. While the key
exists, or while the agent streams to it, the control plane keeps the agent's blocks;
one that dropped them ends the agent's stream, and the agent registers again then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from protos import etcd_keys

log = logging.getLogger(__name__)


class EtcdRegistration:
    def __init__(self, client, agent_id: str, value: Callable[[], str], ttl_seconds: int = 10):
        self._client = client
        self.agent_id = agent_id
        self.key = etcd_keys.agent_key(agent_id)
        self._value = value
        self.ttl_seconds = ttl_seconds
        self.lease = None
        self._failures = 0  # keep-alive failures in a row (said once, then every 30 s)
        self._said_monotonic = 0.0

    def register_at_start(self) -> None:
        """Register, or, where etcd answers but refuses (out of space), say why and serve
        anyway: the keep-alive loop registers once etcd takes writes again."""
        try:
            self.register()
        except Exception as exc:
            reason = etcd_keys.refusal_reason(exc)
            if not reason:
                raise
            log.error("cannot register %s in etcd yet (the engine is served meanwhile): %s", self.key, reason)

    def register(self) -> None:
        lease = self._client.lease(self.ttl_seconds)
        self.lease = lease
        self._client.put(self.key, self._value(), lease=lease)
        log.info("registered %s in etcd (lease %x, ttl %ds)", self.key, lease.id, self.ttl_seconds)

    def run_once(self) -> None:
        if self.lease is None:
            self.register()
            return
        ttl = etcd_keys.refresh_within(self.lease, self.ttl_seconds)
        if ttl <= 0 or self._client.get(self.key)[0] is None:
            log.warning("lease of %s was lost; registering again", self.agent_id)
            self.register()

    def run_forever(self, stop: threading.Event) -> None:
        """Refresh every ttl/3; after a failed refresh every 0.5 s: the failed call took
        its timeout out of the lease's time already, and etcd back from a pause expires
        a lease whose time ran out meanwhile at once, so the first refresh it can answer
        must come quickly."""
        period = max(self.ttl_seconds / 3.0, 0.2)
        wait = period
        while not stop.wait(wait):
            try:
                self.run_once()
                wait = period
                if self._failures:
                    log.info("etcd keep-alive of %s works again after %d failures", self.agent_id, self._failures)
                self._failures = 0
            except Exception as exc:  # noqa: BLE001 - etcd away: keep serving, retry
                self._failures += 1
                now = time.monotonic()
                if self._failures == 1 or now - self._said_monotonic >= 30.0:  # one line, not one per 0.5 s
                    why = (
                        etcd_keys.refusal_reason(exc)
                        or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                    )
                    log.warning("etcd keep-alive of %s failed (%d in a row): %s", self.agent_id, self._failures, why)
                    self._said_monotonic = now
                wait = min(period, 0.5)

    def leader_address(self) -> str:
        return self.leader()[0]

    def leader(self) -> tuple[str, int]:
        """The leader etcd names, with its epoch (the key's create revision); ("", 0): none."""
        value, meta = self._client.get(etcd_keys.LEADER_KEY)
        if not value or meta is None:
            return "", 0
        return value.decode(), int(meta.create_revision)

    def deregister(self) -> None:
        if self.lease is not None:
            try:
                self.lease.revoke()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.lease = None
