"""The dashboard's screens. Each one renders from the app's `DashboardState` in
`show(topics)` (called by the app when a topic it shows changes, and when the screen comes
back into view) and asks the app for actions (pin, unpin, cancel); none of them calls
the control plane itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widgets import Button, DataTable, Footer, Input, Label, RichLog, Select, Sparkline, Static

from cli.tokens import parse_token_ids
from dashboard import render
from dashboard.state import CONNECTED, CONNECTING, EVENT_LOG_SIZE, RECONNECTING, DashboardState, matches_filter

if TYPE_CHECKING:
    from dashboard.app import DashboardApp

ALL_TOPICS = frozenset({"connection", "agents", "stats", "pins", "operations", "events", "clock"})


class StatusLine(Static):
    """Top line of every screen: where we are connected and in what state."""

    def show(self, state: DashboardState, endpoint: str, title: str) -> None:
        marks = {
            CONNECTED: ("●", "connected", "green"),
            CONNECTING: ("◌", "connecting", "yellow"),
            RECONNECTING: ("◌", "reconnecting", "bold red"),
        }
        dot, word, style = marks[state.connection]
        text = Text()
        text.append(" kvcp ", style="bold reverse")
        text.append(f" {title}  ", style="bold")
        text.append(f"{endpoint}  ")
        text.append(f"{dot} {word}", style=style)
        if state.connection != CONNECTED and state.connection_detail:
            text.append(f": {state.connection_detail}", style="dim")
        if state.watch_available is False:
            text.append("  (live events not available)", style="dim")
        self.update(text)
        self.set_class(state.connection == RECONNECTING, "-reconnecting")


class Table(DataTable):
    """A DataTable whose rows are laid out again when its columns widen. DataTable keys the
    renders it caches by a count of changes that a column's new width does not bump, so a
    row drawn before the table measured it (widths still the headers') kept that narrower
    layout in a table of fixed height (no resize to bump the count) until the next change:
    the Cluster screen showed `dash-  127.0.0` for `dash-a1  127.0.0.1:40905` for 30 s in a
    CI run. (Both methods are DataTable's own, run when it is idle; where a Textual lacks
    them, the overrides are never called.)"""

    def _column_widths(self) -> list[int]:
        return [c.content_width for c in self.columns.values()]

    def _redrawn_if_widths_changed(self, before: list[int]) -> None:
        if self._column_widths() != before:
            self._update_count += 1  # (the caches' key)
            self.refresh()

    def _update_column_widths(self, updated_cells) -> None:
        before = self._column_widths()
        super()._update_column_widths(updated_cells)
        self._redrawn_if_widths_changed(before)

    def _update_dimensions(self, new_rows) -> None:
        before = self._column_widths()
        super()._update_dimensions(new_rows)
        self._redrawn_if_widths_changed(before)


def _same_cell(a: object, b: object) -> bool:
    """Whether two cell values draw the same. Rich compares Text by its characters and
    spans alone, so a cell that only changed colour (a count turning red) would look the same."""
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and str(a.style) == str(b.style) and a.spans == b.spans
    return type(a) is type(b) and a == b


def sync_rows(table: DataTable, rows: list[tuple[str, tuple, int]]) -> None:
    """Show `rows` (key, cells, height) in `table`. The rows already shown stay when the
    keys still listed come in the same order with the same heights (a refresh, agents that
    joined or left): the rows no longer listed are removed, only the cells that changed are
    updated and new rows are added in their places. The cursor stays on its row and the view
    where the operator scrolled it; a refresh that changed nothing redraws nothing, and a
    join or leave in a fleet of hundreds lays out one row, not all of them. Otherwise (rows
    re-ordered, a height changed) the table is rebuilt, with the cursor on the row it was
    on when that row is still there."""
    listed = {key for key, _, _ in rows}
    kept = [(r.key.value, r.height) for r in table.ordered_rows if r.key.value in listed]
    selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value if table.row_count else None
    if kept == [(key, height) for key, _, height in rows if key in table.rows] and _sync_in_place(table, rows):
        if selected in listed and table.get_row_index(selected) != table.cursor_row:
            # rows above it came or went: the cursor follows its row, and the view stays
            # (a moved cursor is scrolled into view after the next refresh; undone after it)
            x, y = table.scroll_x, table.scroll_y
            table.move_cursor(row=table.get_row_index(selected), animate=False, scroll=False)
            table.call_after_refresh(table.scroll_to, x, y, animate=False)
        return
    table.clear()
    for key, cells, height in rows:
        table.add_row(*cells, key=key, height=height)
    if selected in listed:
        table.move_cursor(row=table.get_row_index(selected), animate=False)


def _sync_in_place(table: DataTable, rows: list[tuple[str, tuple, int]]) -> bool:
    """`sync_rows` when the rows still listed keep their order and heights. False when
    the new rows could not be put in their places (the caller rebuilds the table)."""
    listed = {key for key, _, _ in rows}
    for row in table.ordered_rows:
        if row.key.value not in listed:
            table.remove_row(row.key)
    columns = [c.key for c in table.ordered_columns]
    added = False
    for key, cells, height in rows:
        if key in table.rows:
            for column, new, old in zip(columns, cells, table.get_row(key), strict=True):
                if not _same_cell(new, old):
                    table.update_cell(key, column, new)
        else:
            table.add_row(*cells, key=key, height=height)
            added = True
    if not added or [r.key.value for r in table.ordered_rows] == [key for key, _, _ in rows]:
        return True
    # add_row appends and DataTable has no insert, but its sort only re-indexes the rows
    # it has. Its key function is given a row's cells, not its key: a row is told apart
    # by its first cell, the very object stored in it, unless rows share that object.
    position = {id(table.get_row(key)[0]): index for index, (key, _, _) in enumerate(rows)}
    if len(position) < len(rows):
        return False
    table.sort(key=lambda cells: position[id(cells[0])])
    return True


class DashboardScreen(Screen):
    TITLE = ""
    REFRESH_ON_VIEW: tuple[str, ...] = ()  # fetched afresh whenever the screen comes into view

    @property
    def dash(self) -> DashboardApp:
        return self.app  # type: ignore[return-value]

    @property
    def state(self) -> DashboardState:
        return self.dash.state

    def compose_status(self) -> ComposeResult:
        yield StatusLine(id="status")

    def on_screen_resume(self) -> None:
        self.show(ALL_TOPICS)
        if self.REFRESH_ON_VIEW:
            self.dash.request_refresh(*self.REFRESH_ON_VIEW)

    def show(self, topics: frozenset[str]) -> None:
        if "connection" in topics:
            self.query_one(StatusLine).show(self.state, self.dash.endpoint, self.TITLE)
        self.show_data(topics)

    def show_data(self, topics: frozenset[str]) -> None:
        pass

    def event_added(self, event) -> None:
        """A new event arrived while this screen is in view."""


# ---- cluster ---------------------------------------------------------------------------


class ClusterScreen(DashboardScreen):
    TITLE = "Cluster"
    BINDINGS = [Binding("enter", "open_agent", "Agent detail", show=True)]

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield Static(id="totals")
        with Horizontal(id="sparks"):
            for key in ("lookups", "hit", "moved"):
                with Vertical(classes="spark"):
                    yield Label(id=f"spark-{key}-label", classes="spark-label")
                    yield Sparkline([], id=f"spark-{key}")
        yield Table(id="agents", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#agents", DataTable)
        table.add_column("AGENT", key="agent")
        table.add_column("ADDRESS", key="address")
        table.add_column("STATE", key="state")
        table.add_column("TIERS used/capacity", key="tiers")
        table.add_column("BLOCKS", key="blocks")
        table.add_column("HIT", key="hit")

    def show_data(self, topics: frozenset[str]) -> None:
        if topics & {"stats", "connection", "agents"}:
            self._show_totals()
        if topics & {"stats", "connection"}:
            self._show_sparks()
        if "agents" in topics:
            self._show_agents()

    def _show_totals(self) -> None:
        s = self.state.stats
        text = Text()
        if s is None:
            text.append(self.state.stats_error or "waiting for the control plane…", style="dim")
        else:
            if self.state.connection != CONNECTED and self.state.samples:
                at = render.clock_time(self.state.samples[-1].at_unix_seconds)
                text.append(f"last known at {at}; the control plane is not answering", style="bold yellow")
            elif self.state.stats_error:
                # answering, but no leader: elections need etcd
                text.append("no leader", style="bold red")
                text.append(f": {self.state.stats_error}; etcd may be down", style="yellow")
            elif s.is_leader:
                text.append("leader ", style="bold")
                text.append(f"{s.leader_address} (epoch {s.epoch})  ")
                text.append("etcd ", style="bold")
                text.append("ok", style="green")
            else:
                # answered, but not as an elected leader: one cut off from etcd serves from memory
                text.append("leader ", style="bold")
                text.append(f"{s.leader_address or 'none'} answers from memory (possibly stale)  ")
                text.append("etcd ", style="bold")
                text.append("unreachable", style="bold red")
            text.append("\n")
            text.append("agents ", style="bold")
            text.append(f"{s.num_agents}  ")
            text.append("blocks ", style="bold")
            text.append(f"{s.num_blocks}  ")
            text.append("replicas ", style="bold")
            text.append(f"{s.num_block_replicas}  ")
            text.append("lookups ", style="bold")
            text.append(f"{s.lookups_total}  ")
            text.append("hit ", style="bold")
            text.append(f"{s.hit_ratio:.1%}  ")
            text.append("resyncs ", style="bold")
            text.append(f"{s.resyncs_total}")
            if s.policy_recent_first:  # the tier policy switched order: worth seeing at a glance
                text.append("  policy ", style="bold")
                text.append("most recent first (loops larger than the cache)", style="yellow")
            for t in s.tiers:
                text.append("\n")
                text.append_text(render.usage_bar(t.used_bytes, t.capacity_bytes, t.tier, width=20))
                text.append(
                    f"  {render.bytes_text(t.used_bytes)}/{render.bytes_text(t.capacity_bytes)}, {t.num_blocks} blocks"
                    + render.parked_suffix(t)
                )
        self.query_one("#totals", Static).update(text)

    def _show_sparks(self) -> None:
        series = {
            "lookups": (self.state.lookup_rate_series(), "lookups/s", lambda v: f"{v:.1f}"),
            "hit": (self.state.hit_ratio_series(), "hit ratio now", lambda v: f"{v:.0%}"),
            "moved": (self.state.movement_series(), "moved", render.rate_bytes),
        }
        # the control plane gone: its last rate is no current one (the line above says when
        # it was known), so none is shown as if live
        lost = self.state.connection != CONNECTED and bool(self.state.samples)
        for key, (data, name, value) in series.items():
            # under two points there is no line to draw; one value alone fills the widget
            self.query_one(f"#spark-{key}", Sparkline).data = data if len(data) >= 2 else []
            shown = "-" if lost else value(data[-1] if data else 0.0)
            self.query_one(f"#spark-{key}-label", Label).update(f"{name} {shown}")

    def _show_agents(self) -> None:
        rows = []
        for a in self.state.agents:
            tiers = Text("\n").join(
                render.usage_bar(t.used_bytes, t.capacity_bytes, t.tier, width=8)
                + Text(f" {render.bytes_text(t.used_bytes)}" + render.parked_suffix(t))
                for t in a.tiers
            )
            cells = (  # data as Text: a plain str cell is read as markup ('[fd00::5]:1' lost its host)
                Text(a.agent_id),
                Text(a.address),
                render.styled(a.state) + (Text(" cordoned", style="yellow") if a.cordon_reason else Text()),
                tiers if a.tiers else Text("-", style="dim"),
                str(a.num_blocks),
                f"{a.hit_ratio:.1%}",
            )
            rows.append((a.agent_id, cells, max(1, len(a.tiers))))
        sync_rows(self.query_one("#agents", DataTable), rows)

    def _selected_agent(self) -> str | None:
        table = self.query_one("#agents", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_open_agent(self) -> None:
        agent_id = self._selected_agent()
        if agent_id:
            self.app.push_screen(AgentScreen(agent_id))

    @on(DataTable.RowSelected, "#agents")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.push_screen(AgentScreen(str(event.row_key.value)))


class AgentScreen(DashboardScreen):
    """One agent: its tiers, models (and namespaces when the control plane reports them),
    and the recent events that name it."""

    TITLE = "Agent"
    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    def __init__(self, agent_id: str):
        super().__init__()
        self.agent_id = agent_id

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        with VerticalScroll(id="agent-body"):
            yield Static(id="agent-info")
            yield Label("Recent events", classes="section")
            yield Static(id="agent-events")
        yield Footer()

    def show_data(self, topics: frozenset[str]) -> None:
        if topics & {"agents", "clock"}:
            self._show_info()
        if "events" in topics:
            self._show_events()

    def _show_info(self) -> None:
        a = self.state.agent(self.agent_id)
        text = Text()
        text.append(f"{self.agent_id}", style="bold")
        if a is None:
            text.append("  not registered (it left the cluster, or has not joined yet)", style="yellow")
            self.query_one("#agent-info", Static).update(text)
            return
        text.append("  ")
        text.append_text(render.styled(a.state))
        if a.cordon_reason:  # Text, not markup: the reason is an operator's free text
            text.append(f"  cordoned ({a.cordon_reason}): no new work goes to it", style="yellow")
        text.append(f"  {a.address}")
        if a.last_seen_unix_seconds:
            text.append(f"  last seen {render.duration(self.dash.now() - a.last_seen_unix_seconds)} ago", style="dim")
        text.append("\n\n")
        text.append("blocks ", style="bold")
        text.append(f"{a.num_blocks}  ")
        text.append("lookups ", style="bold")
        text.append(f"{a.lookups_total}  ")
        text.append("hit ", style="bold")
        text.append(f"{a.hit_ratio:.1%} ({a.lookup_hit_tokens_total}/{a.lookup_tokens_total} tokens)\n\n")
        text.append("Tiers\n", style="bold underline")
        for t in a.tiers:
            text.append_text(render.usage_bar(t.used_bytes, t.capacity_bytes, t.tier, width=24))
            text.append(
                f"  {render.bytes_text(t.used_bytes)} / {render.bytes_text(t.capacity_bytes)}, {t.num_blocks} blocks"
                + render.parked_suffix(t)
                + "\n"
            )
        if not a.tiers:
            text.append("no tiers reported\n", style="dim")
        text.append("\nModels  ", style="bold")
        text.append(", ".join(a.models) or "none")
        # namespaces by bytes, when the facade reports them (AgentStats carries them)
        namespaces = getattr(a, "namespaces", None)
        if namespaces:
            text.append("\n\nTop namespaces by bytes\n", style="bold underline")
            top = sorted(namespaces, key=lambda n: getattr(n, "uncompressed_bytes", 0), reverse=True)[:5]
            for n in top:
                text.append(
                    f"{n.namespace or 'default':<20} {render.bytes_text(n.uncompressed_bytes):>10}  {n.num_blocks} blocks\n"
                )
        self.query_one("#agent-info", Static).update(text)

    def event_added(self, event) -> None:
        if event.agent_id == self.agent_id:
            self._show_events()

    def _show_events(self) -> None:
        events = self.state.agent_events(self.agent_id, limit=8)
        text = Text()
        for e in events:
            text.append(f"{render.clock_time(e.unix_seconds)} ", style="dim")
            text.append(f"{e.kind:<13}", style=render.SEVERITY_STYLES.get(e.severity, ""))
            text.append(f" {e.message}\n")
        if not events:
            text.append("none yet", style="dim")
        self.query_one("#agent-events", Static).update(text)


# ---- pins ------------------------------------------------------------------------------


class PinsScreen(DashboardScreen):
    TITLE = "Pins"
    REFRESH_ON_VIEW = ("pins",)
    BINDINGS = [
        Binding("n", "new_pin", "New pin"),
        Binding("d,delete", "unpin", "Unpin"),
    ]

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield Static(id="pins-note", classes="note")
        yield Table(id="pins", cursor_type="row", zebra_stripes=True)
        yield Static(id="pin-detail", classes="detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#pins", DataTable)
        for label, key in (
            ("PIN", "pin"),
            ("NAMESPACE", "namespace"),
            ("SCOPE", "scope"),
            ("TIER", "tier"),
            ("BYTES", "bytes"),
            ("TTL", "ttl"),
            ("OWNER", "owner"),
        ):
            table.add_column(label, key=key)

    def show_data(self, topics: frozenset[str]) -> None:
        if "pins" in topics:
            self._show_pins()
        elif "clock" in topics:
            self._show_ttls()
        if topics & {"pins", "clock"}:
            self._show_detail()

    def _show_detail(self) -> None:
        pin_id = self._selected()
        p = next((p for p in self.state.pins if p.pin_id == pin_id), None)
        text = Text()
        if p is not None:
            text.append(p.pin_id, style="bold")
            text.append(f"  {p.namespace}  model {p.model_id or '*'}  {p.num_blocks} blocks")
            text.append(f"  {render.bytes_text(p.pinned_bytes)} at {p.min_tier} or faster\n")
            text.append(f"created {render.clock_time(p.created_unix_seconds)}", style="dim")
            if p.expires_unix_seconds:
                text.append(f"  expires {render.clock_time(p.expires_unix_seconds)}", style="dim")
            else:
                text.append("  no TTL: released with its owner's lease", style="dim")
            if p.owner:
                text.append(f"  owner {p.owner}", style="dim")
        self.query_one("#pin-detail", Static).update(text)
        self.query_one("#pin-detail", Static).display = bool(text)

    @on(DataTable.RowHighlighted, "#pins")
    def _highlighted(self) -> None:
        self._show_detail()

    def _note(self) -> str:
        f = self.state.pins_feature
        if f.available is False:
            return "Pins are not available on this control plane (it answers UNIMPLEMENTED); this screen lights up when they are."
        if f.error:
            return f"could not list pins: {f.error}"
        if f.available is None:
            return "loading pins…"
        if not self.state.pins:
            return "no pins; press n to pin a prefix or a namespace"
        return ""

    def _show_pins(self) -> None:
        note = self._note()
        self.query_one("#pins-note", Static).update(Text(note))  # (a server's error text in it)
        self.query_one("#pins-note", Static).display = bool(note)
        table = self.query_one("#pins", DataTable)
        table.display = self.state.pins_feature.available is not False
        now = self.dash.now()
        rows = []
        for p in self.state.pins:
            scope = "namespace" if p.whole_namespace else "prefix"
            if p.agent_id:
                scope += f"@{p.agent_id}"
            cells = (  # data as Text: an owner '[/x]' was markup that crashed the screen
                Text(render.short_id(p.pin_id, 12)),
                Text(render.short_id(p.namespace, 12)),
                Text(render.short_id(scope, 16)),
                Text(p.min_tier),
                render.bytes_text(p.pinned_bytes),
                self._ttl(p, now),
                Text(render.short_id(p.owner or "-", 12)),
            )
            rows.append((p.pin_id, cells, 1))
        sync_rows(table, rows)

    @staticmethod
    def _ttl(pin, now: float) -> Text:
        left = pin.ttl_left_seconds(now)
        if left is None:
            return Text("lease", style="dim")
        return Text(render.duration(left), style="yellow" if left < 60 else "")

    def _show_ttls(self) -> None:
        table = self.query_one("#pins", DataTable)
        now = self.dash.now()
        for p in self.state.pins:
            # a pin the table does not show yet (the pins changed while another screen was
            # in view, and the rebuild on resume has not run): the rebuild will show it
            if p.expires_unix_seconds and p.pin_id in table.rows:
                ttl = self._ttl(p, now)
                if not _same_cell(ttl, table.get_cell(p.pin_id, "ttl")):  # most change once a minute
                    table.update_cell(p.pin_id, "ttl", ttl)

    def _selected(self) -> str | None:
        table = self.query_one("#pins", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_new_pin(self) -> None:
        if self.state.pins_feature.available is False:
            self.app.notify("Pins are not available on this control plane.", severity="warning")
            return

        def created(request: dict | None) -> None:
            if request:
                self.dash.create_pin(request)

        self.app.push_screen(PinForm(), created)

    def action_unpin(self) -> None:
        pin_id = self._selected()
        if not pin_id:
            return
        pin = next((p for p in self.state.pins if p.pin_id == pin_id), None)
        what = f"{pin.namespace}/{pin.pin_id}" if pin else pin_id

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.dash.remove_pin(pin_id)

        self.app.push_screen(ConfirmScreen(f"Unpin {what}?", "Its blocks may then be demoted or evicted."), confirmed)


class PinForm(ModalScreen[dict | None]):
    """Pin a prefix (model + token ids) or a whole namespace (no tokens)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="pin-form", classes="dialog"):
            yield Label("New pin", classes="dialog-title")
            with Grid(id="pin-grid"):
                yield Label("namespace")
                yield Input(placeholder="default", id="pin-namespace", compact=True)
                yield Label("model")
                yield Input(placeholder="model id", id="pin-model", compact=True)
                yield Label("tokens")
                yield Input(placeholder="1,2,3 … (empty: whole namespace)", id="pin-tokens", compact=True)
                yield Label("min tier")
                yield Select(
                    [("gpu", "gpu"), ("cpu", "cpu"), ("disk", "disk")],
                    value="cpu",
                    allow_blank=False,
                    id="pin-tier",
                    compact=True,
                )
                yield Label("ttl seconds")
                yield Input("3600", id="pin-ttl", compact=True)
                yield Label("owner")
                yield Input("kvctl-dashboard", id="pin-owner", compact=True)
            yield Label("", id="pin-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Pin", variant="primary", id="pin-create")
                yield Button("Cancel", id="pin-cancel")

    def _value(self, widget_id: str) -> str:
        return self.query_one(f"#{widget_id}", Input).value.strip()

    def request(self) -> dict:
        """The form as keyword arguments of ControlPlaneClient.pin; ValueError names the bad field."""
        tokens_text = self._value("pin-tokens")
        tokens = None
        if tokens_text:  # as kvctl --tokens reads them (it took 1_000 and '1,,2' here)
            try:
                tokens = parse_token_ids(tokens_text)
            except ValueError as exc:
                raise ValueError(f"tokens: {exc}") from None
        try:
            ttl = float(self._value("pin-ttl") or 0)
        except ValueError:
            raise ValueError("ttl seconds: must be a number") from None
        if ttl < 0:
            raise ValueError("ttl seconds: must not be negative")
        model = self._value("pin-model")
        if tokens and not model:
            raise ValueError("model: a prefix pin needs the model id")
        if model and not tokens:
            raise ValueError("model: a namespace pin covers every model's blocks in it; clear it, or give tokens")
        return {
            "namespace": self._value("pin-namespace"),
            "model_id": model,
            "token_ids": tokens,
            "min_tier": str(self.query_one("#pin-tier", Select).value),
            "ttl_seconds": ttl,
            "owner": self._value("pin-owner"),
        }

    @on(Button.Pressed, "#pin-create")
    @on(Input.Submitted)
    def _submit(self) -> None:
        try:
            request = self.request()
        except ValueError as exc:
            self.query_one("#pin-error", Label).update(Text(str(exc)))  # (it quotes what was typed)
            return
        self.dismiss(request)

    @on(Button.Pressed, "#pin-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, detail: str = ""):
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog confirm"):
            yield Label(Text(self.question), classes="dialog-title")
            if self.detail:
                yield Label(Text(self.detail))
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


# ---- operations ------------------------------------------------------------------------


class OperationsScreen(DashboardScreen):
    TITLE = "Operations"
    REFRESH_ON_VIEW = ("operations",)
    BINDINGS = [Binding("x", "cancel_op", "Cancel op")]

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield Static(id="ops-note", classes="note")
        yield Table(id="ops", cursor_type="row", zebra_stripes=True)
        yield Static(id="op-detail", classes="detail")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#ops", DataTable)
        for label, key in (
            ("OP", "op"),
            ("KIND", "kind"),
            ("STATE", "state"),
            ("PROGRESS", "progress"),
            ("BLOCKS", "blocks"),
            ("MOVED", "moved"),
        ):
            table.add_column(label, key=key)

    def show_data(self, topics: frozenset[str]) -> None:
        if "operations" in topics:
            self._show_ops()
        if topics & {"operations", "clock"}:
            self._show_detail()

    def _note(self) -> str:
        f = self.state.operations_feature
        if f.available is False:
            return (
                "Operations are not available on this control plane (it answers UNIMPLEMENTED); "
                "this screen lights up when they are."
            )
        if f.error:
            return f"could not list operations: {f.error}"
        if f.available is None:
            return "loading operations…"
        if not self.state.operations:
            return "no operations yet (kvctl move / cleanup / compress start them)"
        return ""

    def _show_ops(self) -> None:
        note = self._note()
        self.query_one("#ops-note", Static).update(Text(note))
        self.query_one("#ops-note", Static).display = bool(note)
        table = self.query_one("#ops", DataTable)
        table.display = self.state.operations_feature.available is not False
        rows = []
        for op in self.state.operations:
            progress = render.bar(op.progress, 10, style="cyan") + Text(f" {op.progress:>4.0%}")
            done = Text(f"{op.num_done_blocks}/{op.num_total_blocks}", style="red" if op.num_failed_blocks else "")
            cells = (
                Text(render.short_id(op.op_id, 16)),
                Text(op.kind + ("*" if op.dry_run else "")),
                render.styled(op.state),
                progress,
                done,
                render.bytes_text(op.moved_bytes),
            )
            rows.append((op.op_id, cells, 1))
        sync_rows(table, rows)

    def _show_detail(self) -> None:
        op_id = self._selected()
        op = next((o for o in self.state.operations if o.op_id == op_id), None)
        text = Text()
        if op is not None:
            text.append(f"{op.op_id}", style="bold")
            if op.created_unix_seconds:
                text.append(f"  started {render.duration(self.dash.now() - op.created_unix_seconds)} ago")
            if op.dry_run:
                text.append("  dry run")
            if op.num_failed_blocks:
                text.append(f"  {op.num_failed_blocks} failed", style="red")
            if op.num_skipped_pinned_blocks:
                text.append(f"  {op.num_skipped_pinned_blocks} skipped (pinned)")
            params = " ".join(f"{k}={v}" for k, v in sorted(op.params.items()))
            if params:
                text.append(f"\n{params}", style="dim")
            if op.error:
                text.append(f"\n{op.error}", style="red")
            for a in op.agents[:3]:
                text.append(f"\n  {a.agent_id}: {a.state} {a.num_done_blocks}/{a.num_total_blocks}")
                if a.error:
                    text.append(f" {a.error}", style="red")
        self.query_one("#op-detail", Static).update(text)
        self.query_one("#op-detail", Static).display = bool(text)

    @on(DataTable.RowHighlighted, "#ops")
    def _highlighted(self) -> None:
        self._show_detail()

    def _selected(self) -> str | None:
        table = self.query_one("#ops", DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_cancel_op(self) -> None:
        op_id = self._selected()
        op = next((o for o in self.state.operations if o.op_id == op_id), None)
        if op is None:
            return
        if op.finished:
            self.app.notify(f"{op.kind} {op.op_id} already {op.state.lower()}", severity="warning")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.dash.cancel_operation(op.op_id)

        self.app.push_screen(
            ConfirmScreen(
                f"Cancel {op.kind} {op.op_id}?", f"{op.num_done_blocks}/{op.num_total_blocks} blocks done so far."
            ),
            confirmed,
        )


# ---- events ----------------------------------------------------------------------------


class EventsScreen(DashboardScreen):
    """The event log. The log keeps what it has written: coming back to this screen writes
    only the events that arrived while another one was in view, and the filter is applied
    once typing pauses (or on Enter), not at every key. Writing the whole log again took
    about a second at 2000 events on a 2-core host, and it was done at every visit and
    at every key typed into the filter."""

    TITLE = "Events"
    FILTER_DELAY_SECONDS = 0.3
    BINDINGS = [
        Binding("slash", "focus_filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shown_filter: str | None = None  # the filter the log was written with (None: not written yet)
        self._shown_upto = 0  # the state's events_added_total when the log was last brought up to date
        self._filter_timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield from self.compose_status()
        yield Input(placeholder="/ filter: words, kind:notice, sev:warning, agent:agent-1", id="filter", compact=True)
        yield RichLog(id="log", max_lines=EVENT_LOG_SIZE, wrap=True, min_width=20, auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log", RichLog).focus()

    def show_data(self, topics: frozenset[str]) -> None:
        if "events" in topics:
            self._catch_up()

    def event_added(self, event) -> None:
        """One new event while on screen (cheaper than rebuilding the log)."""
        if self._shown_filter is None or self._shown_upto != self.state.events_added_total - 1:
            self._catch_up()  # events came in while the log was not kept up
            return
        self._shown_upto = self.state.events_added_total
        if matches_filter(event, self._shown_filter):
            self.query_one("#log", RichLog).write(self._line(event))

    @staticmethod
    def _line(e) -> Text:
        text = Text()
        text.append(f"{render.clock_time(e.unix_seconds)} ", style="dim")
        text.append(f"{e.kind:<12} ", style=render.SEVERITY_STYLES.get(e.severity, "") or "bold")
        ids = " ".join(x for x in (e.agent_id, e.op_id, e.pin_id) if x)
        if ids:
            text.append(f"{ids} ", style="cyan")
        text.append(e.message)
        return text

    def _catch_up(self) -> None:
        """Write the events the log does not have yet; the whole log again only when the
        filter changed or more arrived than the state keeps."""
        text = self.query_one("#filter", Input).value
        new = self.state.events_added_total - self._shown_upto
        if text != self._shown_filter or new > len(self.state.events):
            self._rebuild()
            return
        if new > 0:
            events = list(self.state.events)[-new:]
            self._write([e for e in events if matches_filter(e, text)])
        self._shown_upto = self.state.events_added_total

    def _rebuild(self) -> None:
        if self._filter_timer is not None:
            self._filter_timer.stop()
            self._filter_timer = None
        log = self.query_one("#log", RichLog)
        log.clear()
        text = self.query_one("#filter", Input).value
        self._write([e for e in self.state.events if matches_filter(e, text)])
        self._shown_filter, self._shown_upto = text, self.state.events_added_total

    def _write(self, events: list) -> None:
        """One write for many lines: Rich lays them out in one pass (half the time of a
        write per line)."""
        if events:
            self.query_one("#log", RichLog).write(Text("\n").join(self._line(e) for e in events))

    def _filter_due(self) -> None:
        self._filter_timer = None
        if self.query_one("#filter", Input).value != self._shown_filter:
            self._rebuild()

    @on(Input.Changed, "#filter")
    def _filter_changed(self) -> None:
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(self.FILTER_DELAY_SECONDS, self._filter_due)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self._filter_due()
        self.query_one("#log", RichLog).focus()

    def action_focus_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_clear_filter(self) -> None:
        self.query_one("#filter", Input).value = ""
        self._filter_due()
        self.query_one("#log", RichLog).focus()


# ---- help ------------------------------------------------------------------------------

HELP_TEXT = """\
[b]Screens[/b]
  c  Cluster     agents, tiers, totals, sparklines
  p  Pins        pins with their TTL counting down
  o  Operations  moves, cleanups, compressions
  e  Events      the live event log
  ?  this help   r  refresh now   q  quit

[b]On a screen[/b]
  Cluster     ↑/↓ choose an agent, Enter its detail, Esc back
  Pins        n new pin (a prefix or a namespace), d unpin
  Operations  x cancel the selected operation
  Events      / filter: words, kind:notice, sev:warning,
              agent:ID; Esc clears it
  Unpin and cancel ask first: y or n.

Updates come from the control plane's Watch stream; stats
refresh every few seconds. When the control plane goes away
the top line says [b red]reconnecting[/b red] until it is back."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Label("kvcp dashboard — keys", classes="dialog-title")
            yield Static(HELP_TEXT)
            yield Label("Esc or ? closes this", classes="dim")
