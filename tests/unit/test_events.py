"""EventBus: numbering, the recent-events ring, filtering, and slow subscribers that lose
their oldest events (with a marker) without ever blocking a publisher."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.core.events import DROPPED_KIND, EventBus


def test_publish_numbers_and_stamps_events():
    bus = EventBus(clock=lambda: 123.5)
    a = bus.publish("agent_joined", "a joined", agent_id="a")
    b = bus.publish("notice", "disk full", "warning", agent_id="a")
    assert (a.seq, b.seq) == (1, 2)
    assert a.unix_seconds == 123.5 and b.severity == "warning"
    assert [e.seq for e in bus.recent()] == [1, 2]
    assert [e.kind for e in bus.recent(("notice",))] == ["notice"]


@pytest.mark.parametrize("kind, severity", [("", "info"), ("x", "fatal")])
def test_publish_rejects_bad_input(kind, severity):
    with pytest.raises(ValueError):
        EventBus().publish(kind, "m", severity)


def test_ring_keeps_only_the_most_recent():
    bus = EventBus(capacity=3)
    for i in range(5):
        bus.publish("k", str(i))
    assert [e.message for e in bus.recent()] == ["2", "3", "4"]


def test_subscribe_replays_then_streams_live_without_gap_or_duplicate():
    bus = EventBus()
    bus.publish("a", "1")
    bus.publish("b", "2")
    sub = bus.subscribe(replay_recent=True)
    bus.publish("a", "3")
    assert [e.message for e in sub.drain()] == ["1", "2", "3"]
    live = bus.subscribe()
    bus.publish("a", "4")
    assert [e.message for e in live.drain()] == ["4"]


def test_kind_filter_applies_to_replay_and_live():
    bus = EventBus()
    bus.publish("a", "1")
    bus.publish("b", "2")
    sub = bus.subscribe(kinds=("b",), replay_recent=True)
    bus.publish("a", "3")
    bus.publish("b", "4")
    assert [e.message for e in sub.drain()] == ["2", "4"]


def test_slow_subscriber_drops_oldest_and_gets_a_marker():
    bus = EventBus()
    sub = bus.subscribe(maxsize=3)
    for i in range(10):
        bus.publish("k", str(i))
    got = sub.drain()
    assert got[0].kind == DROPPED_KIND and "dropped 7 events" in got[0].message
    assert [e.message for e in got[1:]] == ["7", "8", "9"]
    bus.publish("k", "10")
    assert [e.message for e in sub.drain()] == ["10"]  # no second marker


def test_get_times_out_and_close_wakes_a_blocked_reader():
    bus = EventBus()
    sub = bus.subscribe()
    assert sub.get(0.01) is None
    got = []
    reader = threading.Thread(target=lambda: got.append(sub.get(30)))
    reader.start()
    time.sleep(0.05)
    sub.close()
    reader.join(2)
    assert not reader.is_alive() and got == [None]
    assert bus.num_subscribers == 0
    bus.publish("k", "after close")  # nobody to deliver to; must not fail
    sub.close()  # idempotent


def test_a_blocked_reader_wakes_on_publish():
    bus = EventBus()
    sub = bus.subscribe()
    got = []
    reader = threading.Thread(target=lambda: got.append(sub.get(30)))
    reader.start()
    time.sleep(0.05)
    bus.publish("k", "hello")
    reader.join(2)
    assert got and got[0].message == "hello"


def test_publishers_never_block_on_a_reader_that_never_reads():
    bus = EventBus()
    bus.subscribe(maxsize=10)  # never read
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: [bus.publish("k", "m") for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert bus.last_seq == 8000
    assert time.monotonic() - start < 10


@given(st.lists(st.sampled_from(["a", "b", "c"]), max_size=60), st.integers(1, 10))
def test_a_subscriber_sees_an_increasing_subsequence_ending_at_the_newest(kinds, maxsize):
    bus = EventBus()
    sub = bus.subscribe(kinds=("a", "b"), maxsize=maxsize)
    published = [bus.publish(k, "m") for k in kinds]
    got = [e for e in sub.drain() if e.kind != DROPPED_KIND]
    seqs = [e.seq for e in got]
    assert seqs == sorted(set(seqs))
    wanted = [e.seq for e in published if e.kind in ("a", "b")]
    assert seqs == wanted[-maxsize:] if wanted else seqs == []


def test_the_event_kinds_published_documented_and_refreshed_by_agree():
    """admin.proto named kinds nothing published (eviction, leader) and left out three that
    were (policy, etcd_reset, dropped); the dashboard refreshed on the dead ones."""
    import ast
    import re
    from pathlib import Path

    from controlplane.core.events import EVENT_KINDS
    from dashboard.app import EVENT_TOPICS

    root = Path(__file__).resolve().parents[2]
    published = set()
    for path in [*root.joinpath("controlplane").rglob("*.py"), *root.joinpath("agent").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "publish" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    published.add(first.value)
    assert published and published <= set(EVENT_KINDS), published - set(EVENT_KINDS)
    assert set(EVENT_KINDS) - published == {DROPPED_KIND}  # the bus makes that one itself
    proto = root.joinpath("protos/kvcp/v1/admin.proto").read_text()
    comment = re.search(r"string kind = 3;(.*?)string severity", proto, re.S).group(1)
    assert set(re.findall(r"[a-z_]+", comment.replace("controlplane/core/events.py EVENT_KINDS", ""))) == set(
        EVENT_KINDS
    )
    assert set(EVENT_TOPICS) <= set(EVENT_KINDS), set(EVENT_TOPICS) - set(EVENT_KINDS)
