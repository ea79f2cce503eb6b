"""Subscriber to a vLLM engine's KV events (`--kv-events-config` with the zmq publisher).

Wire format (vLLM's `ZmqEventPublisher`): multipart messages `[topic, seq, payload]` on a
PUB socket, seq an 8-byte big-endian counter from 0 per publisher, payload a msgpack
KVEventBatch (decoded by agent.core.vllm_events). A ROUTER socket (the replay endpoint)
answers `[b"", start_seq]` from a DEALER with `[b"", seq, payload]` for each batch it
still buffers from start_seq on, then `[b"", -1 (signed), b""]`.

Gaps: a seq that skips ahead asks the replay endpoint for the missing batches; what comes
back in order is applied, and if it cannot fill the gap (no replay endpoint, the engine's
buffer has moved on, a timeout) the agent forgets every block of this engine (nothing
stale is claimed) and starts over from what follows: the counted equivalent of a resync,
since vLLM has no snapshot to ask for. When the subscriber starts it asks for the whole
replay buffer, so an engine that was already running is picked up; a replay that does
not reach the live batch is such a gap too. A seq that goes back to 0 is an engine
restart: its cache is empty, and so is ours for it. A malformed message is counted and
skipped (its seq, if it had one, shows as a gap); a batch that does not decode is never
applied in part, and since the removals in it are unknown the engine's blocks are
forgotten (as for a gap). Events of a kind not known here are counted and left out. The SUB socket's bounded
queue (rcvhwm) is the backpressure: a consumer that falls behind loses messages, sees the
gap and recovers as above, with memory bounded.

A lost engine: PUB/SUB alone cannot tell a quiet engine from a dead one, so the SUB
socket's monitor watches its connection. An engine whose connection stays down longer
than `disconnect_grace_seconds` (a crash, a host gone) has its blocks forgotten, so the
control plane stops sending lookups to a cache that no longer exists; when the publisher
is back, the subscriber starts over as it does at start (the replay buffer, then live).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from agent.core.vllm_events import BlockSizeMismatch, ExternalBlocks, MalformedBatch, decode_batch

log = logging.getLogger(__name__)

END_SEQ = -1


@dataclass
class VllmEventStats:
    batches_total: int = 0
    blocks_stored_total: int = 0
    blocks_removed_total: int = 0
    malformed_total: int = 0
    unknown_events_total: int = 0  # events of a kind not known here, left out of their batch
    other_group_events_total: int = 0  # events of a KV cache group not indexed here, left out
    gaps_total: int = 0
    replayed_batches_total: int = 0
    unrecovered_gaps_total: int = 0  # the blocks of the engine were dropped (a resync)
    engine_restarts_total: int = 0
    engine_lost_total: int = 0  # the publisher's connection stayed down past the grace
    last_seq: int = -1


class VllmEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        external: ExternalBlocks,
        replay_endpoint: str = "",
        topic: str = "",
        replay_timeout_seconds: float = 2.0,
        rcvhwm: int = 10_000,
        disconnect_grace_seconds: float = 30.0,
        group: int = 0,
    ):
        self.endpoint = endpoint
        self.group = group
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.external = external
        self.replay_timeout_seconds = replay_timeout_seconds
        self.rcvhwm = rcvhwm
        self.disconnect_grace_seconds = disconnect_grace_seconds
        self._down_since: float | None = None  # monotonic time the publisher's connection dropped
        self._lost = False  # given up after the grace: its connection coming back is a reconnect too
        self.stats = VllmEventStats()
        self.connected = threading.Event()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._dealer: zmq.Socket | None = None
        self._started = False
        self._reconnected = False  # the publisher's connection came back since the last batch
        self._read_at_start = False  # the replay buffer was read at start: no live batch past it seen yet
        self._read_until = -1  # ... up to this batch
        # seq -> hash of the payload of each batch that read applied: a live batch numbered
        # within it is skipped only when it is that batch (a different one is a new engine's)
        self._read_payloads: dict[int, int] | None = None
        self._said_block_size = False

    # ---- applying -------------------------------------------------------------------
    def _apply(self, seq: int, payload: bytes) -> None:
        st = self.stats
        st.last_seq = seq
        try:
            batch = decode_batch(payload, self.group)
            stored, removed = self.external.apply(batch)
        except Exception as exc:  # noqa: BLE001 - MalformedBatch, or what no check foresaw: never raised on
            st.malformed_total += 1
            # what it stored or removed is unknown: nothing of the engine's is claimed
            dropped = self.external.clear()
            if not isinstance(exc, MalformedBatch):
                log.exception(
                    "vLLM KV event batch %d could not be applied; forgot the engine's %d blocks", seq, dropped
                )
                return
            loud = isinstance(exc, BlockSizeMismatch) and not self._said_block_size
            self._said_block_size |= loud  # (said once as an error: every batch after repeats it)
            level = log.error if loud else log.debug if isinstance(exc, BlockSizeMismatch) else log.warning
            level("vLLM KV event batch %d not applied (%s); forgot the engine's %d blocks", seq, exc, dropped)
            return
        st.other_group_events_total += batch.other_group_events
        if batch.unknown_events:
            st.unknown_events_total += batch.unknown_events
            log.info("vLLM KV event batch %d: %d event(s) of a kind not known here left out", seq, batch.unknown_events)
        st.batches_total += 1
        st.blocks_stored_total += stored
        st.blocks_removed_total += removed

    def handle(self, frames: list[bytes]) -> None:
        """One multipart message from the PUB socket."""
        st = self.stats
        if len(frames) != 3 or len(frames[1]) != 8:
            st.malformed_total += 1
            log.warning("vLLM KV event message with %d frames skipped (want [topic, seq, payload])", len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        if self._reconnected:
            self.publisher_back()
        if self._read_at_start:
            read = self._read_payloads or {}
            if self._started and seq <= self._read_until and read.get(seq) == hash(frames[2]):
                return  # published while the buffer was read at start: applied from it already
            # past what was read, or another batch under a number read: an engine that
            # restarted since (seq from 0 again), whose connection drop was not seen
            self._read_at_start = False
            self._read_payloads = None
        if not self._started:
            self._started = True
            if seq > 0:
                self._replay_from_start(seq)  # the engine was running before we subscribed
        elif seq <= st.last_seq:
            # PUB/SUB never delivers a batch twice nor an older one (replayed batches do not
            # come through here): the sequence started over, so the engine restarted (its
            # first batches may have been missed while we reconnected)
            st.engine_restarts_total += 1
            log.info("vLLM engine restarted (seq %d after %d); forgetting its blocks", seq, st.last_seq)
            self.external.clear()
            st.last_seq = -1
            if seq > 0:
                self._replay_from_start(seq)
        elif seq > st.last_seq + 1:
            st.gaps_total += 1
            want = st.last_seq + 1
            self._replay(want, seq)
            if st.last_seq != seq - 1:
                st.unrecovered_gaps_total += 1
                dropped = self.external.clear()
                log.warning(
                    "vLLM KV events %d..%d lost and not replayed; forgot %d blocks of the engine",
                    want,
                    seq - 1,
                    dropped,
                )
        self._apply(seq, frames[2])

    def read_buffer_at_start(self) -> None:
        """Read the engine's replay buffer before any live batch: an engine already running
        and idle now is indexed at once, not at its next batch. Batches published while
        this runs come live as well (skipped, being applied) or are a gap (replayed)."""
        st = self.stats
        if not self.replay_endpoint or self._started:
            return
        self._read_payloads = {}
        self._replay(0, 1 << 62, initial=True)
        if st.last_seq >= 0:
            self._started = self._read_at_start = True
            self._read_until = st.last_seq
            log.info("vLLM KV events: read the engine's replay buffer up to batch %d", st.last_seq)
        else:
            self._read_payloads = None

    def publisher_back(self) -> None:
        """The publisher's connection dropped and came back: the engine behind it may be a
        new one whose numbers passed the old one's (a gap would then be filled from the
        wrong engine, and the old engine's blocks claimed for good): start over from its
        replay buffer at once, as at start (an idle new engine holds nothing of the old's)."""
        self._reconnected = False
        if self._started:
            log.info("vLLM KV event publisher %s is back: reading its blocks again", self.endpoint)
        self.external.clear()
        self.stats.last_seq = -1
        self._started = self._read_at_start = False
        self.read_buffer_at_start()

    def _replay_from_start(self, until: int) -> None:
        """The engine's history before live batch `until`, from wherever its replay buffer
        starts. One that does not reach `until` (a timeout, a broken answer) left batches
        out, removals perhaps: nothing of the engine's is claimed then."""
        st = self.stats
        if not self.replay_endpoint:
            return  # nothing before `until` is known, so nothing of it is claimed
        self._replay(0, until, initial=True)
        if st.last_seq != until - 1:
            st.unrecovered_gaps_total += 1
            dropped = self.external.clear()
            st.last_seq = -1
            log.warning(
                "vLLM KV events before %d were not all replayed; forgot the %d blocks read of them", until, dropped
            )

    def _replay(self, start: int, until: int, initial: bool = False) -> None:
        """Ask for batches [start, until) and apply those that fill in order (`initial`:
        from wherever the engine's buffer starts). Each answer must come within
        `replay_timeout_seconds` of the one before (a full buffer takes as long as it takes)."""
        if not self.replay_endpoint or self._dealer is None:
            return
        try:
            self._replay_answer(start, until, initial)
        except BaseException:
            self._reset_dealer()  # the rest of this answer must not be read as the next one's
            raise

    def _replay_answer(self, start: int, until: int, initial: bool) -> None:
        assert self._dealer is not None
        st = self.stats
        self._dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not self._dealer.poll(int(self.replay_timeout_seconds * 1000)):
                log.warning("vLLM replay from %d timed out", start)
                self._reset_dealer()
                return
            frames = self._dealer.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                st.malformed_total += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                return
            if initial and st.last_seq < 0 and 0 <= seq < until:
                st.last_seq = seq - 1
            if seq >= until or seq != st.last_seq + 1:
                continue  # past the gap, or not contiguous with what we applied
            st.replayed_batches_total += 1
            if self._read_payloads is not None and not self._started:
                self._read_payloads[seq] = hash(frames[2])  # (the read at start)
            self._apply(seq, frames[2])

    def _reset_dealer(self) -> None:
        # a late answer to an abandoned request must not be read as the next one's
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.connect(self.replay_endpoint)

    # ---- the publisher's connection -------------------------------------------------
    def on_connection_event(self, event: int, now: float) -> None:
        """A SUB socket monitor event (zmq.EVENT_*) at monotonic time `now`."""
        if event == zmq.EVENT_DISCONNECTED:
            if self._down_since is None:
                self._down_since = now
                log.info("vLLM KV event publisher %s disconnected", self.endpoint)
        elif event == zmq.EVENT_CONNECTED:
            if self._down_since is not None or self._lost:
                self._reconnected = True
            self._down_since = None
            self._lost = False

    def check_lost(self, now: float) -> None:
        """Forget the engine's blocks once its connection has been down past the grace."""
        if self._down_since is None or now - self._down_since < self.disconnect_grace_seconds:
            return
        self._down_since = None
        self._lost = True  # (when it is back, its buffer is read at once: an idle engine is known too)
        st = self.stats
        st.engine_lost_total += 1
        dropped = self.external.clear()
        log.warning(
            "vLLM KV event publisher %s down for %.0fs: forgot the engine's %d blocks",
            self.endpoint,
            self.disconnect_grace_seconds,
            dropped,
        )
        # when it is back: start over as at start (its replay buffer, then live batches)
        self._started = False
        st.last_seq = -1

    # ---- loop -----------------------------------------------------------------------
    def _guarded(self, step, *args) -> None:
        """One step of the loop; whatever it raises, the subscriber goes on, claiming
        nothing of the engine's it may have got wrong."""
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - one bad message never stops the subscriber
            self.stats.malformed_total += 1
            dropped = self.external.clear()
            log.exception("vLLM KV events could not be applied; forgot the engine's %d blocks", dropped)

    def run_forever(self, stop: threading.Event) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        sub.connect(self.endpoint)
        if self.replay_endpoint:
            self._reset_dealer()
            self._guarded(self.read_buffer_at_start)
        self.connected.set()
        log.info("subscribed to vLLM KV events at %s (replay %s)", self.endpoint, self.replay_endpoint or "none")
        try:
            while not stop.is_set():
                ready = dict(poller.poll(100))
                while monitor.poll(0):
                    self.on_connection_event(recv_monitor_message(monitor)["event"], time.monotonic())
                self.check_lost(time.monotonic())
                if self._reconnected:  # now, not at its next batch: an idle new engine is known too
                    self._guarded(self.publisher_back)
                if sub not in ready:
                    continue
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._guarded(self.handle, frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)
                self._dealer = None
