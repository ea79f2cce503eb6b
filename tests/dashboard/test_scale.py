"""The dashboard at a fleet's size: hundreds of agents and pins, a busy event stream, a
full event log. What is checked is the work done per refresh and what the operator keeps
(scroll position, cursor), not how long it takes: the timings are in the review that
measured them."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

from rich.text import Text
from textual.widgets import DataTable, RichLog

from cli.client import AgentView, EventView, TierView
from dashboard import app as app_module
from dashboard.app import DashboardApp, EventReceived
from dashboard.screens import EventsScreen
from tests.dashboard import sample

SIZE = (80, 24)
MiB = 1 << 20


def fleet(n: int, blocks: int = 100, ids=None) -> list[AgentView]:
    return [
        AgentView(
            f"agent-{i:04d}",
            f"10.0.0.{i % 250}:50061",
            "ready",
            blocks,
            [TierView("gpu", 64 * MiB, 10 * MiB, 10), TierView("cpu", 256 * MiB, 20 * MiB, 20)],
            ["m"],
            1,
            100,
            50,
            sample.NOW,
        )
        for i in (range(n) if ids is None else ids)
    ]


def event(seq: int, kind: str = "agent_state", agent_id: str = "agent-0001") -> EventView:
    return EventView(seq, sample.NOW + seq, kind, "info", agent_id, "", "", f"{agent_id} event {seq}")


def counting(obj, name: str) -> list[int]:
    """Count the calls of `obj.name` (still calling it)."""
    calls = [0]
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def test_a_refresh_of_300_agents_keeps_the_scroll_position_and_redraws_only_what_changed():
    """Every refresh cleared the agents table and added every row again: the view jumped
    back to the cursor (an operator scrolling through 300 agents was sent back every 2 s)
    and every row was laid out anew even when nothing had changed. Rows stay now, and only
    the cells whose values changed are updated."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            app.apply_agents(fleet(300))
            await pilot.pause()
            table = app.screen.query_one("#agents", DataTable)
            assert table.row_count == 300
            table.scroll_to(y=200, animate=False)
            await pilot.pause()
            assert table.scroll_y == 200
            cleared = counting(table, "clear")
            updated = counting(table, "update_cell")

            app.apply_agents(fleet(300))  # nothing changed
            await pilot.pause()
            assert (cleared[0], updated[0]) == (0, 0)

            agents = fleet(300)
            agents[150] = replace(agents[150], num_blocks=777)
            app.apply_agents(agents)  # one agent's block count changed
            await pilot.pause()
            assert cleared[0] == 0 and updated[0] == 1
            assert table.get_cell("agent-0150", "blocks") == "777"
            assert table.scroll_y == 200 and table.cursor_row == 0

    asyncio.run(scenario())


def test_agents_that_leave_are_gone_from_the_table_and_the_cursor_stays_on_its_agent():
    """Agents come and go: the table shows the fleet as listed, an agent that left is no
    longer a row, and the cursor stays on the agent it was on."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            app.apply_agents(fleet(200))
            await pilot.pause()
            table = app.screen.query_one("#agents", DataTable)
            table.move_cursor(row=120)
            await pilot.pause()
            for step in range(1, 6):  # a sliding window: 10 leave, 10 join, each time
                app.apply_agents(fleet(0, ids=range(10 * step, 200 + 10 * step)))
                await pilot.pause()
            keys = [r.key.value for r in table.ordered_rows]
            assert keys == [f"agent-{i:04d}" for i in range(50, 250)]
            assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "agent-0120"

    asyncio.run(scenario())


def test_agents_joining_or_leaving_keep_the_other_rows_and_the_cursor_on_its_agent():
    """A join or leave changed the list of keys, and the whole table was cleared and its
    300 rows added and laid out again (0.2 s a join on a 2-core host, the view sent back to
    the cursor). The rows that stay are kept, the rows that left are removed and the new
    ones go in their places, at the top, in the middle or at the end; the cursor stays on
    its agent and the view where it was. Only rows that change order rebuild the table."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            ids = list(range(2, 600, 2))  # even ids: odd ones join in between
            app.apply_agents(fleet(0, ids=ids))
            await pilot.pause()
            table = app.screen.query_one("#agents", DataTable)
            table.move_cursor(row=100)  # agent-0202
            table.scroll_to(y=150, animate=False)
            await pilot.pause()
            cleared = counting(table, "clear")

            def shown() -> list[str]:
                return [r.key.value for r in table.ordered_rows]

            def at_cursor() -> str:
                return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

            for step in (
                [0] + ids,  # one joins at the top
                ids[1:],  # one leaves at the top
                sorted([*ids, 151]),  # joins in the middle, above the cursor
                [i for i in ids if i != 150],  # leaves in the middle, above the cursor
                sorted([*ids, 403, 405]),  # two join below the cursor
                [*ids, 601],  # joins at the end
                ids[:-1],  # leaves at the end
                sorted([*ids[:-2], 1, 301, 599]),  # some leave and some join at once
            ):
                before = {r.key.value: r for r in table.ordered_rows}
                app.apply_agents(fleet(0, ids=step))
                await pilot.pause()
                assert shown() == [f"agent-{i:04d}" for i in step]
                assert at_cursor() == "agent-0202" and table.scroll_y == 150
                assert all(table.rows[key] is row for key, row in before.items() if key in table.rows)
                assert table.get_row("agent-0202")[0].plain == "agent-0202"
            assert cleared[0] == 0

            app.apply_agents(fleet(0, ids=[*reversed(ids)]))  # the order changed: rebuilt
            await pilot.pause()
            assert cleared[0] == 1
            assert shown() == [f"agent-{i:04d}" for i in reversed(ids)]
            assert at_cursor() == "agent-0202"

    asyncio.run(scenario())


def test_a_cell_that_only_changes_colour_is_updated():
    """Rich's Text compares characters and spans, not the style: an operation's
    'done/total' turning red when blocks fail must still be redrawn."""
    from dashboard.screens import _same_cell

    assert not _same_cell(Text("4/10", style="red"), Text("4/10"))
    assert _same_cell(Text("4/10", style="red"), Text("4/10", style="red"))
    assert not _same_cell("4/10", Text("4/10"))


class QuietClient:
    """A control plane that answers at once with fixed views and whose event stream stays
    open with nothing on it; counts the ListAgents calls."""

    endpoint = "fake:1"

    def __init__(self, closed: threading.Event, calls: list[int]):
        self.closed, self.calls = closed, calls

    def use_endpoint(self, endpoint: str) -> None:
        pass

    def close(self) -> None:
        self.closed.set()

    def list_agents(self):
        self.calls[0] += 1
        return fleet(3)

    def stats(self):
        return sample.stats_series()[0][1]

    def list_pins(self):
        return []

    def list_operations(self, max_operations: int = 100):
        return []

    def watch(self, replay_recent: bool = True, kinds=()):
        self.closed.wait(30)
        return iter(())


def test_a_busy_event_stream_does_not_refetch_the_fleet_after_every_batch(monkeypatch):
    """Each agent_state, notice or op_state event asked for the agents again, and a batch
    in flight only merged the requests until it came back: on a busy stream the dashboard
    listed and redrew 300 agents back to back (a whole core, keys answered 0.4 s late, and
    as many ListAgents calls on the control plane). Refreshes that events ask for start no
    sooner than a gap after the previous batch; a refresh the operator asks for (r) starts
    at once, with what the events asked for merged into it."""
    monkeypatch.setattr(app_module, "EVENT_FETCH_GAP_SECONDS", 3600.0, raising=False)
    closed, calls = threading.Event(), [0]

    async def scenario():
        app = DashboardApp(live=True, refresh_seconds=3600.0, connect=lambda: QuietClient(closed, calls))
        async with app.run_test(size=SIZE) as pilot:
            for _ in range(100):
                await pilot.pause(0.02)
                if calls[0] and not app._fetching:
                    break
            assert calls[0] == 1 and not app._fetching  # the first refresh, done
            for seq in range(1, 51):
                app.post_message(EventReceived(event(seq)))
            for _ in range(10):
                await pilot.pause(0.02)
            assert len(app.state.events) == 50
            assert calls[0] == 1 and "agents" in app._pending  # waiting for the gap, merged into one
            await pilot.press("r")
            for _ in range(100):
                await pilot.pause(0.02)
                if calls[0] == 2 and not app._fetching:
                    break
            assert calls[0] == 2 and not app._pending

    asyncio.run(scenario())


def test_coming_back_to_the_events_screen_writes_only_the_new_events():
    """Each visit to the Events screen cleared the log and wrote every event again (about
    a second at 2000 events on a 2-core host, keys waiting meanwhile); it writes only what
    came in while another screen was in view."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=(120, 30)) as pilot:
            for seq in range(1, 301):
                app.apply_event(event(seq))
            await pilot.press("e")
            await pilot.pause()
            log = app.screen.query_one("#log", RichLog)
            assert len(log.lines) == 300
            cleared = counting(log, "clear")
            await pilot.press("c")
            await pilot.pause()
            for seq in range(301, 311):
                app.apply_event(event(seq))
            await pilot.press("e")
            await pilot.pause()
            assert cleared[0] == 0
            assert len(log.lines) == 310
            assert "event 310" in log.lines[-1].text
            app.apply_event(event(311))  # and on screen, one at a time as before
            await pilot.pause()
            assert len(log.lines) == 311 and cleared[0] == 0

    asyncio.run(scenario())


def test_the_event_filter_is_applied_when_typing_pauses_not_at_every_key(monkeypatch):
    """Each key typed into the filter rewrote the whole log (seconds per key at 2000
    events); it is applied once typing pauses, or at once on Enter."""
    monkeypatch.setattr(EventsScreen, "FILTER_DELAY_SECONDS", 3600.0, raising=False)

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=(120, 30)) as pilot:
            for seq in range(1, 201):
                app.apply_event(event(seq, agent_id=f"agent-{seq % 20:04d}"))
            await pilot.press("e")
            await pilot.pause()
            log = app.screen.query_one("#log", RichLog)
            cleared = counting(log, "clear")
            await pilot.press("slash", *"agent-0007")
            await pilot.pause()
            assert cleared[0] == 0 and len(log.lines) == 200
            await pilot.press("enter")
            await pilot.pause()
            assert cleared[0] == 1 and len(log.lines) == 10
            assert all("agent-0007" in line.text for line in log.lines)

    asyncio.run(scenario())
