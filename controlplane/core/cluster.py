"""Cluster state of the leader: agents, their sync sessions, and the block index.

The API layer translates protobuf into the plain values below and calls these methods;
everything here is pure and thread-safe (one lock), so scenario tests drive it directly.

Sync protocol (per agent stream): Hello(session) -> Inventory chunks (seq S) -> event
batches S+1, S+2, ... A batch whose seq is not last_seq + 1 means events were lost: the
agent is asked to resync and its batches are ignored until the next full inventory.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Protocol

from controlplane.core.events import EventBus
from controlplane.core.index import AgentMatch, BlockIndex, PrefixHolders
from controlplane.core.routing import DataPlaneStates
from protos import errors
from protos.block_hash import (
    BLOCK_HASH_BYTES,
    MAX_PROMPT_BLOCKS,
    MAX_PROMPT_TOKENS,
    check_extra_keys,
    check_prompt_size,
    hash_prefix,
)
from protos.kv_format import DTYPE_BYTES, kv_block_bytes
from protos.tier import Tier

MAX_LOOKUP_TOKENS, MAX_LOOKUP_BLOCKS = MAX_PROMPT_TOKENS, MAX_PROMPT_BLOCKS
# blocks one agent may stage in an unfinished inventory (16 bytes each): bounds the memory
# a misbehaving agent can hold before its last chunk
MAX_INVENTORY_BLOCKS = 1 << 25
# an agent heard on its open stream within this long is alive though its etcd lease ended
# (agents report stats every second)
LIVE_STREAM_SECONDS = 5.0


class Outbox(Protocol):
    """Where an agent's commands go: its open Sync stream's queue (api/)."""

    def put(self, item: object) -> None: ...


class AgentEntry(NamedTuple):
    record: AgentRecord
    num_blocks: int


class AgentState(IntEnum):
    READY = 1
    SYNCING = 2
    DISCONNECTED = 3


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    block_size: int
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""


MAX_MODEL_DIMENSION = 1 << 20  # layers, KV heads, head_dim, block_size: far past any model
MAX_BLOCK_BYTES = 1 << 40


def _check_model(m: ModelInfo) -> None:
    """A model an agent registers: a name, and a layout whose sizes are sane (0: not told).
    An absurd one (2^32-1 layers) made a pin's bytes overflow its answer: the pin was
    written, and every ListPins failed until it expired (a review)."""
    if not m.model_id or len(m.model_id) > 256 or not m.model_id.isprintable():
        raise errors.InvalidArgument("agent.models.model_id", f"{m.model_id[:80]!r} is not a model id")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
        value = getattr(m, name)
        if not 0 <= value <= MAX_MODEL_DIMENSION:
            raise errors.InvalidArgument(f"agent.models.{name}", f"{value} is out of range [0, {MAX_MODEL_DIMENSION}]")
    if m.dtype and m.dtype not in DTYPE_BYTES:
        raise errors.InvalidArgument(
            "agent.models.dtype", f"unknown dtype {m.dtype!r} (known: {', '.join(DTYPE_BYTES)})"
        )
    if kv_block_bytes(m.num_layers, m.block_size, m.num_kv_heads, m.head_dim, m.dtype) > MAX_BLOCK_BYTES:
        raise errors.InvalidArgument("agent.models", f"model {m.model_id!r}: a block of over {MAX_BLOCK_BYTES} bytes")


@dataclass(frozen=True)
class TierUsage:
    """One tier of an agent (or the cluster's sum): `uncompressed_bytes` is what its blocks
    would take raw, `stored_bytes` what they take as stored (after any codec)."""

    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    uncompressed_bytes: int = 0
    stored_bytes: int = 0
    num_parked_blocks: int = 0  # recovered after a restart, in used_bytes, not in num_blocks
    # the blocks' own footprint: used_bytes less reserved pages (handoffs arriving) and
    # parked blocks; 0 when not reported (an older agent)
    blocks_used_bytes: int = 0


@dataclass
class AgentRecord:
    agent_id: str
    address: str
    models: list[ModelInfo]
    tiers: list[TierUsage]
    metrics_address: str = ""
    # its handoff paths, as it registered them: the engine ("" = none) and why not, shared memory
    transfer_engine: str = ""
    transfer_engine_status: str = ""
    shm_handoff: bool = False
    state: AgentState = AgentState.SYNCING
    session_id: str = ""
    incarnation: str = ""  # the agent process behind the current session ("" from older agents)
    runs_commands_once: bool = False  # a repeated command is answered, not run again (older agents: False)
    last_seq: int = 0
    awaiting_inventory: bool = True
    last_seen_unix_seconds: float = 0.0
    registered_at_unix_seconds: float = 0.0
    stats_reports: int = 0  # stats reports taken on any stream (tells a fresh report from one already seen)
    tier_moved_bytes_total: int = 0  # bytes the agent moved between its tiers (its process's count)
    lookups_total: int = 0
    lookup_tokens_total: int = 0
    lookup_hit_tokens_total: int = 0
    # inventory chunks received so far, (packed digests, tier); swapped in at the last chunk
    staging: list[tuple[bytes, int, bytes]] = field(default_factory=list)
    next_chunk: int = 0
    namespaces: dict[str, tuple[int, int]] = field(default_factory=dict)  # ns -> (blocks, bytes)
    # commands go down the agent's current Sync stream; pins applied on this stream
    outbox: Outbox | None = None
    outbox_session: str = ""  # the session of the stream `outbox` feeds ("" none)
    applied_pins: dict[str, str] = field(default_factory=dict)  # pin id -> version sent on this stream
    reported_pins: dict[str, str] = field(default_factory=dict)  # what the agent's Hello said it holds


@dataclass(frozen=True)
class AgentCommand:
    """A command for one agent (the API layer turns it into a ControlMessage)."""

    op_id: str
    kind: str  # move | evict | compress | pin | unpin | cancel | cleanup | transfer | drain
    block_hashes: bytes = b""
    tier: int = 0
    codec: str = ""
    namespace: str = ""
    model_id: str = ""
    older_than_seconds: float = 0.0
    dry_run: bool = False
    only_tier: int = 0
    pin_id: str = ""
    pin_version: str = ""
    expires_unix_seconds: float = 0.0
    peer_agent_id: str = ""  # transfer: the destination
    deadline_seconds: float = 0.0  # transfer: answer within this (0: the agent's default)
    peer_agent_ids: tuple[str, ...] = ()  # drain: the destinations, the roomiest first
    peer_free_bytes: tuple[int, ...] = ()  # drain: the most each is sent (policy.room_without_drops_bytes)
    # drain: each one's drop line (policy.drop_line_bytes), which its Reserves hold the drain's blocks to
    peer_fill_limit_bytes: tuple[int, ...] = ()
    # cleanup: the control plane's time its commands first went out, which older_than_seconds
    # counts back from however late the command arrives (sent again after a failover, or
    # on a new stream); 0: from when the agent runs it
    older_than_from_unix_seconds: float = 0.0


@dataclass(frozen=True)
class BlockGroup:
    """Blocks of one model in one tier, as packed 16-byte digests, with their parents'
    digests in the same order (empty: not told)."""

    model_id: str
    tier: Tier
    block_hashes: bytes
    parent_hashes: bytes = b""

    def validate(self) -> None:
        """InvalidArgument naming the field when the digests are not whole or the parents
        do not pair with the blocks."""
        if len(self.block_hashes) % BLOCK_HASH_BYTES:
            raise errors.InvalidArgument(
                "groups.block_hashes", f"length {len(self.block_hashes)} is not a multiple of {BLOCK_HASH_BYTES}"
            )
        if self.parent_hashes and len(self.parent_hashes) != len(self.block_hashes):
            raise errors.InvalidArgument(
                "groups.parent_hashes",
                f"{len(self.parent_hashes)} bytes for {len(self.block_hashes) // BLOCK_HASH_BYTES} blocks "
                f"(expected one {BLOCK_HASH_BYTES}-byte parent per block, or none)",
            )


@dataclass(frozen=True)
class LookupResult:
    model_id: str
    num_tokens: int
    num_blocks: int
    block_size: int
    holders: PrefixHolders
    possibly_stale: bool = False
    block_hashes: bytes = b""  # the prefix looked up, packed

    @functools.cached_property
    def matches(self) -> list[AgentMatch]:
        return self.holders.matches()

    @property
    def best_agent_id(self) -> str:
        return self.holders.agent_ids[0] if len(self.holders) else ""


@dataclass(frozen=True)
class ClusterStats:
    num_agents: int
    num_blocks: int
    num_block_replicas: int
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    resyncs_total: int
    events_total: int
    tiers: list[TierUsage]
    models: list[ModelInfo]
    tier_moved_bytes_total: int = 0  # summed over the agents here (each counts since it started)


class Cluster:
    """Agents and the global index. Invariant: the index holds blocks only of agents in
    `_agents` (an agent that leaves takes its blocks with it)."""

    def __init__(self, clock=time.time, expected_blocks: int = 0) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._agents: dict[str, AgentRecord] = {}
        self._kept_without_lease: set[str] = set()  # streaming agents whose key etcd deleted
        self._models: dict[str, ModelInfo] = {}
        # every model an agent served since this control plane started: one whose agents
        # are all away for a moment is still a model (lookups find nothing), not unknown
        self._models_seen: dict[str, ModelInfo] = {}
        self._serving: dict[str, frozenset[str]] = {}  # model -> ids of the agents serving it
        # agents with a key in etcd at the last membership listing: until each is back and
        # synced here (a new leader, an agent resyncing), answers may miss what they hold
        # (None before the first listing: nobody can tell yet whether an agent left)
        self._expected_agents: frozenset[str] | None = None
        self._rebuilding = (0.0, False)  # (monotonic time computed, value)
        self.index = BlockIndex(expected_blocks)
        self.lookups_total = 0
        self.lookup_tokens_total = 0
        self.lookup_hit_tokens_total = 0
        self.resyncs_total = 0
        self.events_total = 0
        # what the dashboard watches (AdminService.Watch); published to with no lock of ours needed
        self.events = EventBus(clock=clock)
        # roles and data-plane reports (free capacity, queues, link throughput) for Route
        self.dataplane = DataPlaneStates()
        # told (packed block hashes, now) of every lookup (the policy's access stats)
        self.on_lookup: Callable[[bytes, float], None] | None = None
        # agents a lookup found holding part of a prefix below their fastest tier since the
        # tier policy last decided for them (its cue that promoting may pay)
        self._slow_hits: set[str] = set()
        # agent -> reason: cordoned by an operator (policy keys cordon.<agent_id>, kvctl
        # cordon): routers are not sent there (Lookup and Route leave it out); it keeps its
        # blocks, its policy passes, and can still be a transfer's source
        self._cordoned: dict[str, str] = {}

    # ---- cordons --------------------------------------------------------------------
    def set_cordoned(self, reasons: dict[str, str]) -> None:
        """The cordoned agents as the policy now says (agent id -> reason)."""
        with self._lock:
            self._cordoned = dict(reasons)

    def cordon_reason(self, agent_id: str) -> str:
        """Why the agent is cordoned; "" when it is not."""
        with self._lock:
            return self._cordoned.get(agent_id, "")

    # ---- membership -----------------------------------------------------------------
    def register(self, record: AgentRecord) -> None:
        if not record.agent_id:
            raise errors.InvalidArgument("agent.agent_id", "must not be empty")
        with self._lock:
            # block sizes other agents serve; the registering agent's old record does not count
            sizes = {
                m.model_id: m.block_size
                for a in self._agents.values()
                if a.agent_id != record.agent_id
                for m in a.models
            }
            mine: dict[str, int] = {}
            for m in record.models:
                _check_model(m)
                if m.block_size <= 0:
                    raise errors.InvalidArgument("agent.models.block_size", "must be positive")
                if mine.get(m.model_id, m.block_size) != m.block_size:
                    raise errors.InvalidArgument(
                        "agent.models.block_size", f"model {m.model_id!r} is listed twice with different block sizes"
                    )
                mine[m.model_id] = m.block_size
                known = sizes.get(m.model_id)
                if known is not None and known != m.block_size:
                    raise errors.InvalidArgument(
                        "agent.models.block_size",
                        f"model {m.model_id!r} has block_size {known} on other agents, not {m.block_size}",
                    )
            old = self._agents.get(record.agent_id)
            if old is not None:
                # keep the sync position and counters of a re-registering agent
                record.session_id, record.last_seq = old.session_id, old.last_seq
                record.incarnation = old.incarnation
                record.awaiting_inventory = old.awaiting_inventory
                record.lookups_total = old.lookups_total
                record.lookup_tokens_total = old.lookup_tokens_total
                record.lookup_hit_tokens_total = old.lookup_hit_tokens_total
                # the policy's urgent pass compares report counts; the dashboard rates moved bytes
                record.stats_reports = old.stats_reports
                record.tier_moved_bytes_total = old.tier_moved_bytes_total
            record.last_seen_unix_seconds = record.registered_at_unix_seconds = self._clock()
            self._agents[record.agent_id] = record
            self._refresh_models()
            if old is None:
                self.events.publish(
                    "agent_joined", f"{record.agent_id} joined from {record.address}", agent_id=record.agent_id
                )

    def _refresh_models(self) -> None:
        """Models are those some registered agent serves (lock held)."""
        models: dict[str, ModelInfo] = {}
        serving: dict[str, set[str]] = {}
        for a in self._agents.values():
            for m in a.models:
                models.setdefault(m.model_id, m)
                serving.setdefault(m.model_id, set()).add(a.agent_id)
        self._models = models
        self._models_seen.update(models)
        self._serving = {m: frozenset(ids) for m, ids in serving.items()}

    def remove_agent(self, agent_id: str) -> int:
        """The agent's lease is gone: forget it and its blocks. Returns replicas dropped."""
        with self._lock:
            self._kept_without_lease.discard(agent_id)
            rec = self._agents.pop(agent_id, None)
            known = rec is not None
            self._slow_hits.discard(agent_id)
            self.dataplane.forget(agent_id)
            if rec is not None and rec.outbox is not None:
                # end its stream: a live agent registers again, a dead host's half-open
                # stream stops holding a server thread until keepalive notices (hours)
                rec.outbox.put(errors.NotFound(f"agent {agent_id!r} left (its lease is gone); register again"))
            if known:
                self._refresh_models()
            dropped = self.index.drop_agent(agent_id)
            if known or dropped:
                self.events.publish(
                    "agent_left", f"{agent_id} left (lease gone); {dropped} block replicas dropped", agent_id=agent_id
                )
            return dropped

    def agents_in_etcd(self) -> frozenset[str] | None:
        """The agents that had a key in etcd at the last membership listing (None before
        the first: nobody can tell yet whether an agent left)."""
        return self._expected_agents

    def agents_not_registered(self) -> bool:
        """Is an agent with a key in etcd not registered here (its models unknown yet)?"""
        with self._lock:
            return any(a not in self._agents for a in self._expected_agents or ())

    def runs_commands_once(self, agent_id: str) -> bool:
        """Whether the agent said, on its current stream, that it never runs a repeated
        command twice (an older agent does not: no command is sent it again)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            return rec is not None and rec.runs_commands_once

    def incarnation_of(self, agent_id: str) -> str:
        """The process id the agent's current session said ('' unknown or not here)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            return rec.incarnation if rec is not None else ""

    def agents_not_back(self, indexed: bool) -> frozenset[str]:
        """Agents with a key in etcd at the last listing that have no stream here yet
        (`indexed`: or whose inventory is not in the index yet); empty before a listing."""
        ok = (AgentState.READY,) if indexed else (AgentState.READY, AgentState.SYNCING)
        with self._lock:
            agents = self._agents
            return frozenset(
                a for a in self._expected_agents or () if (r := agents.get(a)) is None or r.state not in ok
            )

    def rebuilding(self) -> bool:
        """Is an agent that has a key in etcd not (yet, or no longer) synced here? Then a
        lookup may miss blocks it holds, or name ones it lost: answers say possibly stale.
        Computed at most every 0.1 s (lookups ask it every time)."""
        at, value = self._rebuilding
        now = time.monotonic()
        if now - at < 0.1:
            return value
        with self._lock:  # cached under the lock: a reset (hello, a closed stream) is never overwritten
            agents = self._agents
            expected = self._expected_agents or ()
            value = any((r := agents.get(a)) is None or r.state != AgentState.READY for a in expected)
            self._rebuilding = (now, value)
        return value

    def reconcile_membership(self, live_agent_ids: set[str], listed_at_unix_seconds: float) -> list[str]:
        """Level-triggered repair: drop every agent not in `live_agent_ids` (listed from
        etcd at `listed_at_unix_seconds`; agents that registered after that are kept, and
        so are agents still streaming: see lease_gone)."""
        with self._lock:
            self._expected_agents = frozenset(live_agent_ids)
            self._rebuilding = (0.0, False)
            self._kept_without_lease -= live_agent_ids  # registered again
            recent = {a for a, r in self._agents.items() if r.registered_at_unix_seconds > listed_at_unix_seconds}
            known = set(self._agents) | set(self.index.agents())
            gone = [a for a in known if a not in live_agent_ids and a not in recent]
            return [a for a in gone if self.lease_gone(a) is not None]

    def lease_gone(self, agent_id: str) -> int | None:
        """The agent's key is gone from etcd (its lease ended). An agent whose Sync stream
        is open and was heard within LIVE_STREAM_SECONDS is alive: an etcd outage longer
        than the agents' lease TTL ends every lease at once, and dropping them all made
        every agent send its whole inventory again (a resync storm at scale). It keeps
        its blocks (None) and registers a new lease when etcd answers; one that goes
        silent or whose stream ends is dropped at the next pass. Otherwise the agent and
        its blocks go (the replicas dropped)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is None or not self._streaming(rec, self._clock(), LIVE_STREAM_SECONDS):
                return self.remove_agent(agent_id)
            if agent_id not in self._kept_without_lease:
                self._kept_without_lease.add(agent_id)
                self.events.publish(
                    "agent_state",
                    f"{agent_id}'s lease is gone but its stream is live: its blocks are kept until it registers again",
                    "warning",
                    agent_id=agent_id,
                )
            return None

    def agent(self, agent_id: str) -> AgentRecord:
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is None:
                raise errors.NotFound(f"agent {agent_id!r} is not registered")
            return rec

    def stats_reports(self, agent_id: str) -> int:
        """How many stats reports the agent has made (0: not registered)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            return rec.stats_reports if rec is not None else 0

    def agents(self) -> list[AgentEntry]:
        """Every agent known, by id, with the blocks the index holds for it."""
        with self._lock:
            return [
                AgentEntry(r, self.index.num_agent_blocks(r.agent_id))
                for r in sorted(self._agents.values(), key=lambda r: r.agent_id)
            ]

    # ---- sync -----------------------------------------------------------------------
    def hello(
        self,
        agent_id: str,
        session_id: str,
        pins: dict[str, str] | None = None,
        incarnation: str = "",
        runs_commands_once: bool = False,
    ) -> None:
        """A Sync stream opened: the agent sends a full inventory next. `pins`: the
        control plane's pins it holds, id -> version (the new stream starts from them).
        `incarnation`: the agent process's id (another one: it restarted).
        `runs_commands_once`: a repeated command is answered, not run (Hello's field)."""
        with self._lock:
            rec = self.agent(agent_id)
            rec.session_id = session_id
            rec.incarnation = incarnation
            rec.runs_commands_once = runs_commands_once
            rec.reported_pins = dict(pins or {})
            rec.state = AgentState.SYNCING
            self.events.publish("agent_state", f"{agent_id} connected; syncing its inventory", agent_id=agent_id)
            rec.awaiting_inventory = True
            rec.staging = []
            rec.next_chunk = 0
            rec.last_seen_unix_seconds = self._clock()
            self._rebuilding = (0.0, False)  # syncing: lookups say possibly stale from now

    @staticmethod
    def _check_models(rec: AgentRecord, groups: list[BlockGroup]) -> None:
        """Blocks only of the models the agent registered (another model's would answer
        that model's lookups)."""
        served = {m.model_id for m in rec.models}
        if not served:
            return  # (a record without models: nothing of it is looked up)
        for g in groups:
            if g.block_hashes and g.model_id not in served:
                raise errors.InvalidArgument(
                    "groups.model_id",
                    f"agent {rec.agent_id!r} registered no model {g.model_id!r} (it serves {', '.join(sorted(served))})",
                )

    def _current(self, agent_id: str, session_id: str | None) -> AgentRecord:
        """The agent's record; FailedPrecondition when `session_id` (None: not checked) is
        not its current session (a stream a newer Hello superseded)."""
        rec = self.agent(agent_id)
        if session_id is not None and rec.session_id != session_id:
            raise errors.FailedPrecondition(
                f"Sync stream of {agent_id!r} was superseded by a newer session; this stream is closed"
            )
        return rec

    def apply_inventory_chunk(
        self,
        agent_id: str,
        seq: int,
        chunk_index: int,
        last_chunk: bool,
        groups: list[BlockGroup],
        session_id: str | None = None,
    ) -> str | None:
        """Stage one chunk; at the last one swap it in. Returns a resync reason on error."""
        with self._lock:
            rec = self._current(agent_id, session_id)
            self._check_models(rec, groups)
            if rec.next_chunk < 0 and chunk_index > 0:
                return None  # the rest of an inventory already given up (its resync is asked for)
            if chunk_index != max(rec.next_chunk, 0):
                reason = f"inventory chunk {chunk_index} arrived, expected {rec.next_chunk}"
                rec.staging, rec.next_chunk = [], -1  # until a chunk 0 starts the next inventory
                rec.awaiting_inventory = True
                rec.state = AgentState.SYNCING  # as for a gap in events: lookups say possibly stale
                self._rebuilding = (0.0, False)
                self.resyncs_total += 1
                self.events.publish("agent_state", f"{agent_id} resyncing: {reason}", "warning", agent_id=agent_id)
                return reason
            staged = sum(len(g[0]) for g in rec.staging) // BLOCK_HASH_BYTES
            for g in groups:
                g.validate()
                staged += len(g.block_hashes) // BLOCK_HASH_BYTES
                if staged > MAX_INVENTORY_BLOCKS:
                    rec.staging, rec.next_chunk = [], 0
                    raise errors.InvalidArgument(
                        "inventory.groups", f"an inventory of more than {MAX_INVENTORY_BLOCKS} blocks"
                    )
                rec.staging.append((g.block_hashes, int(g.tier), g.parent_hashes))
            rec.next_chunk = max(rec.next_chunk, 0) + 1
            if last_chunk:
                self.index.set_clock(self._clock())
                self.index.replace_agent_packed(agent_id, rec.staging)
                rec.staging, rec.next_chunk = [], 0
                rec.last_seq = seq
                rec.awaiting_inventory = False
                rec.state = AgentState.READY
                n = self.index.num_agent_blocks(agent_id)
                self.events.publish("agent_state", f"{agent_id} ready ({n} blocks)", agent_id=agent_id)
            rec.last_seen_unix_seconds = self._clock()
            return None

    def apply_events(
        self, agent_id: str, seq: int, stored: bool, groups: list[BlockGroup], session_id: str | None = None
    ) -> str | None:
        """Apply one event batch. Returns a resync reason when a gap is seen."""
        with self._lock:
            rec = self._current(agent_id, session_id)
            rec.last_seen_unix_seconds = self._clock()
            if rec.awaiting_inventory:
                return None  # a resync is already under way; the inventory supersedes this
            if seq != rec.last_seq + 1:
                rec.awaiting_inventory = True
                rec.state = AgentState.SYNCING
                self._rebuilding = (0.0, False)
                self.resyncs_total += 1
                reason = f"event batch seq {seq} arrived, expected {rec.last_seq + 1}"
                self.events.publish("agent_state", f"{agent_id} resyncing: {reason}", "warning", agent_id=agent_id)
                return reason
            for g in groups:  # validated before anything is applied: a bad batch changes nothing
                g.validate()
            self._check_models(rec, groups)
            rec.last_seq = seq
            self.index.set_clock(rec.last_seen_unix_seconds)  # stamps blocks newly stored
            for g in groups:  # packed digests go into the index as they came off the wire
                self.events_total += len(g.block_hashes) // BLOCK_HASH_BYTES
                if stored:
                    self.index.add(agent_id, g.block_hashes, g.tier, g.parent_hashes)
                else:
                    self.index.remove(agent_id, g.block_hashes)
            return None

    def update_stats(
        self,
        agent_id: str,
        tiers: list[TierUsage],
        lookups: int,
        lookup_tokens: int,
        hit_tokens: int,
        tier_moved_bytes: int = 0,
        session_id: str | None = None,
    ) -> None:
        """`session_id`: the reporting stream's (None: not checked); a superseded one is
        refused (FailedPrecondition), as its events are: it must not overwrite the
        current session's figures."""
        with self._lock:
            rec = self._current(agent_id, session_id)
            rec.tiers = tiers
            rec.tier_moved_bytes_total = tier_moved_bytes
            rec.stats_reports += 1
            rec.lookups_total, rec.lookup_tokens_total, rec.lookup_hit_tokens_total = lookups, lookup_tokens, hit_tokens
            rec.last_seen_unix_seconds = self._clock()

    # ---- commands -------------------------------------------------------------------
    def attach_outbox(self, agent_id: str, session_id: str, outbox: Outbox) -> None:
        """A Sync stream is open: commands for the agent go into `outbox` (put(cmd))."""
        with self._lock:
            rec = self.agent(agent_id)
            if rec.session_id == session_id:
                rec.outbox, rec.outbox_session = outbox, session_id
                # a new stream starts from the pins the agent said it holds: those the
                # control plane no longer has are unpinned, the ones it lacks sent
                rec.applied_pins = dict(rec.reported_pins)

    def send(self, agent_id: str, command: AgentCommand) -> bool:
        """Queue a command for an agent; False when it has no open stream."""
        return bool(self.send_on_stream(agent_id, command))

    def send_on_stream(self, agent_id: str, command: AgentCommand) -> str:
        """Queue a command for an agent; the session id of the stream it went to ("" when
        it has none). A command still queued when that stream closes is lost with it: a
        later stream of the agent has another session id."""
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is None or rec.outbox is None:
                return ""
            rec.outbox.put(command)  # (an unbounded queue: never blocks)
            return rec.outbox_session

    def note_on_stream(self, agent_id: str, session_id: str, note: Callable[[AgentRecord], object]) -> bool:
        """Call note(record) under the lock if the agent's open stream is still `session_id`
        (the one a command went to, send_on_stream); False, without calling it, when a new
        stream replaced it meanwhile (its record starts from what its Hello said)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is None or rec.outbox is None or rec.outbox_session != session_id:
                return False
            note(rec)
            return True

    def stream_of(self, agent_id: str) -> str:
        """The session id of the agent's open stream ("" none)."""
        with self._lock:
            rec = self._agents.get(agent_id)
            return rec.outbox_session if rec is not None and rec.outbox is not None else ""

    def connected_agents(self, max_silence_seconds: float | None = None) -> list[AgentRecord]:
        """Agents with an open Sync stream (a command would reach them), by agent id; with
        `max_silence_seconds`, only those heard from within it (agents report stats every
        second: a hung agent's stream can stay open for minutes), as a router wants."""
        with self._lock:
            now = self._clock()
            return sorted(
                (r for r in self._agents.values() if self._streaming(r, now, max_silence_seconds)),
                key=lambda r: r.agent_id,
            )

    @staticmethod
    def _streaming(rec: AgentRecord, now: float, max_silence_seconds: float | None) -> bool:
        """An open Sync stream, heard within `max_silence_seconds` (None: any silence)."""
        return (
            rec.outbox is not None
            and rec.state != AgentState.DISCONNECTED
            and (max_silence_seconds is None or now - rec.last_seen_unix_seconds <= max_silence_seconds)
        )

    def _below_fastest(self, agent_id: str, tiers: bytes) -> bool:
        rec = self._agents.get(agent_id)
        fastest = min((int(t.tier) for t in rec.tiers), default=0) if rec is not None else 0
        return max(tiers) > fastest

    def slow_hit(self, agent_id: str) -> bool:
        """Did a lookup hit this agent below its fastest tier since forget_slow_hit(agent_id)?"""
        with self._lock:
            return agent_id in self._slow_hits

    def forget_slow_hit(self, agent_id: str) -> None:
        with self._lock:
            self._slow_hits.discard(agent_id)

    def agent_chains(self, agent_id: str):
        """BlockIndex.agent_chains under the lock. A cordoned agent's copy is no replica:
        routers are not sent there, so the tier policy must not evict the copy in
        rotation for having one."""
        with self._lock:
            return self.index.agent_chains(agent_id, not_replicas=self._cordoned.keys() - {agent_id})

    def tiers_held(self, agent_id: str, block_hashes: bytes):
        with self._lock:
            return self.index.tiers_held(agent_id, block_hashes)

    def holders_of(self, block_hashes: list[bytes]) -> dict[str, list[bytes]]:
        """agent_id -> the given blocks it holds (order kept)."""
        with self._lock:
            out: dict[str, list[bytes]] = {}
            for h in block_hashes:
                for a in self.index.holders(h):
                    out.setdefault(a, []).append(h)
            return out

    def namespace_bytes(self, namespace: str, agent_id: str = "") -> int:
        """What the namespace holds, on one agent or ("") on all of them."""
        with self._lock:
            return sum(
                r.namespaces.get(namespace, (0, 0))[1]
                for r in self._agents.values()
                if not agent_id or r.agent_id == agent_id
            )

    def update_namespaces(
        self, agent_id: str, namespaces: dict[str, tuple[int, int]], session_id: str | None = None
    ) -> None:
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is not None and (session_id is None or rec.session_id == session_id):
                rec.namespaces = namespaces

    def stream_closed(self, agent_id: str, session_id: str) -> None:
        """The Sync stream ended; blocks stay indexed until the agent's lease is gone."""
        with self._lock:
            rec = self._agents.get(agent_id)
            if rec is not None and rec.session_id == session_id:
                rec.state = AgentState.DISCONNECTED
                rec.outbox, rec.outbox_session = None, ""
                rec.staging, rec.next_chunk = [], 0  # a half inventory no stream will finish
                self._rebuilding = (0.0, False)  # lookups say possibly stale from now, not in 0.1 s
                self.events.publish(
                    "agent_state", f"{agent_id} disconnected (sync stream closed)", "warning", agent_id=agent_id
                )

    # ---- lookup ---------------------------------------------------------------------
    def model(self, model_id: str) -> ModelInfo:
        with self._lock:
            m = self._models.get(model_id) or self._models_seen.get(model_id)
        if m is None:
            known = ", ".join(sorted(self._models)) or "none yet"
            raise errors.NotFound(f"model_id: unknown model {model_id!r} (known: {known})")
        return m

    def lookup(
        self,
        model_id: str,
        token_ids: list[int] | None = None,
        block_hashes: bytes = b"",
        extra_keys: tuple[str, ...] = (),
        record: bool = True,
        include_cordoned: bool = False,
    ) -> LookupResult:
        """Who holds the longest cached prefix. `record`: count it as a router's lookup and
        as reuse evidence for the tier policy (False for the control plane's own lookups:
        a transfer's, the second Route of one request). Cordoned agents are no holders
        unless `include_cordoned` (a transfer's source may be one: it is being emptied)."""
        if not model_id:
            raise errors.InvalidArgument("model_id", "must not be empty")
        if token_ids and block_hashes:
            raise errors.InvalidArgument("token_ids", "give token_ids or block_hashes, not both")
        if not token_ids and not block_hashes:
            raise errors.InvalidArgument("token_ids", "give at least one token id (or block_hashes)")
        model = self.model(model_id)
        if token_ids:
            # full blocks are what is looked up: a partial one after the last is ignored,
            # here as everywhere (it was refused at exactly the cap plus one token)
            check_prompt_size(len(token_ids), model.block_size, "lookup")
            try:  # their size too: each block hashes them again (a big one held a lookup for minutes)
                extra_keys = check_extra_keys(extra_keys)
            except ValueError as exc:
                raise errors.InvalidArgument("extra_keys", str(exc)) from None
            try:
                packed = hash_prefix(model_id, token_ids, model.block_size, extra_keys)
            except ValueError as exc:
                raise errors.InvalidArgument("token_ids", str(exc)) from None
            num_tokens = len(token_ids)
        else:
            if len(block_hashes) % BLOCK_HASH_BYTES:
                raise errors.InvalidArgument(
                    "block_hashes",
                    f"length {len(block_hashes)} is not a multiple of {BLOCK_HASH_BYTES} bytes",
                )
            packed = block_hashes
            num_tokens = len(packed) // BLOCK_HASH_BYTES * model.block_size
        num_blocks = len(packed) // BLOCK_HASH_BYTES
        if num_blocks > MAX_LOOKUP_BLOCKS:
            raise errors.InvalidArgument("block_hashes", f"at most {MAX_LOOKUP_BLOCKS} blocks per lookup")
        with self._lock:
            holders = self.index.prefix_holders(packed)
            serving = self._serving.get(model_id, frozenset())
            if self._cordoned and not include_cordoned:
                serving = serving.difference(self._cordoned)
            if any(a not in serving for a in holders.agent_ids):
                # the index keys blocks by hash alone: an engine's own hashes (vLLM's) need not
                # tell models apart, so an agent serving another model is no holder
                holders = holders.only(serving)
            for agent_id, _, tiers in holders.rows():
                if agent_id not in self._slow_hits and self._below_fastest(agent_id, tiers):
                    self._slow_hits.add(agent_id)
            hit_tokens = holders.counts[0] * model.block_size if len(holders) else 0
            if record:
                self.lookups_total += 1
                self.lookup_tokens_total += num_tokens
                self.lookup_hit_tokens_total += hit_tokens
        if record and self.on_lookup is not None:  # future-reuse evidence for the tier policy
            self.on_lookup(packed, self._clock())
        return LookupResult(model_id, num_tokens, num_blocks, model.block_size, holders, block_hashes=packed)

    # ---- stats ----------------------------------------------------------------------
    def stats(self) -> ClusterStats:
        with self._lock:
            totals: dict[Tier, list[int]] = {}
            for rec in self._agents.values():
                for t in rec.tiers:
                    acc = totals.setdefault(t.tier, [0, 0, 0, 0, 0, 0, 0])
                    acc[0] += t.capacity_bytes
                    acc[1] += t.used_bytes
                    acc[2] += t.num_blocks
                    acc[3] += t.uncompressed_bytes
                    acc[4] += t.stored_bytes
                    acc[5] += t.num_parked_blocks
                    acc[6] += t.blocks_used_bytes
            return ClusterStats(
                num_agents=len(self._agents),
                num_blocks=self.index.num_blocks,
                num_block_replicas=self.index.num_replicas,
                lookups_total=self.lookups_total,
                lookup_tokens_total=self.lookup_tokens_total,
                lookup_hit_tokens_total=self.lookup_hit_tokens_total,
                resyncs_total=self.resyncs_total,
                events_total=self.events_total,
                tiers=[TierUsage(t, *v) for t, v in sorted(totals.items())],
                models=sorted(self._models.values(), key=lambda m: m.model_id),
                tier_moved_bytes_total=sum(r.tier_moved_bytes_total for r in self._agents.values()),
            )
