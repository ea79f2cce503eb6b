"""The state the leader's mixins share (pins: manager_pins.py, operations: manager_ops.py,
policy: manager_policy.py), declared once for the type checker: `ManagerState` holds
annotations only (no values, nothing at run time); controlplane.manager.Manager sets
every attribute in its __init__ and defines the methods stubbed below."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from controlplane.core.access_stats import AccessStats
from controlplane.core.cluster import AgentCommand, Cluster, ModelInfo
from controlplane.core.operations import DrainLanding, Operation
from controlplane.core.pins import Pin
from controlplane.core.policy import Policy
from controlplane.core.scope import Scope
from controlplane.core.tuning import CreditTuner
from controlplane.store.durable import DurableStore
from controlplane.store.election import LeaderElection
from protos.tier import Tier


class ManagerState:
    """What Manager.__init__ sets (see the comments there), for its mixins to use."""

    cluster: Cluster
    durable: DurableStore
    # (unit tests of the policy pass build a Manager with neither: they never run the
    # reconcile loop, operations or pins, which need both)
    election: LeaderElection
    _etcd: Any  # the etcd client a cleanup's scope lock (controlplane.store.locks.EtcdLock) uses
    clock: Callable[[], float]
    op_timeout_seconds: float
    resync_seconds: float
    policy_validator: Callable[[dict[str, str]], dict[str, str]]
    _lock: threading.RLock
    # pins
    pins: dict[str, Pin]
    _apply_lock: threading.Lock
    _unpinned: dict[str, float]
    _next_reload: float
    _pins_watch: int | None
    _pins_watch_id: object
    _pins_watch_generation: int
    pins_expired_total: int
    # operations
    ops: OrderedDict[str, Operation]
    _op_said: dict[str, tuple[str, str]]
    _cancel_asked: dict[str, float]
    _unheard: dict[tuple[str, str], tuple[AgentCommand, str]]
    _stored_commands: set[str]
    commands_resent_total: dict[str, int]
    _op_done: dict[str, threading.Event]
    _adopted_locks_pending: int
    _adopted_locks_settled: threading.Event
    _locks_to_retake: set[str]
    _lock_keepers: set[str]
    _dirty: set[str]
    _op_write_locks: list[threading.Lock]
    _drain_start: threading.Lock
    _lock_threads: set[str]
    _cancelling: dict[str, int]
    _drain_landings: dict[str, dict[str, DrainLanding]]
    on_finished: Callable[[str, str, float], None] | None
    # policy
    policy: dict[str, str]
    policy_revision: int
    access: AccessStats
    _access_lock: threading.Lock
    _policy_report_seen: dict[str, int]
    _policy_idle: dict[str, bool]
    policy_max_blocks_per_pass: int
    _policy_last: dict[str, float]
    policy_passes_total: int
    policy_agents_decided_total: int
    policy_pass_seconds_max: float
    policy_pass_seconds_last: float
    policy_credit_turnovers: float
    policy_recent_first: bool
    _policy_inflight: dict[str, dict[str, tuple[float, str]]]
    _pin_refusals: dict[str, dict[bytes, tuple[Tier, float]]]
    _pinned_by_block: tuple[list[int], list[Pin], dict[bytes, list[Pin]]] | None
    _pinned_index_lock: threading.Lock
    _policy_ops: int
    _policy_op_tag: str
    policy_actions_total: int
    tuner: CreditTuner | None
    _lookups: deque[tuple[bytes, float]]
    lookups_dropped_total: int

    if TYPE_CHECKING:  # Manager's own methods the mixins call (controlplane.manager defines them)

        def ensure_loaded(self) -> None: ...
        def _valid_stored_policy(self, values: dict[str, str]) -> dict[str, str]: ...
        def _model(self, model_id: str) -> ModelInfo: ...
        def _signal_finished(self, op: Operation) -> None: ...
        @staticmethod
        def check_scope_form(scope: Scope, field: str = "scope") -> None: ...
        def resolve(self, scope: Scope, field: str = "scope", per: str = "request") -> tuple[bytes, str]: ...
        def _check_agents_back(self, agent_ids: tuple[str, ...] = (), indexed: bool = False) -> None: ...
        def _check_scope_agents_back(self, scope: Scope) -> None: ...
        def _targets(self, scope: Scope, packed: bytes) -> dict[str, bytes]: ...
        def set_policy(self, changes: dict[str, str]) -> dict[str, str]: ...
        def tier_policy(self) -> Policy: ...
