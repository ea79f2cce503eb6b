"""One control-plane DRAIN as it runs on its source agent (agent.dataplane.DataPlane._drain
builds a `DrainRun` and runs it): each prefix chain is handed off to the first destination
of its order that takes it (agent.core.drain.DrainPlan says the order), progress goes to
the control plane through `reply`, with a heartbeat while a long handoff runs, and the
chains that found every destination that could take them full past its drop line wait and
are tried again, backing off, for DataPlaneConfig.drain_full_wait_seconds; a cancel or the
agent's close() ends that wait at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.core.drain import DrainChain, DrainPlan
from agent.core.handoff import PRESENT, TRANSFERRED
from agent.dataplane import TRANSFER_HEARTBEAT_SECONDS, PrefixNotHeld
from protos import errors
from protos.units import human_bytes

if TYPE_CHECKING:
    from agent.dataplane import DataPlane

# why a drain left blocks that this agent no longer held when their turn came
DROPPED_MEANWHILE = "dropped here before they were sent (a cleanup, eviction or corruption)"
# a drain tries the destinations that refused its blocks past their drop line again after
# this long, doubling up to the cap (a try costs one Reserve round trip; one that moved a
# chain starts again at the first: room is freeing), for DataPlaneConfig.drain_full_wait_seconds
DRAIN_FULL_RETRY_FIRST_SECONDS = 0.5
DRAIN_FULL_RETRY_MAX_SECONDS = 4.0
# the blocks a partial drain left are counted under the pool's lock this many at a time
# (the engine's store, lookup and load wait on that lock)
HELD_LEFT_CHUNK = 4096


class DrainRun:
    """One drain's progress: the blocks handed off (`done`) and those of the chains taken
    up (`tried`: a cancel leaves the rest untried, not failed), the payload bytes sent
    (`moved_bytes`, and per destination `sent_to`), why chains were left behind
    (`skipped`), and the chains waiting for room (`waiting`)."""

    def __init__(
        self,
        dataplane: DataPlane,
        op_id: str,
        destinations: list[str],
        chains: list[DrainChain],
        plan: DrainPlan,
        fill_limit_bytes: list[int] | None,
        deadline_seconds: float,
        reply: Callable[..., None],
        cancelled: threading.Event,
    ) -> None:
        self.dataplane = dataplane
        self.op_id = op_id
        self.destinations = destinations
        self.chains = chains
        self.hashes = {h for c in chains for h in c.block_hashes}
        self.total = len(self.hashes)
        self.plan = plan
        # the room was each one's when the drain began; Route's handoffs landing there since
        # take some of it, and the destination refuses the drain's blocks past its drop line
        self.lines = dict(zip(destinations, fill_limit_bytes or (), strict=False))
        self.deadline_seconds = deadline_seconds
        self.reply = reply
        self.cancelled = cancelled
        self.sent_to: dict[str, int] = {}  # destination -> payload bytes sent there (the result)
        self.done: set[bytes] = set()
        self.tried: set[bytes] = set()  # blocks of the chains taken up (a cancel leaves the rest untried, not failed)
        self.moved_bytes = 0
        self.num_tries = 0  # chains handed off, or tried
        self.skipped: list[str] = []  # why chains were left behind
        self.said_at = 0.0  # when progress was last reported
        self.note = ""  # what a RUNNING drain says it is doing (waiting for room)
        self.waiting: list[DrainChain] = []  # the chains every destination that could take them refused, full
        self.retries = 0
        self.waited = 0.0

    def run(self) -> None:
        self.say("RUNNING")
        beat_done = threading.Event()
        threading.Thread(target=self.beat, args=(beat_done,), name=f"drain {self.op_id} beat", daemon=True).start()
        try:
            self.hand_off_all()
            self.wait_for_room()
        finally:
            beat_done.set()
        self.report()

    def say(self, state: str, **fields) -> None:
        self.said_at = time.monotonic()
        if state == "RUNNING" and self.note:
            fields.setdefault("result", self.note)
        self.reply(
            self.op_id,
            state,
            num_done_blocks=len(self.done),
            num_total_blocks=self.total,
            moved_bytes=self.moved_bytes,
            peer_taken_bytes=[self.plan.sent_bytes.get(d, 0) for d in self.destinations],
            **fields,
        )

    def beat(self, beat_done: threading.Event) -> None:  # a long handoff must not look like a silent agent
        while not beat_done.wait(TRANSFER_HEARTBEAT_SECONDS):
            if time.monotonic() - self.said_at >= TRANSFER_HEARTBEAT_SECONDS:
                self.say("RUNNING")

    def stopping(self) -> bool:
        return self.cancelled.is_set() or self.dataplane._closing

    def send(self, chain: DrainChain) -> bool:
        """Hand `chain` off to the first destination of its order that takes it; False:
        it waits for room (each destination that could take it is full)."""
        plan = self.plan
        order = plan.order(chain)
        if not order and plan.waits_for_room(chain):
            return False  # (not tried: a cancel does not count it failed)
        self.tried.update(chain.block_hashes)
        self.num_tries += 1
        if not order:
            if not any(plan.takes(d, chain.model_id) for d in plan.destinations):
                self.skipped.append(f"no destination serves model {chain.model_id!r}")
            else:
                self.skipped.append("no destination has room for a chain")
            return True
        failed = False  # (one full since is no failure: the chain waits for room)
        for destination in order:
            try:
                # no namespace for all: each block keeps its own there (a chain may
                # continue another namespace's prefix: its pins, cleanups and quota)
                r = self.dataplane.handoff(
                    chain.model_id,
                    list(chain.block_hashes),
                    destination,
                    self.deadline_seconds,
                    fill_limit_bytes=self.lines.get(destination, 0),
                )
            except PrefixNotHeld:  # dropped here meanwhile: nothing to send
                self.skipped.append(DROPPED_MEANWHILE)
                return True
            except errors.FillLimitReached:  # handoffs since the drain began took the rest
                plan.full(destination)
                continue
            except errors.KvcpError as exc:  # cordoned since, or gone
                plan.failed(destination, str(exc), permanent=True)
                failed = True
                continue
            if r.outcome in (TRANSFERRED, PRESENT):
                self.done.update(chain.block_hashes[: r.num_blocks])
                self.moved_bytes += r.sent_bytes
                self.sent_to[destination] = self.sent_to.get(destination, 0) + r.sent_bytes
                landed = plan.landed(destination, chain, r.num_blocks - r.num_sent_blocks, r.num_blocks)
                plan.took(destination, chain, landed, r.num_blocks)
                if r.num_blocks < len(chain.block_hashes):  # its tail was dropped here meanwhile
                    self.skipped.append(DROPPED_MEANWHILE)
                return True
            plan.failed(destination, r.reason)
            failed = True
        if plan.waits_for_room(chain):
            return False
        self.skipped.append("every destination failed it" if failed else "no destination has room for a chain")
        return True

    def hand_off_all(self) -> None:
        """The main pass: each chain in the drain's order, the ones refused full set aside."""
        for chain in self.chains:
            if self.stopping() or (self.plan.exhausted and not self.plan.full_destinations):
                break
            if all(h in self.done for h in chain.block_hashes):
                continue  # its leaf went with it before: the whole chain is at one destination
            n = self.num_tries
            if not self.send(chain):
                self.waiting.append(chain)
            if self.num_tries > n:  # (not for each chain set aside without a try)
                self.say("RUNNING")

    def wait_for_room(self) -> None:
        """Room frees at a full destination as its policy drops blocks, a cleanup runs or
        decodes end: its waiting chains are tried again, backing off, for a bounded time."""
        began = time.monotonic()
        give_up_at = began + self.dataplane.config.drain_full_wait_seconds
        pause = DRAIN_FULL_RETRY_FIRST_SECONDS
        while self.waiting and self.plan.full_destinations and not self.stopping() and time.monotonic() < give_up_at:
            left = give_up_at - time.monotonic()
            self.note = (
                f"waiting for room at {', '.join(self.plan.full_destinations)} (full past the drop line): "
                f"{len(self.waiting)} prefixes to try again, for up to {left:.0f} s more"
            )
            self.say("RUNNING")
            if self.dataplane._drain_stopped(self.cancelled, min(pause, left)):
                break
            self.plan.reopen()
            self.retries += 1
            before = len(self.done)
            self.send_waiting()
            pause = (
                DRAIN_FULL_RETRY_FIRST_SECONDS
                if len(self.done) > before
                else min(2 * pause, DRAIN_FULL_RETRY_MAX_SECONDS)
            )
        self.waited = time.monotonic() - began
        self.note = ""

    def send_waiting(self) -> None:
        """One try of each waiting chain; those still refused (or not reached: a stop) wait on."""
        still = []
        for i, chain in enumerate(self.waiting):
            if self.stopping():
                still.extend(self.waiting[i:])
                break
            if all(h in self.done for h in chain.block_hashes):
                continue
            n = len(self.done)
            if not self.send(chain):
                still.append(chain)
            if len(self.done) > n:
                self.say("RUNNING")
        self.waiting = still

    def held_left(self) -> int:
        """The blocks not handed off that this agent still holds: a SUCCEEDED drain's failed
        ones (`kvctl drain --wait` exits 3 on them: taking the agent down loses them). Those
        it dropped meanwhile (a cleanup, eviction or corruption) are lost to no one."""
        pool, left = self.dataplane.pool, list(self.hashes - self.done)
        held = 0
        for i in range(0, len(left), HELD_LEFT_CHUNK):  # a chunk at a time: the engine waits on the lock
            with pool.lock:
                blocks = pool.blocks
                held += sum(1 for h in left[i : i + HELD_LEFT_CHUNK] if (m := blocks.get(h)) is not None and m.visible)
        return held

    def report(self) -> None:
        """The drain's final answer: CANCELLED, FAILED or SUCCEEDED, with what was left and why."""
        plan, done, total = self.plan, self.done, self.total
        skipped = self.skipped
        if self.waiting:  # (a cancel or a stop says otherwise)
            full = plan.full_destinations
            tries = (
                f", and it stayed full through {self.retries} retries in {self.waited:.1f} s" if self.retries else ""
            )
            skipped.extend(f"{d} full: other handoffs took its room since the drain began{tries}" for d in full)
            if not full:  # (every destination that could take them failed or was given up last)
                skipped.append("no destination has room for a chain")
        result = ", ".join(f"{d}: {human_bytes(n)}" for d, n in self.sent_to.items() if n) or "nothing sent"
        left = total - len(done)
        why = "; ".join(
            [f"{d} given up: {reason}" for d, reason in plan.given_up.items()]
            + sorted(set(skipped))
            + (["destinations full"] if plan.exhausted and left and not plan.given_up and not self.waiting else [])
        )
        if self.cancelled.is_set():  # failed: what was tried and left behind; the blocks not tried are neither
            self.say("CANCELLED", num_failed_blocks=len(self.tried - done), result=result)
        elif self.dataplane._closing and left:  # (not a drain that did all it could: one cut short)
            self.say(
                "FAILED",
                num_failed_blocks=left,
                result=result,
                error=f"the agent stopped with {left} of {total} blocks left",
            )
        elif left and not done and (held := self.held_left()):  # (none held: none lost, as below)
            self.say(
                "FAILED", num_failed_blocks=held, error=f"no block of {total} handed off: {why or 'no destination'}"
            )
        else:
            self.say(
                "SUCCEEDED",
                num_failed_blocks=self.held_left() if left and done else 0,
                result=result,
                error=f"{left} of {total} blocks not handed off: {why}" if left else "",
            )
