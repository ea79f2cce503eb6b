"""The agent's pin file (agent/store/pin_file.py): what a restart reads back."""

from __future__ import annotations

from agent.core.pins import AgentPin
from agent.store.pin_file import PinFile


def test_round_trip_counts_time_left_and_drops_what_ran_out(tmp_path):
    f = PinFile(tmp_path)
    h = bytes(range(16))
    pins = [
        AgentPin("a", 3, 1000.0 + 30.0, "", frozenset({h}), "v1"),  # 30 s left
        AgentPin("ns", 2, 0.0, "kb", frozenset(), "v2"),  # until unpinned
        AgentPin("gone", 2, 1000.0 + 5.0, "", frozenset({h}), "v3"),  # 5 s left
    ]
    f.save(pins, monotonic_now=1000.0, unix_now=50_000.0)
    # read back 10 s later by a process whose monotonic clock starts elsewhere
    back = {p.pin_id: p for p in f.load(monotonic_now=7.0, unix_now=50_010.0)}
    assert set(back) == {"a", "ns"}
    assert abs(back["a"].expires_monotonic_seconds - 27.0) < 1e-6 and back["a"].block_hashes == {h}
    assert back["a"].version == "v1" and back["a"].tier == 3
    assert back["ns"].expires_monotonic_seconds == 0.0 and back["ns"].namespace == "kb"


def test_a_missing_or_torn_file_restores_nothing(tmp_path):
    f = PinFile(tmp_path)
    assert f.load() == []
    f.path.write_text('{"pins": [{"pin_id": "a", "tier": 2, "expires_unix')
    assert f.load() == []


def test_the_file_is_the_owners_only_and_no_planted_link_is_followed(tmp_path):
    import os
    import stat

    victim = tmp_path / "elsewhere"
    victim.write_text("keep me")
    (tmp_path / "pins.tmp").symlink_to(victim)  # planted where the file is written first
    f = PinFile(tmp_path)
    f.save([AgentPin("a", 2, 0.0, "kb", frozenset(), "v")], monotonic_now=0.0, unix_now=1.0)
    assert stat.S_IMODE(os.stat(f.path).st_mode) == 0o600
    assert victim.read_text() == "keep me"
    assert [p.pin_id for p in f.load()] == ["a"]


def test_a_pin_table_save_that_failed_is_tried_again():
    """The saver cleared its flag before saving: one ENOSPC and nothing was saved until
    the next pin command, nor at stop (a review). It is tried again a second later."""
    import errno
    import threading
    import time
    import types

    from agent.server import Agent

    calls = []

    def save():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    saver = types.SimpleNamespace(_pins_dirty=threading.Event(), _save_pins=save)
    stop = threading.Event()
    t = threading.Thread(target=Agent._pin_saver, args=(saver, stop), daemon=True)
    t.start()
    saver._pins_dirty.set()  # one pin command; the volume is full at first, then not
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    t.join(5)
    assert len(calls) == 2 and not saver._pins_dirty.is_set()
