"""Asynchronous, batched block movement between tiers: operations with an id, state
and progress, run one at a time by a background thread. Control-plane commands and the
engine API (a load from a lower tier promotes) both submit here. Blocks move in
batches: between the CPU slab and the disk, one vectored call per run of adjacent disk
extents moves many blocks at once."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.core.block_pool import BlockPool
from protos.tier import Tier

log = logging.getLogger(__name__)

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
TERMINAL = {SUCCEEDED, FAILED, CANCELLED}
BATCH_BLOCKS = 32  # blocks a batch moves at once (cancellation and progress go by batch)
PROMOTE_BACKOFF_SECONDS = 1.0  # no load promotion after one found no room, for this long
BUSY_RETRY_SECONDS = 5.0  # an operation's block another move had is tried again for this long


@dataclass
class MoveOp:
    op_id: str
    kind: str  # move | promote | compress
    to_tier: Tier | None  # None: stay in the current tier (compress in place)
    codec: str | None
    block_hashes: list[bytes]
    state: str = PENDING
    num_done_blocks: int = 0
    num_failed_blocks: int = 0
    moved_bytes: int = 0
    error: str = ""
    created_unix_seconds: float = field(default_factory=time.time)
    finished_unix_seconds: float = 0.0
    cancel_requested: bool = False
    pinned: list[tuple[bytes, int]] = field(default_factory=list)  # (block, pin tier) left where a pin holds it
    num_gone_blocks: int = 0  # blocks no longer held when their batch came (neither done nor failed)
    finish_told: bool = False  # the mover's finish listeners have seen it end
    num_kept_blocks: int = 0  # blocks a compress left in their codec (the new one would not shrink them)

    @property
    def num_total_blocks(self) -> int:
        return len(self.block_hashes)


class Mover:
    def __init__(self, pool: BlockPool, on_update: Callable[[MoveOp], None] | None = None, keep_finished: int = 256):
        self.pool = pool
        self.on_update = on_update
        # called once with each operation that ends (the metrics' durations: the mover
        # keeps only its latest `keep_finished`, fewer than end between two scrapes)
        self.finish_listeners: list[Callable[[MoveOp], None]] = []
        self._queue: queue.Queue[MoveOp] = queue.Queue()
        self._ops: OrderedDict[str, MoveOp] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.keep_finished = keep_finished
        self._promoting: set[bytes] = set()
        self._no_room_until = 0.0  # monotonic: load promotions are not tried before then

    def submit(
        self,
        block_hashes: Sequence[bytes],
        to_tier: Tier | None,
        codec: str | None = None,
        kind: str = "move",
        op_id: str = "",
    ) -> MoveOp:
        op = MoveOp(op_id or f"local-{next(self._ids)}", kind, to_tier, codec, list(block_hashes))
        with self._lock:
            self._ops[op.op_id] = op
            while len(self._ops) > self.keep_finished:
                oldest = next(iter(self._ops.values()))
                if oldest.state not in TERMINAL:
                    break
                self._ops.popitem(last=False)
        self._queue.put(op)
        return op

    def promote(self, block_hashes: Sequence[bytes]) -> MoveOp | None:
        """Bring blocks read from a lower tier up to the fastest one (deduplicated). After
        a promotion found no room up there (pins, or loads in flight, hold all of it) none
        is tried for PROMOTE_BACKOFF_SECONDS: every load would otherwise try again, fail
        and hold the pool's lock for the search."""
        with self._lock:
            if time.monotonic() < self._no_room_until:
                return None
            fresh = [h for h in block_hashes if h not in self._promoting]
            self._promoting.update(fresh)
        if not fresh:
            return None
        return self.submit(fresh, self.pool.top.tier, kind="promote")

    def get(self, op_id: str) -> MoveOp | None:
        with self._lock:
            return self._ops.get(op_id)

    def ops(self) -> list[MoveOp]:
        with self._lock:
            return list(self._ops.values())

    def cancel(self, op_id: str) -> bool:
        op = self.get(op_id)
        if op is None or op.state in TERMINAL:
            return False
        op.cancel_requested = True
        return True

    def _update(self, op: MoveOp) -> None:
        if op.state in TERMINAL and not op.finish_told:
            op.finish_told = True
            for listener in self.finish_listeners:
                try:
                    listener(op)
                except Exception:  # noqa: BLE001 - an observer does not fail the operation
                    log.exception("a finish listener failed on %s", op.op_id)
        if self.on_update:
            self.on_update(op)

    def run_op(self, op: MoveOp) -> MoveOp:
        try:
            return self._run_op(op)
        except Exception as exc:
            log.exception("move %s failed", op.op_id)
            op.state, op.error = (
                FAILED,
                f"internal error on the agent ({type(exc).__name__}: {exc}); its log has the trace",
            )
            op.finished_unix_seconds = time.time()
            with self._lock:
                self._promoting.difference_update(op.block_hashes)
            self._update(op)  # the control plane hears the failure and why, not a silence
            raise

    def _run_op(self, op: MoveOp) -> MoveOp:
        if op.cancel_requested:
            op.state = CANCELLED
        else:
            op.state = RUNNING
            self._update(op)
            landed: list[bytes] = []  # the blocks this move put (or found) in its tier
            # ... referenced until it ends: a later batch making room must not push them out
            # again (its done count went down at the end; now the blocks that find no room fail)
            held: list = []
            try:
                self._move_batches(op, landed, held)
                if op.kind == "move" and op.to_tier is not None:
                    self._count_pushed_out(op, landed)
            finally:
                self.pool.release_chain(held)
            kept = op.num_kept_blocks
            if kept and not op.error:
                op.error = f"{kept} block(s) kept in their codec: {op.codec} would free none of their room"
            if op.num_gone_blocks and not op.error:
                op.error = f"{op.num_gone_blocks} block(s) no longer held here (evicted or dropped meanwhile)"
            if op.pinned and not op.error:
                tiers = sorted({Tier(t).label for _, t in op.pinned})
                op.error = f"{len(op.pinned)} block(s) left where pins hold them (at tier {', '.join(tiers)})"
            accounted = op.num_done_blocks + op.num_failed_blocks + op.num_gone_blocks + len(op.pinned)
            if op.cancel_requested and accounted < op.num_total_blocks:
                op.state = CANCELLED
            else:  # a block it could not put where asked fails the operation (the counts say how much)
                op.state = SUCCEEDED if op.num_failed_blocks == 0 else FAILED
        if op.kind == "promote":
            with self._lock:
                self._promoting.difference_update(op.block_hashes)
        op.finished_unix_seconds = time.time()
        self._update(op)
        return op

    def _move_batches(self, op: MoveOp, landed: list[bytes], held: list) -> None:
        """Move the blocks batch by batch, counting each outcome (and updating the control
        plane at most every 0.2 s). A move's landed blocks are referenced into `held`."""
        last = time.monotonic()
        for start, outcomes in self._outcomes(op):
            for k, outcome in enumerate(outcomes, start):
                if outcome is None or outcome.gone:  # not held (evicted meanwhile): nothing to move
                    op.num_gone_blocks += 1
                elif outcome.ok:
                    op.num_done_blocks += 1
                    op.moved_bytes += outcome.moved_bytes
                    landed.append(op.block_hashes[k])
                    op.num_kept_blocks += outcome.kept
                    if op.kind == "move" and op.to_tier is not None:
                        held += self.pool.acquire_chain(op.block_hashes[k : k + 1])
                elif outcome.pinned_tier:  # where a pin holds it: skipped, as a cleanup skips it
                    op.pinned.append((op.block_hashes[k], outcome.pinned_tier))
                else:
                    op.num_failed_blocks += 1
                    op.error = outcome.reason
                    if held and op.to_tier is not None and outcome.reason.startswith("PoolFull"):
                        op.error = (
                            f"PoolFull: the {op.to_tier.label} tier cannot hold them all: it is full of the "
                            f"{len(held)} block(s) this move put there and of pinned, in-use or moving ones"
                        )
                    if op.kind == "promote" and outcome.reason.startswith("PoolFull"):
                        with self._lock:
                            self._no_room_until = time.monotonic() + PROMOTE_BACKOFF_SECONDS
            if time.monotonic() - last > 0.2:
                last = time.monotonic()
                self._update(op)

    def _count_pushed_out(self, op: MoveOp, landed: list[bytes]) -> None:
        """A move of more than its tier holds: each batch makes room by demoting the least
        recently used blocks, which may be the ones earlier batches of this same move
        brought in. Those are not where the move put them: counted failed, and said."""
        gone = [h for h in landed if self.pool.tier_of(h) is not op.to_tier]
        if gone and op.to_tier is not None:
            op.num_done_blocks -= len(gone)
            op.num_failed_blocks += len(gone)
            op.error = (
                f"{len(gone)} of the blocks moved to the {op.to_tier.label} tier were pushed out again by "
                "later ones (the tier cannot hold them all)"
            )

    def _outcomes(self, op: MoveOp):
        """(first block's index, the blocks' outcomes) for each batch of BATCH_BLOCKS, in
        order (BlockPool.move_blocks: one vectored disk call per run of adjacent extents,
        codecs on codec threads, copies between memory slabs in chunks). Stops once
        cancelled."""
        for start in range(0, op.num_total_blocks, BATCH_BLOCKS):
            if op.cancel_requested:
                return
            # to_tier None (a compress): each block where it is when its batch starts
            batch = op.block_hashes[start : start + BATCH_BLOCKS]
            outcomes = self.pool.move_blocks(batch, op.to_tier, op.codec)
            if op.kind != "promote":
                outcomes = self._retry_busy(op, batch, outcomes)
            yield start, outcomes

    def _retry_busy(self, op: MoveOp, batch: list[bytes], outcomes: list) -> list:
        """Blocks another move had when their batch came (a store making room, the disk's
        compaction, a load's promotion: each over in milliseconds) are tried again for up
        to BUSY_RETRY_SECONDS: an operator's operation does not fail for the agent's own
        background work (a stress review's driver: about 1 operation in 100 did)."""
        outcomes = list(outcomes)
        if not any(o is not None and o.busy for o in outcomes):
            return outcomes
        # the blocks the batch put in the tier are referenced while the others are tried
        # again, as _move_batches references them after: the room made meanwhile (for a
        # busy block, or by a store) must not push them out again
        landed: list = []
        if op.kind == "move" and op.to_tier is not None:
            for k, o in enumerate(outcomes):
                if o is not None and o.ok:
                    landed += self.pool.acquire_chain(batch[k : k + 1])
        try:
            deadline = time.monotonic() + BUSY_RETRY_SECONDS
            pause = 0.005
            while not op.cancel_requested and time.monotonic() < deadline:
                busy = [k for k, o in enumerate(outcomes) if o is not None and o.busy]
                if not busy:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
                for k, outcome in zip(
                    busy, self.pool.move_blocks([batch[k] for k in busy], op.to_tier, op.codec), strict=True
                ):
                    outcomes[k] = outcome
        finally:
            self.pool.release_chain(landed)
        return outcomes

    def run_once(self, timeout_seconds: float = 0.1) -> MoveOp | None:
        try:
            op = self._queue.get(timeout=timeout_seconds)
        except queue.Empty:
            return None
        return self.run_op(op)

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - one bad operation must not stop every later one
                log.exception("mover: an operation failed unexpectedly")

    def wait(self, op: MoveOp, timeout_seconds: float = 30.0) -> MoveOp:
        deadline = time.monotonic() + timeout_seconds
        while op.state not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.005)
        return op
