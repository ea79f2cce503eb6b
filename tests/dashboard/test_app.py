"""The dashboard app on fixed views (`live=False`, as the snapshots): timing corners that
a snapshot does not show, driven through the app's own update methods and Pilot."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from textual.widgets import DataTable, Sparkline, Static

from cli.client import PinView
from dashboard.app import DashboardApp
from dashboard.screens import PinsScreen
from tests.dashboard import sample

SIZE = (80, 24)


def pin(pin_id: str) -> PinView:
    return PinView(pin_id, "ns", "", "cpu", 0, 0, True, "", "", sample.NOW - 10, sample.NOW + 600)


def test_clock_tick_before_the_pins_rebuild_skips_pins_not_in_the_table():
    """Pins change while another screen is in view; back on Pins, the 1 s clock may tick
    before the resume rebuild: the TTL update must skip the new pin, not crash the app."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            app.apply_pins([pin("pin-a")])
            await pilot.press("p")
            await pilot.pause()
            await pilot.press("c")
            await pilot.pause()
            app.apply_pins([pin("pin-b")])  # a refresh while the Cluster screen is in view
            await app.switch_mode("pins")
            app._clock_tick()  # before ScreenResume is handled
            await pilot.pause()
            assert isinstance(app.screen, PinsScreen)
            table = app.screen.query_one("#pins", DataTable)
            assert "pin-b" in table.rows and "pin-a" not in table.rows
        assert app.return_code is None

    asyncio.run(scenario())


def test_sparklines_never_get_a_single_point():
    """One value alone fills a Sparkline from top to bottom: with under two samples' worth
    of rates the Cluster screen shows an empty line, not a full block."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            series = sample.stats_series()
            for n in (1, 2, 3):
                at, stats = series[n - 1]
                app.apply_stats(stats, at)
                await pilot.pause()
                for key in ("lookups", "hit", "moved"):
                    data = list(app.screen.query_one(f"#spark-{key}", Sparkline).data or [])
                    assert len(data) != 1, (n, key, data)
            assert len(app.screen.query_one("#spark-lookups", Sparkline).data) == 2  # three samples: two rates

    asyncio.run(scenario())


def test_the_cluster_screen_says_when_the_policy_evicts_most_recent_first():
    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=(120, 30)) as pilot:
            at, stats = sample.stats_series()[-1]
            app.apply_stats(stats, at)
            await pilot.pause()
            assert "most recent first" not in str(app.screen.query_one("#totals", Static).render())
            app.apply_stats(replace(stats, policy_recent_first=True), at + 2)
            await pilot.pause()
            assert "most recent first" in str(app.screen.query_one("#totals", Static).render())

    asyncio.run(scenario())


def test_a_result_arriving_while_the_app_shuts_down_is_dropped():
    """At exit Textual removes a screen's widgets before the screen itself, and the app's
    own unmount comes after both: a refresh result handled in between (a loaded CI machine
    saw one) finds the screen still mounted with #totals already gone. It is dropped."""
    seen = []

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            totals = app.screen.query_one("#totals", Static)
            real_exit = totals._message_loop_exit

            async def exit_then_a_result() -> None:
                await real_exit()  # #totals is out of the DOM now, its screen not yet
                seen.append(app.screen.is_mounted and not app.screen.query("#totals"))
                app.apply_agents(sample.agents())

            totals._message_loop_exit = exit_then_a_result
        assert app.return_code is None

    asyncio.run(scenario())
    assert seen == [True]  # the result did come in that window


def test_the_pin_form_reads_token_ids_as_kvctl_does():
    """The form took '1_000', other scripts' digits and '1,,2' (int() over split()) and
    pinned another prefix than the one typed; kvctl --tokens refuses them."""
    from textual.widgets import Input

    from dashboard.screens import PinForm

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            form = PinForm()
            await app.push_screen(form)
            await pilot.pause()
            form.query_one("#pin-model", Input).value = "demo-model"
            outcomes = {}
            for text in ("1_000, 2", "\u0663\u0664", "1,,2", "+7", "1, 2 3", "[4, 5]", "4294967296"):
                form.query_one("#pin-tokens", Input).value = text
                try:
                    outcomes[text] = form.request()["token_ids"]
                except ValueError as exc:
                    outcomes[text] = str(exc)
            return outcomes

    got = asyncio.run(scenario())
    assert got["1, 2 3"] == [1, 2, 3] and got["[4, 5]"] == [4, 5]
    for bad in ("1_000, 2", "\u0663\u0664", "1,,2", "+7"):
        assert got[bad].startswith("tokens: token ids must be integers"), got[bad]
    assert got["4294967296"] == "tokens: token id 4294967296 is out of range [0, 2^32)"


def test_the_top_line_names_the_replica_that_did_not_answer():
    """The dashboard's top line shows the client's error: with several replicas, the one
    that timed out is named, not the next one the client moves on to (it named the replica
    that had taken over as leader as the one not answering)."""
    import socket

    from cli.client import ClientError, ControlPlaneClient

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # takes the connection, never answers (a SIGSTOPped leader)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other = f"127.0.0.1:{s.getsockname()[1]}"
    hung_at = f"127.0.0.1:{hung.getsockname()[1]}"
    try:
        with ControlPlaneClient(f"{hung_at},{other}", timeout_seconds=0.5) as client:
            try:
                client.stats()
            except ClientError as exc:
                assert exc.code == "DEADLINE_EXCEEDED"
                assert hung_at in str(exc) and other not in str(exc)
            else:
                raise AssertionError("a replica that never answers answered")
            assert client.endpoint == other  # the next call starts at the next replica
    finally:
        hung.close()


def test_the_sparkline_labels_claim_no_current_rate_while_the_control_plane_is_lost():
    """'lookups/s 5.0', 'hit ratio now 86%' stayed on screen as if live for as long as the
    control plane was gone (the labels were redrawn only on new stats); the line above says
    'last known at', and the labels say they have no current value."""
    from textual.widgets import Label

    from dashboard.state import RECONNECTING

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=SIZE) as pilot:
            sample.load(app)
            await pilot.pause()

            def labels() -> list[str]:
                return [
                    str(app.screen.query_one(f"#spark-{k}-label", Label).render()) for k in ("lookups", "hit", "moved")
                ]

            assert all(any(ch.isdigit() for ch in text) for text in labels()), labels()
            app.apply_connection(RECONNECTING, "cannot reach the kvcp control plane at 127.0.0.1:50051 (unavailable)")
            await pilot.pause()
            assert not any(any(ch.isdigit() for ch in text) for text in labels()), labels()

    asyncio.run(scenario())


def test_a_row_drawn_before_the_table_measured_it_is_drawn_again_at_its_widths():
    """A CI run's Cluster screen showed `dash-  127.0.0` for `dash-a1  127.0.0.1:40905`
    for 30 s: DataTable drew the row before it measured it (the widths still the headers'),
    kept that drawing when the columns widened (its caches' key ignores widths), and a
    table of fixed height has no resize to redraw it. A plain DataTable fails this."""
    from textual.app import App

    from dashboard.screens import Table

    class OneTable(App):
        CSS = "Table { height: 8; }"

        def compose(self):
            yield Table()

    async def scenario():
        app = OneTable()
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one(Table)
            table.add_column("AGENT", key="agent")
            table.add_column("ADDRESS", key="address")
            await pilot.pause()
            table.add_row("dash-a1", "127.0.0.1:40905", key="a1")
            assert "dash-  127.0.0 " in table.render_line(1).text  # drawn before it was measured
            await pilot.pause()
            await pilot.pause()
            assert "dash-a1  127.0.0.1:40905" in table.render_line(1).text

    asyncio.run(scenario())
