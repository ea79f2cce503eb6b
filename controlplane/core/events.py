"""Cluster events for people watching: agents joining and leaving, sync state changes,
notices from agents (corrupt blocks, failed writes), pins and operations.

`EventBus` is pure and thread-safe. `publish` numbers each event (seq, strictly
increasing per bus) and stamps its time; the bus keeps the most recent ones in a ring
buffer so a new watcher can see what just happened. Each subscriber gets its own bounded
queue: publishing never blocks and never waits for a reader. A subscriber that falls
behind loses its oldest events and, before the next event it reads, gets one `dropped`
marker saying how many it missed. The AdminService Watch stream is one subscriber."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

SEVERITIES = ("info", "warning", "error")
DROPPED_KIND = "dropped"
# every kind the control plane publishes (admin.proto's ClusterEvent.kind lists the same,
# the dashboard refreshes by them; tests/unit/test_events.py checks all three agree)
EVENT_KINDS = (
    "agent_joined",
    "agent_left",
    "agent_state",
    "notice",
    "pin_created",
    "pin_removed",
    "pin_expired",
    "op_state",
    "policy",
    "leader",
    "etcd_reset",
    DROPPED_KIND,
)


@dataclass(frozen=True)
class Event:
    seq: int  # 0 only on a `dropped` marker, which is not a published event
    unix_seconds: float
    kind: str
    severity: str
    message: str
    agent_id: str = ""
    op_id: str = ""
    pin_id: str = ""


class Subscription:
    """One reader's queue. Invariant: it holds at most `maxsize` events, in seq order;
    `_dropped` counts events removed unread since the last marker was handed out."""

    def __init__(self, bus: EventBus, kinds: frozenset[str], maxsize: int):
        self._bus = bus
        self._kinds = kinds
        self._queue: deque[Event] = deque()
        self._maxsize = maxsize
        self._dropped = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    def wants(self, kind: str) -> bool:
        return not self._kinds or kind in self._kinds

    def _offer(self, event: Event) -> None:
        """Called by the bus with its lock held; O(1), never blocks on the reader."""
        with self._cond:
            if self._closed:
                return
            if len(self._queue) >= self._maxsize:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(event)
            self._cond.notify()

    def get(self, timeout_seconds: float | None = None) -> Event | None:
        """The next event, a `dropped` marker first when some were lost, or None when
        the timeout passes or the subscription is closed."""
        with self._cond:
            if not self._queue and not self._dropped and not self._closed:
                self._cond.wait(timeout_seconds)
            if self._closed:
                return None
            if self._dropped:
                n, self._dropped = self._dropped, 0
                return Event(
                    0, self._bus.now(), DROPPED_KIND, "warning", f"dropped {n} events (this watcher fell behind)"
                )
            return self._queue.popleft() if self._queue else None

    def drain(self) -> list[Event]:
        """Everything queued now, without waiting (markers included)."""
        out: list[Event] = []
        while True:
            with self._cond:
                if self._closed or (not self._queue and not self._dropped):
                    return out
            e = self.get(0)
            if e is None:
                return out
            out.append(e)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent; wakes a reader blocked in get()."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._bus._unsubscribe(self)


class EventBus:
    def __init__(self, capacity: int = 1000, clock=time.time):
        self._lock = threading.Lock()
        self._clock = clock
        self._recent: deque[Event] = deque(maxlen=capacity)
        self._subscribers: list[Subscription] = []
        self._seq = 0

    def now(self) -> float:
        return self._clock()

    def publish(
        self, kind: str, message: str, severity: str = "info", agent_id: str = "", op_id: str = "", pin_id: str = ""
    ) -> Event:
        if not kind:
            raise ValueError("event kind must not be empty")
        if severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, not {severity!r}")
        # delivered under the bus lock so every subscriber sees events in seq order;
        # offers are O(1) and never wait for a reader
        with self._lock:
            self._seq += 1
            event = Event(self._seq, self._clock(), kind, severity, message, agent_id, op_id, pin_id)
            self._recent.append(event)
            for sub in self._subscribers:
                if sub.wants(kind):
                    sub._offer(event)
        return event

    def recent(self, kinds: tuple[str, ...] = ()) -> list[Event]:
        with self._lock:
            return [e for e in self._recent if not kinds or e.kind in kinds]

    def subscribe(self, kinds: tuple[str, ...] = (), replay_recent: bool = False, maxsize: int = 1000) -> Subscription:
        """A new subscription to events of `kinds` (empty: all). With `replay_recent`,
        the buffered recent events come first, with no gap or duplicate before the live ones."""
        if maxsize <= 0:
            raise ValueError("maxsize must be positive")
        sub = Subscription(self, frozenset(kinds), maxsize)
        with self._lock:
            if replay_recent:
                for e in self._recent:
                    if sub.wants(e.kind):
                        sub._offer(e)
            self._subscribers.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq
