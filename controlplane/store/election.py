"""Leader election on etcd, after etcd's own `concurrency` package.

The leader key holds the leader's address under the leader's lease; a candidate wins
with a transaction that creates the key only if it does not exist. The key's
create_revision is the epoch: it grows with every new leader, so agents can reject
commands from an older one. Leadership ends when the lease cannot be refreshed.
"""

from __future__ import annotations

import logging
import threading
import time

from protos.etcd_keys import LEADER_KEY, is_unreachable, refresh_within, refusal_reason

log = logging.getLogger(__name__)


class LeadershipLost(RuntimeError):
    """etcd answered: our leader key is gone or held under another lease, or our lease ran out."""


class LeaderElection:
    def __init__(self, client, address: str, ttl_seconds: int = 5, key: str = LEADER_KEY):
        self._client = client
        self.address = address
        self.ttl_seconds = ttl_seconds
        self.key = key
        self._lease = None
        self._lock = threading.Lock()
        self._resigned = False  # resign() was called: no step stands for election again
        self.is_leader = False
        # True while we led and etcd became unreachable: nobody can be elected meanwhile,
        # so this replica keeps answering reads from memory (flagged possibly stale) and
        # refuses durable writes until etcd is back.
        self.serving_from_memory = False
        self.epoch = 0
        self.leader_address = ""
        self._last_ok = 0.0  # monotonic time of the last step etcd answered
        # why this replica cannot stand for election though etcd answers (it is out of
        # space: no lease can be granted); '' when it can. Said to callers with no leader.
        self.refusal = ""
        self._refusal_logged = 0.0

    def run_once(self) -> bool:
        """One step: refresh our lease if leading, else try to win. Returns is_leader."""
        with self._lock:
            if self._resigned:
                return False
            # the lease was refreshed no earlier than the call went out: the time it still has
            # is counted from then, not from a slow answer (the window below is a lease's)
            sent = time.monotonic()
            try:
                if self.is_leader:
                    self._refresh()
                else:
                    self._campaign()
                if self.serving_from_memory:
                    log.info("etcd is reachable again (leader: %s)", self.is_leader)
                self.serving_from_memory = False
                self._last_ok = sent
                self.refusal = ""
            except Exception as exc:  # noqa: BLE001 - sorted below: outage or lost leadership
                self._note_refusal(exc)
                # leadership is lost only when etcd says so (our key gone, or our lease out):
                # another failure of a call (UNKNOWN, too many requests...) is like an outage,
                # not a reason to drop a lease that still holds the key (no leader for a TTL,
                # then a new epoch, a reload and every agent resyncing)
                if isinstance(exc, LeadershipLost) or (not self.is_leader and not is_unreachable(exc)):
                    if self.is_leader:
                        log.warning("lost leadership (epoch %d): %s", self.epoch, exc)
                    self.is_leader = False
                    self.serving_from_memory = False
                    self._lease = None
                    if self._resigned:
                        return False
                    # name the leader now (a deposed leader went on naming itself until its
                    # next step, and clients could not follow): read the key, or stand again
                    try:
                        self._campaign()
                    except Exception as again:  # noqa: BLE001 - the next step tries again
                        self._note_refusal(again)
                        log.debug("reading the leader key after losing leadership: %s", again)
                        self.leader_address = ""
                    return self.is_leader
                if self.is_leader and time.monotonic() - self._last_ok < self.ttl_seconds / 2:
                    # one failed call (a timeout, the client's endpoint marked failed for a
                    # second) is no outage yet: the lease still has most of its TTL, and the
                    # next step, a third of a TTL on, tells
                    log.info("etcd call failed (%s); still leading, lease not at risk yet", type(exc).__name__)
                    return True
                if self.is_leader:
                    log.warning("etcd unreachable (%s): serving reads from memory until it returns", type(exc).__name__)
                    self.serving_from_memory = True
                self.is_leader = False
            return self.is_leader

    def _note_refusal(self, exc: BaseException) -> None:
        reason = refusal_reason(exc)
        if reason and time.monotonic() - self._refusal_logged > 30.0:
            log.error("cannot stand for control-plane leader: %s", reason)
            self._refusal_logged = time.monotonic()
        self.refusal = reason

    def _refresh(self) -> None:
        lease = self._lease
        if lease is None:
            raise LeadershipLost("no leader lease")
        ttl = refresh_within(lease, self.ttl_seconds)
        value, meta = self._client.get(self.key)
        if ttl <= 0 or meta is None or meta.lease_id != lease.id:
            raise LeadershipLost("leader lease expired")

    def _campaign(self) -> None:
        client = self._client
        value, meta = client.get(self.key)
        if meta is not None:
            if (
                self._lease is not None
                and meta.lease_id == self._lease.id
                and refresh_within(self._lease, self.ttl_seconds) > 0
            ):
                # etcd came back before our lease ran out: we still lead, same epoch
                self.is_leader = True
                self.leader_address = self.address
                return
            self._lease = None
            named = value.decode()
            # our own address under another lease: a predecessor here (this replica
            # restarted) whose lease lasts until its TTL; it is gone, so no leader is
            # reachable (naming ourselves sent clients back to us, FAILED_PRECONDITION)
            self.leader_address = "" if named == self.address else named
            self.epoch = meta.create_revision
            return
        self._lease = None
        lease = client.lease(self.ttl_seconds)
        won, _ = client.transaction(
            compare=[client.transactions.create(self.key) == 0],
            success=[client.transactions.put(self.key, self.address, lease)],
            failure=[],
        )
        if not won:  # another replica won between the read and the transaction: name it
            lease.revoke()
            value, meta = client.get(self.key)
            self.leader_address = value.decode() if value else ""
            if meta is not None:
                self.epoch = meta.create_revision
            return
        value, meta = client.get(self.key)
        self._lease = lease
        # the epoch before is_leader: whoever sees us lead sees this epoch (Manager.ready)
        self.epoch = meta.create_revision
        self.leader_address = self.address
        self.is_leader = True
        log.info("became leader at %s, epoch %d", self.address, self.epoch)

    def resign(self) -> None:
        """Give up the leadership (the lease revoked: another replica may win at once). A
        step stuck in an etcd call holds the lock: the lease is revoked without it after a
        TTL (a CI run saw a lease refresh never return while etcd restarted), so that a
        stop never hangs on etcd."""
        self._resigned = True  # a step under way stands no more
        locked = self._lock.acquire(timeout=self.ttl_seconds)
        try:
            if self.is_leader and self._lease is not None:
                try:
                    self._lease.revoke()
                except Exception:  # noqa: BLE001 - best effort on shutdown
                    pass
            self.is_leader = False
        finally:
            if locked:
                self._lock.release()
            else:
                log.warning("resigned without the election lock: a step is stuck in an etcd call")

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.run_once()
            stop.wait(max(self.ttl_seconds / 3.0, 0.2))
