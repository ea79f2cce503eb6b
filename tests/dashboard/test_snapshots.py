"""SVG snapshots (pytest-textual-snapshot's SVG extension of syrupy) of each screen at
80x24 with fixed data: the views of tests/dashboard/sample.py go through the app's own
update methods (as its workers' results do), with the clock frozen and no connection
(`live=False`). One app run walks every screen, since on two cores each app start costs
about a second. Update after a deliberate change with
`pytest tests/dashboard/test_snapshots.py --snapshot-update` and look at the SVGs
(tests/dashboard/__snapshots__/) before committing.

`KVCP_UPDATE_DOCS=1` also rewrites the README's screenshot, docs/dashboard.svg."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from pytest_textual_snapshot import SVGImageExtension
from textual.widgets import Input

from cli.client import ClientError
from dashboard.app import DashboardApp
from dashboard.state import RECONNECTING
from tests.dashboard import sample
from tests.dashboard.screen import screen_text

DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.svg"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    """Event times print in local time; pin it so snapshots match anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def frozen_app() -> DashboardApp:
    return DashboardApp("127.0.0.1:50051", live=False, clock=lambda: sample.NOW)


async def settle(pilot) -> None:
    await pilot.pause()
    # a blinking text cursor would make a snapshot depend on timing
    for widget in pilot.app.screen.query(Input):
        widget.cursor_blink = False
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def not_available(app) -> None:
    app.state.pins, app.state.operations = [], []
    app.apply_pins(ClientError("UNIMPLEMENTED", "Method not implemented!"))
    app.apply_operations(ClientError("UNIMPLEMENTED", "Method not implemented!"))


def lost(app) -> None:
    app.apply_connection(RECONNECTING, "cannot reach the kvcp control plane at 127.0.0.1:50051 (unavailable)")


def etcd_unreachable(app) -> None:
    """Back, but as a leader cut off from etcd: it answers reads from memory."""
    import dataclasses

    app.apply_connection("connected")
    at, stats = sample.stats_series()[-1]
    app.apply_stats(dataclasses.replace(stats, is_leader=False), at + 2)


# (snapshot name, keys pressed from the previous step, update applied before the keys)
STEPS = [
    ("cluster", (), None),
    ("agent", ("enter",), None),
    ("pins", ("escape", "p"), None),
    ("pin-form", ("n",), None),
    ("operations", ("escape", "o"), None),
    ("cancel-confirm", ("x",), None),  # the same dialog confirms an unpin
    ("events", ("n", "e"), None),
    ("help", ("question_mark",), None),
    ("reconnecting", ("escape", "c"), lost),
    ("pins-not-available", ("p",), not_available),
    ("etcd-unreachable", ("c",), etcd_unreachable),
]


def test_every_screen(snapshot):
    snapshot = snapshot.use_extension(SVGImageExtension)

    async def walk() -> dict[str, str]:
        shots = {}
        app = frozen_app()
        async with app.run_test(size=(80, 24)) as pilot:
            sample.load(app)
            for name, keys, update in STEPS:
                if update is not None:
                    update(app)
                await pilot.press(*keys)
                await settle(pilot)
                shots[name] = app.export_screenshot(simplify=True)
        return shots

    shots = asyncio.run(walk())
    mismatched = [name for name, svg in shots.items() if not snapshot(name=name) == svg]
    assert not mismatched, f"screens differ from their snapshots: {mismatched} (see tests/dashboard/__snapshots__)"


def test_readme_screenshot():
    """docs/dashboard.svg is the Cluster screen with the sample data, at 100x30."""

    async def shoot() -> str:
        app = frozen_app()
        async with app.run_test(size=(100, 30)) as pilot:
            sample.load(app)
            await settle(pilot)
            if os.environ.get("KVCP_UPDATE_DOCS") == "1" or not DOCS_SCREENSHOT.exists():
                DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
                app.save_screenshot(DOCS_SCREENSHOT.name, str(DOCS_SCREENSHOT.parent))
            return screen_text(app)

    text = asyncio.run(shoot())
    svg = DOCS_SCREENSHOT.read_text()
    for agent in sample.agents():
        assert agent.agent_id in text and agent.agent_id in svg
