"""What the dashboard knows about the cluster, as plain values: the latest views from the
client facade, the recent event log, and a short history of stats samples from which the
sparklines' rates are computed. No Textual and no gRPC here: the app's workers feed it,
screens read it, and tests build it from fixed views.

Rates come from successive samples of cumulative counters, so a counter that goes back
(a new control plane after a restart) reads as a reset, never as a negative rate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cli.client import AgentView, EventView, OperationView, PinView, StatsView

HISTORY_SAMPLES = 90  # at one sample per 2 s: the last three minutes
EVENT_LOG_SIZE = 2000

CONNECTING, CONNECTED, RECONNECTING = "connecting", "connected", "reconnecting"


@dataclass(frozen=True)
class Sample:
    at_unix_seconds: float
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    moved_bytes_total: int


@dataclass
class Feature:
    """An admin call family that a control plane may not serve yet (pins, operations):
    `available` is None until asked, False while it answers UNIMPLEMENTED."""

    available: bool | None = None
    error: str = ""


class DashboardState:
    def __init__(self, history: int = HISTORY_SAMPLES):
        self.connection = CONNECTING
        self.connection_detail = ""
        self.watch_available: bool | None = None
        self.agents: list[AgentView] = []
        self.stats: StatsView | None = None
        self.stats_error = ""
        self.pins: list[PinView] = []
        self.pins_feature = Feature()
        self.operations: list[OperationView] = []
        self.operations_feature = Feature()
        self.events: deque[EventView] = deque(maxlen=EVENT_LOG_SIZE)
        self.samples: deque[Sample] = deque(maxlen=history)
        self.events_added_total = 0  # every event ever added, the ones the log has since let go included
        self._last_event: tuple[int, float] = (0, 0.0)

    # ---- updates ----------------------------------------------------------------------
    def add_stats(self, stats: StatsView, at_unix_seconds: float) -> None:
        self.stats = stats
        self.stats_error = ""
        moved = stats.tier_moved_bytes_total  # the policy's demotions and promotions, and operations
        self.samples.append(
            Sample(
                at_unix_seconds,
                stats.lookups_total,
                stats.lookup_tokens_total,
                stats.lookup_hit_tokens_total,
                moved,
            )
        )

    def add_event(self, event: EventView) -> bool:
        """Append to the log unless it is one already shown: a watch that reconnects to
        the same control plane replays its buffer. A new control plane numbers from 1
        again, but its events are newer, so they are kept. Returns whether it was added."""
        last_seq, last_at = self._last_event
        if event.seq and event.seq <= last_seq and event.unix_seconds <= last_at:
            return False
        if event.seq:
            self._last_event = (event.seq, event.unix_seconds)
        self.events.append(event)
        self.events_added_total += 1
        return True

    # ---- derived ----------------------------------------------------------------------
    def _rates(self, value) -> list[float]:
        out = []
        pairs = list(self.samples)
        for prev, cur in zip(pairs, pairs[1:], strict=False):
            dt = cur.at_unix_seconds - prev.at_unix_seconds
            delta = value(cur) - value(prev)
            out.append(delta / dt if dt > 0 and delta > 0 else 0.0)
        return out

    def lookup_rate_series(self) -> list[float]:
        """Lookups per second between successive samples."""
        return self._rates(lambda s: s.lookups_total)

    def movement_series(self) -> list[float]:
        """Bytes per second the agents moved between their tiers (the tier policy's
        demotions and promotions, loads' promotions, moves) between successive samples; an
        agent that restarted counts from 0 again, which shows as no movement, not less."""
        return self._rates(lambda s: s.moved_bytes_total)

    def hit_ratio_series(self) -> list[float]:
        """Hit ratio of the tokens looked up between successive samples (the previous
        value carries over an interval with no lookups)."""
        out: list[float] = []
        pairs = list(self.samples)
        for prev, cur in zip(pairs, pairs[1:], strict=False):
            tokens = cur.lookup_tokens_total - prev.lookup_tokens_total
            hits = cur.lookup_hit_tokens_total - prev.lookup_hit_tokens_total
            if tokens > 0 and hits >= 0:
                out.append(min(1.0, hits / tokens))
            else:
                out.append(out[-1] if out else 0.0)
        return out

    def agent(self, agent_id: str) -> AgentView | None:
        return next((a for a in self.agents if a.agent_id == agent_id), None)

    def agent_events(self, agent_id: str, limit: int = 50) -> list[EventView]:
        return [e for e in self.events if e.agent_id == agent_id][-limit:]

    def running_operations(self) -> list[OperationView]:
        return [op for op in self.operations if not op.finished]


def matches_filter(event: EventView, text: str) -> bool:
    """The Events screen's filter: every word must appear in the event's kind, severity,
    agent, op, pin or message (case-insensitive); `kind:x`, `sev:x` and `agent:x` match
    only that field."""
    for word in text.lower().split():
        field, _, value = word.partition(":")
        if value and field in ("kind", "sev", "severity", "agent"):
            actual = {"kind": event.kind, "sev": event.severity, "severity": event.severity, "agent": event.agent_id}
            if value not in actual[field].lower():
                return False
            continue
        haystack = " ".join((event.kind, event.severity, event.agent_id, event.op_id, event.pin_id, event.message))
        if word not in haystack.lower():
            return False
    return True
