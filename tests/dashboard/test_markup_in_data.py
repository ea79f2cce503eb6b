"""Text from the cluster or the keyboard is shown as text, never read as Rich markup: a pin
owner '[/x]' crashed every dashboard that showed the Pins screen, an IPv6 address lost its
host, and tokens typed with brackets or a server's error text crashed the app (a review)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from textual.widgets import DataTable, Input

from cli.client import ClientError, PinView
from dashboard.app import DashboardApp
from dashboard.screens import PinForm
from tests.dashboard import sample


def run(steps, size=(100, 30)):
    """Run the app headless through `steps(app, pilot)`; the app's error, if it failed."""

    async def scenario():
        app = DashboardApp(live=False, clock=lambda: sample.NOW)
        async with app.run_test(size=size) as pilot:
            await steps(app, pilot)
            await pilot.pause()
        return app._exception

    return asyncio.run(scenario())


def test_a_pin_owner_with_markup_is_shown_as_written():
    shown = {}

    async def steps(app, pilot):
        await pilot.press("p")
        await pilot.pause()
        pin = PinView("pin-a", "ns", "", "cpu", 0, 0, True, "", "[/x]", sample.NOW - 10, sample.NOW + 600)
        app.apply_pins([pin])
        await pilot.pause()
        shown["owner"] = str(app.screen.query_one("#pins", DataTable).get_row_at(0)[-1])

    assert run(steps) is None
    assert shown["owner"] == "[/x]"


def test_an_ipv6_agent_address_keeps_its_host():
    shown = {}

    async def steps(app, pilot):
        app.apply_agents([replace(sample.agents()[0], address="[fd00::5]:50061")])
        await pilot.pause()
        shown["address"] = str(app.screen.query_one("#agents", DataTable).get_row_at(0)[1])
        shown["screen"] = app.export_screenshot()  # as drawn: a markup string loses "[fd00::5]" there

    assert run(steps) is None
    assert shown["address"] == "[fd00::5]:50061"
    assert "[fd00::5]:50061" in shown["screen"].replace("&#160;", " ")


def test_a_cordoned_agent_is_shown_so_with_its_reason_as_written():
    shown = {}

    async def steps(app, pilot):
        app.apply_agents([replace(sample.agents()[0], cordon_reason="GPU [Xid 79] fell off the bus")])
        await pilot.pause()
        shown["state"] = str(app.screen.query_one("#agents", DataTable).get_row_at(0)[2])

    assert run(steps) is None
    assert shown["state"] == "ready cordoned"


def test_tokens_typed_with_brackets_are_an_error_not_a_crash():
    async def steps(app, pilot):
        form = PinForm()
        await app.push_screen(form)
        await pilot.pause()
        form.query_one("#pin-model", Input).value = "demo-model"
        form.query_one("#pin-tokens", Input).value = "1 [/x]"
        form.query_one("#pin-tokens", Input).focus()
        await pilot.pause()
        await pilot.press("enter")

    assert run(steps, size=(80, 24)) is None


def test_a_servers_error_text_with_brackets_is_shown():
    async def steps(app, pilot):
        await pilot.press("p")
        await pilot.pause()
        app.apply_pins(ClientError("INVALID_ARGUMENT", "namespace [/bad] is not valid"))

    assert run(steps, size=(80, 24)) is None
