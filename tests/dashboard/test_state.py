"""DashboardState: rates from successive stats samples (a restarted control plane's
counters read as a reset, not a negative rate), the event log's de-duplication of a
replayed buffer, and the Events filter."""

from __future__ import annotations

import pytest

from cli.client import EventView, StatsView
from dashboard.state import DashboardState, matches_filter


def stats(lookups: int, tokens: int, hits: int, moved: int = 0) -> StatsView:
    return StatsView(1, 0, 0, lookups, tokens, hits, 0, 0, "cp", 1, True, tier_moved_bytes_total=moved)


def event(seq: int, at: float, kind: str = "agent_joined", **kw) -> EventView:
    fields = {"severity": "info", "agent_id": "", "op_id": "", "pin_id": "", "message": "m"} | kw
    return EventView(
        seq, at, kind, fields["severity"], fields["agent_id"], fields["op_id"], fields["pin_id"], fields["message"]
    )


def test_rates_between_samples_and_a_counter_reset():
    s = DashboardState()
    for at, (n, tok, hit) in [
        (0, (0, 0, 0)),
        (2, (10, 1000, 500)),
        (4, (30, 2000, 1400)),
        (6, (2, 100, 10)),
        (8, (2, 100, 10)),
    ]:
        s.add_stats(stats(n, tok, hit), at)
    assert s.lookup_rate_series() == [5.0, 10.0, 0.0, 0.0]
    # an interval with no lookups keeps the last ratio; a reset is no new information
    assert s.hit_ratio_series() == pytest.approx([0.5, 0.9, 0.9, 0.9])
    assert s.movement_series() == [0.0, 0.0, 0.0, 0.0]


def test_movement_is_what_agents_moved_between_tiers_not_only_operations():
    """The tier policy's demotions and promotions are no operations: the sparkline said
    0 B/s while Grafana showed ~0.5 MB/s. An agent restart (its count from 0) is no
    movement, not a negative one."""
    s = DashboardState()
    for at, moved in [(0, 0), (2, 1_000_000), (4, 3_000_000), (6, 500_000), (8, 900_000)]:
        s.add_stats(stats(0, 0, 0, moved), at)
    assert s.movement_series() == [500_000.0, 1_000_000.0, 0.0, 200_000.0]


def test_history_is_bounded():
    s = DashboardState(history=5)
    for i in range(20):
        s.add_stats(stats(i, i, i), float(i))
    assert len(s.samples) == 5 and len(s.lookup_rate_series()) == 4


def test_replayed_events_are_not_shown_twice_but_a_new_control_plane_is():
    s = DashboardState()
    assert s.add_event(event(1, 100.0)) and s.add_event(event(2, 101.0))
    # the watch reconnects to the same control plane, which replays its buffer
    assert not s.add_event(event(1, 100.0)) and not s.add_event(event(2, 101.0))
    assert s.add_event(event(3, 102.0))
    # a restarted control plane numbers from 1 again, later in time
    assert s.add_event(event(1, 200.0))
    assert [e.seq for e in s.events] == [1, 2, 3, 1]
    # a 'dropped' marker (seq 0) always shows
    assert s.add_event(event(0, 150.0, "dropped"))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", True),
        ("corrupt", True),
        ("CORRUPT agent-2", True),
        ("kind:notice", True),
        ("kind:agent", False),
        ("sev:warn", True),
        ("sev:error", False),
        ("agent:agent-2", True),
        ("agent:agent-1", False),
        ("corrupt missing", False),
    ],
)
def test_filter(text, expected):
    e = event(5, 1.0, "notice", severity="warning", agent_id="agent-2", message="corrupt_block: block abc")
    assert matches_filter(e, text) is expected
