"""`kvctl dashboard`: a Textual app that watches and operates a kvcp cluster.

A thin client of `cli.client.ControlPlaneClient`, like kvctl. Two kinds of background
work, both in thread workers so the UI loop never waits on the network:

- the watch worker iterates `client.watch()` (the AdminService.Watch server stream) and
  posts each event to the app; when the stream breaks it says so (the top line turns to
  "reconnecting") and retries with a capped backoff;
- the fetch worker runs the unary calls (stats, agents, pins, operations), one batch at a
  time: requests made while a batch is in flight are merged into the next one, and a
  batch that events ask for starts no sooner than `EVENT_FETCH_GAP_SECONDS` after the one
  before, so a busy event stream costs one refresh a second, not one after another.

Events say what changed (an agent joined: agents and stats; a pin expired: pins), so the
app refreshes what they name, plus a slow periodic refresh of stats for the sparklines
(every `refresh_seconds`). Every result goes through the `apply_*` methods below, which
tests also call with fixed views to take deterministic snapshots."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from textual.app import App, ScreenStackError
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.message import Message
from textual.timer import Timer
from textual.worker import get_current_worker

from cli.client import (
    DEFAULT_ENDPOINT,
    AgentView,
    ClientError,
    ControlPlaneClient,
    EventView,
    OperationView,
    PinView,
    StatsView,
)
from dashboard.screens import (
    ClusterScreen,
    DashboardScreen,
    EventsScreen,
    HelpScreen,
    OperationsScreen,
    PinsScreen,
)
from dashboard.state import CONNECTED, RECONNECTING, DashboardState

WATCH_BACKOFF_SECONDS = (0.25, 5.0)  # first retry, cap
# a batch of refreshes that events ask for starts at least this long after the previous
# batch started: on a busy fleet (agent_state, notice and op_state events by the dozen a
# second) each batch's answer came back just as the next events asked again, and the
# dashboard listed and redrew every agent back to back (a core's worth of CPU at 300 agents,
# keys answered late, and as many ListAgents calls on the control plane)
EVENT_FETCH_GAP_SECONDS = 1.0
SLOW_REFRESH_EVERY = 5  # pins and operations not in view: every 5th periodic refresh
FETCH_ORDER = ("operations", "pins", "agents", "stats")
UNREACHABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}

# which refreshes an event kind calls for
EVENT_TOPICS = {
    "agent_joined": {"agents", "stats"},
    "agent_left": {"agents", "stats"},
    "agent_state": {"agents"},
    "notice": {"agents"},
    "pin_created": {"pins"},
    "pin_removed": {"pins"},
    "pin_expired": {"pins"},
    "op_state": {"operations", "agents"},
    "policy": {"stats"},
    "leader": set(FETCH_ORDER),
    "etcd_reset": set(FETCH_ORDER),
    "dropped": set(FETCH_ORDER),
}


class Fetched(Message):
    """A batch of unary results: topic -> view(s) or the ClientError it raised; `error`
    says why the batch stopped on anything else (a bad setting, a bug), '' when it did not."""

    def __init__(self, results: dict, at_unix_seconds: float, error: str = ""):
        super().__init__()
        self.results = results
        self.at_unix_seconds = at_unix_seconds
        self.error = error


class EventReceived(Message):
    def __init__(self, event: EventView):
        super().__init__()
        self.event = event


class WatchBroken(Message):
    def __init__(self, reason: str, unimplemented: bool = False):
        super().__init__()
        self.reason = reason
        self.unimplemented = unimplemented


class ActionDone(Message):
    """A pin, unpin or cancel finished (error is '' on success)."""

    def __init__(self, what: str, error: str, refresh: set[str]):
        super().__init__()
        self.what = what
        self.error = error
        self.refresh = refresh


class DashboardApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "kvcp dashboard"
    ENABLE_COMMAND_PALETTE = False  # every action has a key; the footer needs the room at 80 columns
    MODES = {
        "cluster": ClusterScreen,
        "pins": PinsScreen,
        "operations": OperationsScreen,
        "events": EventsScreen,
    }
    DEFAULT_MODE = "cluster"
    BINDINGS = [
        Binding("c", "switch_mode('cluster')", "Cluster"),
        Binding("p", "switch_mode('pins')", "Pins"),
        Binding("o", "switch_mode('operations')", "Ops"),
        Binding("e", "switch_mode('events')", "Events"),
        Binding("r", "refresh", "Refresh", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_seconds: float = 5.0,
        *,
        live: bool = True,
        refresh_seconds: float = 2.0,
        clock=time.time,
        connect: Callable[[], ControlPlaneClient] | None = None,
    ):
        """`connect` makes a client (kvctl passes its own, with its token and TLS); by
        default a plain one to `endpoint`. `live=False` starts no workers and opens no
        connection: the screens show only what is given to the `apply_*` methods
        (snapshot tests, screenshots)."""
        super().__init__()
        self.endpoint = endpoint
        self.timeout_seconds = timeout_seconds
        self.live = live
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self._connect = connect or (lambda: ControlPlaneClient(self.endpoint, self.timeout_seconds))
        self.state = DashboardState()
        self._client: ControlPlaneClient | None = None
        self._client_lock = threading.Lock()
        self._resume_endpoint = ""  # where a dropped client had moved on to, for the next one
        self._watch_client: ControlPlaneClient | None = None
        self._stopping = threading.Event()
        self._fetching = False
        self._pending: set[str] = set()
        self._pending_now = False  # something waiting was asked for by the operator or a timer, not by events
        self._batch_started = float("-inf")  # time.monotonic() when the last batch started
        self._paced: Timer | None = None  # starts the batch that events asked for, once the gap has passed
        self._ticks = 0

    def now(self) -> float:
        return self.clock()

    # ---- lifecycle --------------------------------------------------------------------
    def on_mount(self) -> None:
        self.set_interval(1.0, self._clock_tick)
        if self.live:
            # the fetch worker makes the client: making it may fail (an unreadable CA
            # file), and that must show on the top line and be retried, not end the app
            self._watch_worker()
            self.set_interval(self.refresh_seconds, self._periodic_refresh)
            self.request_refresh(*FETCH_ORDER)

    def on_unmount(self) -> None:
        # closing the channels cancels the watch stream and any call in flight, so the
        # worker threads end and the app exits at once
        self._stopping.set()
        for client in (self._watch_client, self._client):
            if client is not None:
                client.close()

    def _periodic_refresh(self) -> None:
        if self._stopping.is_set() or not self.screen_stack:  # a timer firing during shutdown
            return
        screen = self.screen
        self._ticks += 1
        topics = {"stats", "agents"}
        slow = self._ticks % SLOW_REFRESH_EVERY == 0
        if slow or isinstance(screen, PinsScreen):
            topics.add("pins")
        if slow or isinstance(screen, OperationsScreen) or self.state.running_operations():
            topics.add("operations")
        if self.state.pins_feature.available is False and not slow:
            topics.discard("pins")
        if self.state.operations_feature.available is False and not slow:
            topics.discard("operations")
        self.request_refresh(*topics)

    def _clock_tick(self) -> None:
        self._show(frozenset({"clock"}))

    # ---- showing ----------------------------------------------------------------------
    def _current_screen(self) -> DashboardScreen | None:
        """The dashboard screen in view, or None while the app starts, switches mode or
        shuts down: a result that arrives then has nowhere to go (the screen shows the
        state afresh when it resumes)."""
        if self._stopping.is_set() or not self.screen_stack:
            return None
        screen = self.screen
        if isinstance(screen, DashboardScreen) and not self._torn_down(screen):
            return screen
        return None

    def _torn_down(self, screen: DashboardScreen) -> bool:
        """Whether `screen` is going or gone. At exit Textual stops the app running, then
        removes each screen's widgets before the screen, and unmounts the app (which sets
        _stopping) last: a result handled meanwhile finds the screen mounted, its widgets not."""
        if self._stopping.is_set() or not self.is_running:
            return True
        return not (screen.is_mounted and screen.is_attached) or screen._pruning or screen._closing

    def _show(self, topics: frozenset[str]) -> None:
        screen = self._current_screen()
        if screen is None:
            return
        try:
            screen.show(topics)
        except (NoMatches, ScreenStackError):  # torn down between the check and the query
            if not self._torn_down(screen):
                raise

    # ---- the update methods (live results and tests come through here) ---------------
    def apply_connection(self, connection: str, detail: str = "") -> None:
        if (connection, detail) != (self.state.connection, self.state.connection_detail):
            self.state.connection, self.state.connection_detail = connection, detail
            self._show(frozenset({"connection"}))

    def apply_stats(self, stats: StatsView, at_unix_seconds: float | None = None) -> None:
        self.state.add_stats(stats, self.now() if at_unix_seconds is None else at_unix_seconds)
        self._show(frozenset({"stats"}))

    def apply_agents(self, agents: list[AgentView]) -> None:
        self.state.agents = list(agents)
        self._show(frozenset({"agents"}))

    def apply_pins(self, pins: list[PinView] | ClientError) -> None:
        feature = self.state.pins_feature
        if isinstance(pins, ClientError):
            self._feature_failed(feature, pins)
        else:
            feature.available, feature.error = True, ""
            self.state.pins = list(pins)
        self._show(frozenset({"pins"}))

    def apply_operations(self, operations: list[OperationView] | ClientError) -> None:
        feature = self.state.operations_feature
        if isinstance(operations, ClientError):
            self._feature_failed(feature, operations)
        else:
            feature.available, feature.error = True, ""
            self.state.operations = list(operations)
        self._show(frozenset({"operations"}))

    @staticmethod
    def _feature_failed(feature, exc: ClientError) -> None:
        if exc.code == "UNIMPLEMENTED":
            feature.available, feature.error = False, ""
        elif exc.code not in UNREACHABLE:  # the top line already says when it is unreachable
            feature.error = str(exc)

    def apply_event(self, event: EventView) -> None:
        if not self.state.add_event(event):
            return
        screen = self._current_screen()
        if screen is None:
            return
        try:
            screen.event_added(event)
        except (NoMatches, ScreenStackError):
            if not self._torn_down(screen):
                raise

    # ---- fetching ---------------------------------------------------------------------
    def request_refresh(self, *topics: str, paced: bool = False) -> None:
        """Ask for a refresh of `topics`; merged with any already waiting. `paced` (what
        events ask for): the batch waits until `EVENT_FETCH_GAP_SECONDS` have passed since
        the previous one started; anything else asked for meanwhile starts it at once."""
        self._pending.update(topics)
        if topics and not paced:
            self._pending_now = True
        if not self.live or self._fetching or not self._pending:
            return
        wait = self._batch_started + EVENT_FETCH_GAP_SECONDS - time.monotonic()
        if not self._pending_now and wait > 0:
            if self._paced is None:
                self._paced = self.set_timer(wait, self._paced_due)
            return
        if self._paced is not None:
            self._paced.stop()
            self._paced = None
        batch, self._pending, self._pending_now = frozenset(self._pending), set(), False
        self._fetching = True
        self._batch_started = time.monotonic()
        self._fetch(batch)

    def _paced_due(self) -> None:
        self._paced = None
        self.request_refresh()

    def _current_client(self) -> ControlPlaneClient:
        with self._client_lock:
            if self._client is None:
                client = self._connect()
                # a client that failed moved on to the next replica (past a hung leader,
                # say): start there, not at the first one listed again
                client.use_endpoint(self._resume_endpoint)
                self._client = client
            return self._client

    def _drop_client(self, client: ControlPlaneClient) -> None:
        """A fresh channel for the next try: a channel that saw the server go away waits
        out gRPC's own growing reconnect backoff, which would delay recovery."""
        with self._client_lock:
            if self._client is client:
                self._client = None
                self._resume_endpoint = client.endpoint
        client.close()

    def _fetch(self, topics: frozenset[str]) -> None:
        self.run_worker(lambda: self._fetch_batch(topics), thread=True, group="fetch", exit_on_error=False)

    def _fetch_batch(self, topics: frozenset[str]) -> None:
        results: dict = {}
        error = ""
        client = None
        try:
            client = self._current_client()
            calls = {
                "operations": lambda: client.list_operations(max_operations=50),
                "pins": client.list_pins,
                "agents": client.list_agents,
                "stats": client.stats,
            }
            for topic in FETCH_ORDER:
                if topic not in topics or self._stopping.is_set():
                    continue
                try:
                    results[topic] = calls[topic]()
                except ClientError as exc:
                    results[topic] = exc
                    if exc.code in UNREACHABLE:
                        self._drop_client(client)
                        break  # the rest would fail the same way
        except Exception as exc:  # noqa: BLE001 - whatever it was, the next refresh must still run
            error = f"refresh failed: {type(exc).__name__}: {exc}"
            if client is not None:
                self._drop_client(client)
        finally:
            # always: on_fetched is what lets the next batch start
            if not self._stopping.is_set():
                self.post_message(Fetched(results, self.now(), error))

    def on_fetched(self, message: Fetched) -> None:
        self._fetching = False
        if message.error:
            self.apply_connection(RECONNECTING, message.error)
        results = message.results
        unreachable = next((r for r in results.values() if isinstance(r, ClientError) and r.code in UNREACHABLE), None)
        if unreachable is not None:
            self.apply_connection(RECONNECTING, str(unreachable))
        if "operations" in results:
            self.apply_operations(results["operations"])
        if "pins" in results:
            self.apply_pins(results["pins"])
        agents = results.get("agents")
        if isinstance(agents, list):
            self.apply_agents(agents)
        stats = results.get("stats")
        if isinstance(stats, StatsView):
            self.apply_connection(CONNECTED)
            self.apply_stats(stats, message.at_unix_seconds)
        elif isinstance(stats, ClientError) and stats.code not in UNREACHABLE:
            # e.g. FAILED_PRECONDITION: the replica lost its leadership (etcd away?)
            self.state.stats_error = str(stats)
            self.apply_connection(CONNECTED)
            self._show(frozenset({"stats"}))
        self.request_refresh()  # what was asked for meanwhile

    def action_refresh(self) -> None:
        self.request_refresh(*FETCH_ORDER)

    # ---- watching ---------------------------------------------------------------------
    def _watch_worker(self) -> None:
        self.run_worker(self._watch_loop, thread=True, group="watch", exit_on_error=False)

    def _watch_loop(self) -> None:
        worker = get_current_worker()
        backoff = WATCH_BACKOFF_SECONDS[0]
        while not self._stopping.is_set() and not worker.is_cancelled:
            client = None
            unimplemented = False
            try:
                client = self._connect()
                self._watch_client = client
                # start where the fetch client is: it has followed a follower to the leader
                client.use_endpoint(self._fetch_endpoint())
                for event in client.watch(replay_recent=True):
                    backoff = WATCH_BACKOFF_SECONDS[0]
                    self.post_message(EventReceived(event))
                reason = "the control plane ended the event stream"
            except ClientError as exc:
                reason = str(exc)
                unimplemented = exc.code == "UNIMPLEMENTED"
            except Exception as exc:  # noqa: BLE001 - say it and retry; the worker must not end
                reason = f"event stream failed: {type(exc).__name__}: {exc}"
            finally:
                if client is not None:
                    client.close()
            if self._stopping.is_set():
                return
            self.post_message(WatchBroken(reason, unimplemented))
            # a control plane without Watch: the periodic refresh carries on alone
            self._stopping.wait(30.0 if unimplemented else backoff)
            backoff = min(backoff * 2, WATCH_BACKOFF_SECONDS[1])

    def _fetch_endpoint(self) -> str:
        """The endpoint the fetch client talks to now ('' when it has none)."""
        with self._client_lock:
            return self._client.endpoint if self._client is not None else ""

    def on_event_received(self, message: EventReceived) -> None:
        self.state.watch_available = True
        self.apply_connection(CONNECTED)
        self.apply_event(message.event)
        self.request_refresh(*EVENT_TOPICS.get(message.event.kind, ()), paced=True)

    def on_watch_broken(self, message: WatchBroken) -> None:
        if message.unimplemented:
            self.state.watch_available = False
            self._show(frozenset({"connection"}))
            return
        self.apply_connection(RECONNECTING, message.reason)
        self.request_refresh("stats", "agents")  # probe now, not at the next tick

    # ---- actions the screens ask for ----------------------------------------------------
    def _act(self, what: str, call, refresh: set[str]) -> None:
        def run() -> None:
            try:
                call(self._current_client())
                error = ""
            except ClientError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - e.g. no client could be made: say so
                error = f"{type(exc).__name__}: {exc}"
            self.post_message(ActionDone(what, error, refresh))

        self.run_worker(run, thread=True, group="actions", exit_on_error=False)

    def create_pin(self, request: dict) -> None:
        self._act("pinned", lambda c: c.pin(**request), {"pins"})

    def remove_pin(self, pin_id: str) -> None:
        self._act(f"unpinned {pin_id}", lambda c: c.unpin(pin_id), {"pins"})

    def cancel_operation(self, op_id: str) -> None:
        self._act(f"cancel of {op_id} asked", lambda c: c.cancel_operation(op_id), {"operations"})

    def on_action_done(self, message: ActionDone) -> None:
        if message.error:
            self.notify(message.error, title="failed", severity="error", timeout=8)
        else:
            self.notify(message.what, timeout=3)
        self.request_refresh(*message.refresh)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())
