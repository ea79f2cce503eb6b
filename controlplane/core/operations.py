"""Operations (move, cleanup, compress, transfer): asynchronous, with an op_id, a state,
per-agent progress and a result. The control plane fans an operation out to agents as
commands; agents report OpUpdates, folded here into one state.

States: PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED. An operation succeeds
when every agent it was sent to succeeded; it fails when one failed, left, or went
silent for longer than the timeout. An agent given up so (by the control plane, not by
its own report) may still have run the command: its final report, when it comes, takes
the place of the failure, and the operation's state follows what was done. A cancel
ends at once only the parts no command has gone to; a part whose agent has the command
ends with the agent's own answer (CANCELLED with how far it got, or SUCCEEDED)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from protos.tier import Tier

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
STATES = frozenset({PENDING, RUNNING}) | TERMINAL
# kinds an agent runs to the end once it has the command (its mover cancels moves and
# compressions only): a cancel could not stop them, so one is refused rather than reported
UNCANCELLABLE_ONCE_SENT = frozenset({"cleanup", "transfer"})
_TIERS = frozenset(int(t) for t in Tier)


@dataclass
class AgentPart:
    agent_id: str
    state: str = PENDING
    num_done_blocks: int = 0
    num_total_blocks: int = 0
    num_failed_blocks: int = 0
    num_skipped_pinned_blocks: int = 0  # left in place: a pin holds them
    moved_bytes: int = 0
    error: str = ""
    freed: dict[int, tuple[int, int]] = field(default_factory=dict)  # tier -> (blocks, bytes)
    updated_unix_seconds: float = 0.0
    given_up: bool = False  # FAILED by the control plane (silent, left): the agent's last word may still come
    incarnation: str = ""  # the agent process its command went to ("" unknown): another one lost it
    result: str = ""  # what the agent says its part came to (a transfer: the path taken)


@dataclass(frozen=True)
class DrainLanding:
    """What a drain landed at one destination, as told by its agent's progress and by the
    destination's usage reports to this control plane (their count, `stats_reports`, is its
    own: a new leader's start at 0). `reported_bytes` landed by a point the destination
    has reported twice since (one report may have been on its way then), so its reports
    show them; `landed_bytes` landed by when its count stood at `reports_at`, shown once it
    reported twice after that. reported_bytes <= landed_bytes <= what the drain was given there."""

    reported_bytes: int
    landed_bytes: int
    reports_at: int


@dataclass
class Operation:
    op_id: str
    kind: str
    params: dict[str, str]
    state: str = PENDING
    error: str = ""
    dry_run: bool = False
    parts: dict[str, AgentPart] = field(default_factory=dict)
    created_unix_seconds: float = field(default_factory=time.time)
    updated_unix_seconds: float = field(default_factory=time.time)
    cancel_requested: bool = False
    waiting_for_lock: bool = False  # queued behind a scope lock: no command has gone out yet
    commands_sent: bool = False  # its agents were sent their commands

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def num_done_blocks(self) -> int:
        return sum(p.num_done_blocks for p in self.parts.values())

    @property
    def num_total_blocks(self) -> int:
        return sum(p.num_total_blocks for p in self.parts.values())

    @property
    def num_failed_blocks(self) -> int:
        return sum(p.num_failed_blocks for p in self.parts.values())

    @property
    def num_skipped_pinned_blocks(self) -> int:
        return sum(p.num_skipped_pinned_blocks for p in self.parts.values())

    @property
    def moved_bytes(self) -> int:
        return sum(p.moved_bytes for p in self.parts.values())

    @property
    def result(self) -> str:
        """The parts' results: one part's alone, several as "agent: result; ..."."""
        said = [(p.agent_id, p.result) for p in self.parts.values() if p.result]
        if len(self.parts) == 1:
            return said[0][1] if said else ""
        return "; ".join(f"{a}: {r}" for a, r in said)

    @property
    def progress(self) -> float:
        """The share of its blocks accounted for (done or failed); a cancelled operation
        shows how far it got, not 100 %."""
        if self.state == SUCCEEDED:
            return 1.0
        num_total_blocks = self.num_total_blocks
        if self.finished and not num_total_blocks:
            return 1.0
        if num_total_blocks:
            accounted = self.num_done_blocks + self.num_failed_blocks + self.num_skipped_pinned_blocks
            return min(1.0, accounted / num_total_blocks)
        parts = self.parts.values()
        return sum(p.state in TERMINAL for p in parts) / len(self.parts) if self.parts else 0.0

    def freed(self) -> dict[Tier, tuple[int, int]]:
        out: dict[Tier, list[int]] = {}
        for p in self.parts.values():
            for t, (n, b) in p.freed.items():
                if t not in _TIERS:  # stored before agents' reports were checked
                    continue
                acc = out.setdefault(Tier(t), [0, 0])
                acc[0] += n
                acc[1] += b
        return {t: (v[0], v[1]) for t, v in sorted(out.items())}


def new_operation(
    kind: str, params: dict[str, str], agent_ids: list[str], dry_run: bool = False, now: float | None = None
) -> Operation:
    now = time.time() if now is None else now
    op = Operation(
        f"{kind}-{uuid.uuid4().hex[:10]}",
        kind,
        dict(params),
        dry_run=dry_run,
        created_unix_seconds=now,
        updated_unix_seconds=now,
    )
    op.parts = {a: AgentPart(a, updated_unix_seconds=now) for a in agent_ids}
    if not agent_ids:
        op.state = SUCCEEDED  # nothing to do anywhere: done at once, said so in the result
        op.error = ""
    return op


def apply_update(
    op: Operation,
    agent_id: str,
    state: str,
    num_done_blocks: int,
    num_total_blocks: int,
    num_failed_blocks: int,
    moved_bytes: int,
    error: str,
    num_skipped_pinned_blocks: int = 0,
    freed: dict[int, tuple[int, int]] | None = None,
    now: float | None = None,
    result: str = "",
) -> bool:
    """Fold one agent's OpUpdate in; returns True when the operation's state changed. An
    update with a state this module does not know is ignored, and freed counts of tiers
    it does not know are dropped (one bad report must not break every listing)."""
    now = time.time() if now is None else now
    part = op.parts.get(agent_id)
    if part is None or state not in STATES:
        return False
    if part.given_up and state in TERMINAL:
        # the agent ran it after all: what it says replaces the failure the control plane
        # declared (the operation, finished or not, is settled again from its parts)
        part.given_up = False
        op.state = RUNNING
    elif op.finished:
        return False
    part.state, part.num_done_blocks, part.num_failed_blocks = state, num_done_blocks, num_failed_blocks
    part.num_total_blocks = max(num_total_blocks, part.num_total_blocks)
    part.moved_bytes, part.error, part.num_skipped_pinned_blocks = moved_bytes, error, num_skipped_pinned_blocks
    part.result = result
    if freed is not None:
        part.freed = {int(t): v for t, v in freed.items() if t in _TIERS}
    part.updated_unix_seconds = now
    op.updated_unix_seconds = now
    return _settle(op)


def _settle(op: Operation) -> bool:
    before = op.state
    states = [p.state for p in op.parts.values()]
    if all(s in TERMINAL for s in states):
        if op.cancel_requested and all(s == SUCCEEDED for s in states):
            # every part had finished its work before the cancel reached it: it ran, say so
            op.state = SUCCEEDED
            op.error = "cancel came after every agent had finished"
        elif op.cancel_requested or any(s == CANCELLED for s in states):
            op.state = CANCELLED
            op.error = ""  # (a failure declared before a late report is no longer the story)
        elif any(s == FAILED for s in states):
            op.state = FAILED
            op.error = "; ".join(f"{p.agent_id}: {p.error or 'failed'}" for p in op.parts.values() if p.state == FAILED)
        else:
            op.state = SUCCEEDED
            # what the agents noted about work that succeeded (blocks kept, a prefix held
            # only in part); a failure declared before a late report is no longer among them
            op.error = "; ".join(f"{p.agent_id}: {p.error}" for p in op.parts.values() if p.error)
    elif any(s != PENDING for s in states):
        op.state = RUNNING
    return op.state != before


def fail_part(op: Operation, agent_id: str, reason: str, now: float | None = None, given_up: bool = False) -> bool:
    """`given_up`: failed for the agent's silence or absence, not by its own word."""
    part = op.parts.get(agent_id)
    if part is None or part.state in TERMINAL or op.finished:
        return False
    part.state, part.error, part.given_up = FAILED, reason, given_up and op.commands_sent
    part.updated_unix_seconds = op.updated_unix_seconds = time.time() if now is None else now
    return _settle(op)


def expire_silent_parts(op: Operation, now: float, timeout_seconds: float) -> bool:
    """Fail agents that have not reported within the timeout (level-triggered)."""
    changed = False
    for part in op.parts.values():
        if part.state not in TERMINAL and now - part.updated_unix_seconds > timeout_seconds:
            changed |= fail_part(op, part.agent_id, f"no progress for {timeout_seconds:.0f}s", now, given_up=True)
    return changed


def not_cancellable(op: Operation) -> str:
    """Why a cancel cannot stop `op` (a sentence), or "" when it can."""
    if op.kind in UNCANCELLABLE_ONCE_SENT and not op.waiting_for_lock:
        return (
            f"a {op.kind} cannot be stopped once its agents have it (they run it to the end); "
            "its result will show what it did"
        )
    return ""


def cancel(op: Operation, now: float | None = None) -> bool:
    if op.finished:
        return False
    op.cancel_requested = True
    if op.waiting_for_lock or not op.commands_sent:
        for part in op.parts.values():
            if part.state == PENDING:
                part.state = CANCELLED
    op.updated_unix_seconds = time.time() if now is None else now
    _settle(op)
    return True
