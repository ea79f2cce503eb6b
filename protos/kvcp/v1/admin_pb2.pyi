from protos.kvcp.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OperationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATE_UNSPECIFIED: _ClassVar[OperationState]
    OPERATION_STATE_PENDING: _ClassVar[OperationState]
    OPERATION_STATE_RUNNING: _ClassVar[OperationState]
    OPERATION_STATE_SUCCEEDED: _ClassVar[OperationState]
    OPERATION_STATE_FAILED: _ClassVar[OperationState]
    OPERATION_STATE_CANCELLED: _ClassVar[OperationState]
OPERATION_STATE_UNSPECIFIED: OperationState
OPERATION_STATE_PENDING: OperationState
OPERATION_STATE_RUNNING: OperationState
OPERATION_STATE_SUCCEEDED: OperationState
OPERATION_STATE_FAILED: OperationState
OPERATION_STATE_CANCELLED: OperationState

class ListAgentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("info", "state", "num_blocks", "last_seen_unix_seconds", "lookups_total", "lookup_hit_tokens_total", "lookup_tokens_total", "cordon_reason")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORDON_REASON_FIELD_NUMBER: _ClassVar[int]
    info: _types_pb2.AgentInfo
    state: _types_pb2.AgentState
    num_blocks: int
    last_seen_unix_seconds: float
    lookups_total: int
    lookup_hit_tokens_total: int
    lookup_tokens_total: int
    cordon_reason: str
    def __init__(self, info: _Optional[_Union[_types_pb2.AgentInfo, _Mapping]] = ..., state: _Optional[_Union[_types_pb2.AgentState, str]] = ..., num_blocks: _Optional[int] = ..., last_seen_unix_seconds: _Optional[float] = ..., lookups_total: _Optional[int] = ..., lookup_hit_tokens_total: _Optional[int] = ..., lookup_tokens_total: _Optional[int] = ..., cordon_reason: _Optional[str] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("agents",)
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    agents: _containers.RepeatedCompositeFieldContainer[AgentStatus]
    def __init__(self, agents: _Optional[_Iterable[_Union[AgentStatus, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "block_hashes", "extra_keys")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class AgentMatch(_message.Message):
    __slots__ = ("agent_id", "num_hit_blocks", "num_hit_tokens", "tiers")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    num_hit_blocks: int
    num_hit_tokens: int
    tiers: bytes
    def __init__(self, agent_id: _Optional[str] = ..., num_hit_blocks: _Optional[int] = ..., num_hit_tokens: _Optional[int] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("model_id", "num_tokens", "num_blocks", "best_agent_id", "agents", "possibly_stale")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BEST_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    POSSIBLY_STALE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_tokens: int
    num_blocks: int
    best_agent_id: str
    agents: _containers.RepeatedCompositeFieldContainer[AgentMatch]
    possibly_stale: bool
    def __init__(self, model_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., best_agent_id: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[AgentMatch, _Mapping]]] = ..., possibly_stale: _Optional[bool] = ...) -> None: ...

class LookupFrame(_message.Message):
    __slots__ = ("request", "token", "request_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request: LookupRequest
    token: str
    request_id: int
    def __init__(self, request: _Optional[_Union[LookupRequest, _Mapping]] = ..., token: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class LookupFrameReply(_message.Message):
    __slots__ = ("response", "code", "message", "request_id", "leader_address")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    response: LookupResponse
    code: str
    message: str
    request_id: int
    leader_address: str
    def __init__(self, response: _Optional[_Union[LookupResponse, _Mapping]] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., request_id: _Optional[int] = ..., leader_address: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_agents", "num_blocks", "num_block_replicas", "lookups_total", "lookup_tokens_total", "lookup_hit_tokens_total", "tiers", "leader_address", "epoch", "is_leader", "models", "resyncs_total", "events_total", "lookup_address", "policy_reuse_credit_turnovers", "policy_recent_first", "policy_passes_total", "tier_moved_bytes_total")
    NUM_AGENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_REUSE_CREDIT_TURNOVERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_RECENT_FIRST_FIELD_NUMBER: _ClassVar[int]
    POLICY_PASSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_agents: int
    num_blocks: int
    num_block_replicas: int
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    tiers: _containers.RepeatedCompositeFieldContainer[_types_pb2.TierUsage]
    leader_address: str
    epoch: int
    is_leader: bool
    models: _containers.RepeatedCompositeFieldContainer[_types_pb2.ModelSpec]
    resyncs_total: int
    events_total: int
    lookup_address: str
    policy_reuse_credit_turnovers: float
    policy_recent_first: bool
    policy_passes_total: int
    tier_moved_bytes_total: int
    def __init__(self, num_agents: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_block_replicas: _Optional[int] = ..., lookups_total: _Optional[int] = ..., lookup_tokens_total: _Optional[int] = ..., lookup_hit_tokens_total: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_types_pb2.TierUsage, _Mapping]]] = ..., leader_address: _Optional[str] = ..., epoch: _Optional[int] = ..., is_leader: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[_types_pb2.ModelSpec, _Mapping]]] = ..., resyncs_total: _Optional[int] = ..., events_total: _Optional[int] = ..., lookup_address: _Optional[str] = ..., policy_reuse_credit_turnovers: _Optional[float] = ..., policy_recent_first: _Optional[bool] = ..., policy_passes_total: _Optional[int] = ..., tier_moved_bytes_total: _Optional[int] = ...) -> None: ...

class Scope(_message.Message):
    __slots__ = ("model_id", "token_ids", "block_hashes", "extra_keys", "namespace", "agent_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    namespace: str
    agent_id: str
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[str]] = ..., namespace: _Optional[str] = ..., agent_id: _Optional[str] = ...) -> None: ...

class PinInfo(_message.Message):
    __slots__ = ("pin_id", "namespace", "scope", "min_tier", "created_unix_seconds", "expires_unix_seconds", "owner", "owner_lease_id", "num_blocks", "pinned_bytes")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MIN_TIER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    namespace: str
    scope: Scope
    min_tier: _types_pb2.Tier
    created_unix_seconds: float
    expires_unix_seconds: float
    owner: str
    owner_lease_id: int
    num_blocks: int
    pinned_bytes: int
    def __init__(self, pin_id: _Optional[str] = ..., namespace: _Optional[str] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., min_tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., created_unix_seconds: _Optional[float] = ..., expires_unix_seconds: _Optional[float] = ..., owner: _Optional[str] = ..., owner_lease_id: _Optional[int] = ..., num_blocks: _Optional[int] = ..., pinned_bytes: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("scope", "min_tier", "ttl_seconds", "owner", "owner_lease_id", "pin_id")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MIN_TIER_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    min_tier: _types_pb2.Tier
    ttl_seconds: float
    owner: str
    owner_lease_id: int
    pin_id: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., min_tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., ttl_seconds: _Optional[float] = ..., owner: _Optional[str] = ..., owner_lease_id: _Optional[int] = ..., pin_id: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    def __init__(self, pin_id: _Optional[str] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins", "possibly_stale")
    PINS_FIELD_NUMBER: _ClassVar[int]
    POSSIBLY_STALE_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinInfo]
    possibly_stale: bool
    def __init__(self, pins: _Optional[_Iterable[_Union[PinInfo, _Mapping]]] = ..., possibly_stale: _Optional[bool] = ...) -> None: ...

class AgentProgress(_message.Message):
    __slots__ = ("agent_id", "state", "num_done_blocks", "num_total_blocks", "num_failed_blocks", "error", "result")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DONE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    state: str
    num_done_blocks: int
    num_total_blocks: int
    num_failed_blocks: int
    error: str
    result: str
    def __init__(self, agent_id: _Optional[str] = ..., state: _Optional[str] = ..., num_done_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_failed_blocks: _Optional[int] = ..., error: _Optional[str] = ..., result: _Optional[str] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("op_id", "kind", "state", "progress", "num_done_blocks", "num_total_blocks", "num_failed_blocks", "num_skipped_pinned_blocks", "moved_bytes", "freed", "error", "created_unix_seconds", "updated_unix_seconds", "params", "agents", "dry_run", "result")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_DONE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: str
    state: OperationState
    progress: float
    num_done_blocks: int
    num_total_blocks: int
    num_failed_blocks: int
    num_skipped_pinned_blocks: int
    moved_bytes: int
    freed: _containers.RepeatedCompositeFieldContainer[_types_pb2.TierUsage]
    error: str
    created_unix_seconds: float
    updated_unix_seconds: float
    params: _containers.ScalarMap[str, str]
    agents: _containers.RepeatedCompositeFieldContainer[AgentProgress]
    dry_run: bool
    result: str
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[OperationState, str]] = ..., progress: _Optional[float] = ..., num_done_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_failed_blocks: _Optional[int] = ..., num_skipped_pinned_blocks: _Optional[int] = ..., moved_bytes: _Optional[int] = ..., freed: _Optional[_Iterable[_Union[_types_pb2.TierUsage, _Mapping]]] = ..., error: _Optional[str] = ..., created_unix_seconds: _Optional[float] = ..., updated_unix_seconds: _Optional[float] = ..., params: _Optional[_Mapping[str, str]] = ..., agents: _Optional[_Iterable[_Union[AgentProgress, _Mapping]]] = ..., dry_run: _Optional[bool] = ..., result: _Optional[str] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("scope", "to_tier", "codec")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TO_TIER_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    to_tier: _types_pb2.Tier
    codec: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., to_tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., codec: _Optional[str] = ...) -> None: ...

class CleanupRequest(_message.Message):
    __slots__ = ("older_than_seconds", "namespace", "agent_id", "model_id", "dry_run")
    OLDER_THAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    older_than_seconds: float
    namespace: str
    agent_id: str
    model_id: str
    dry_run: bool
    def __init__(self, older_than_seconds: _Optional[float] = ..., namespace: _Optional[str] = ..., agent_id: _Optional[str] = ..., model_id: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class CompressRequest(_message.Message):
    __slots__ = ("scope", "codec", "tier")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    codec: str
    tier: _types_pb2.Tier
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., codec: _Optional[str] = ..., tier: _Optional[_Union[_types_pb2.Tier, str]] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("op_id",)
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    def __init__(self, op_id: _Optional[str] = ...) -> None: ...

class ListOperationsRequest(_message.Message):
    __slots__ = ("max_operations",)
    MAX_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    max_operations: int
    def __init__(self, max_operations: _Optional[int] = ...) -> None: ...

class ListOperationsResponse(_message.Message):
    __slots__ = ("operations",)
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    operations: _containers.RepeatedCompositeFieldContainer[Operation]
    def __init__(self, operations: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ...) -> None: ...

class CancelOperationRequest(_message.Message):
    __slots__ = ("op_id",)
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    def __init__(self, op_id: _Optional[str] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("scope", "from_agent_id", "to_agent_id", "deadline_seconds")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    FROM_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TO_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    from_agent_id: str
    to_agent_id: str
    deadline_seconds: float
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., from_agent_id: _Optional[str] = ..., to_agent_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("agent_id", "to_agent_ids", "model_id", "deadline_seconds", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TO_AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    to_agent_ids: _containers.RepeatedScalarFieldContainer[str]
    model_id: str
    deadline_seconds: float
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., to_agent_ids: _Optional[_Iterable[str]] = ..., model_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "block_hashes", "extra_keys", "role", "prefill_agent_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    role: str
    prefill_agent_id: str
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[str]] = ..., role: _Optional[str] = ..., prefill_agent_id: _Optional[str] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("agent_id", "estimated_seconds", "num_cached_blocks", "num_active_handoffs", "free_bytes", "link_bytes_per_second", "transfer_seconds", "behind", "note")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    estimated_seconds: float
    num_cached_blocks: int
    num_active_handoffs: float
    free_bytes: int
    link_bytes_per_second: float
    transfer_seconds: float
    behind: bool
    note: str
    def __init__(self, agent_id: _Optional[str] = ..., estimated_seconds: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., num_active_handoffs: _Optional[float] = ..., free_bytes: _Optional[int] = ..., link_bytes_per_second: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., behind: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("role", "agent_id", "address", "prefill_agent_id", "decode_agent_id", "disaggregate", "num_cached_tokens", "transfer_seconds", "saved_seconds", "reason", "candidates", "backpressure", "possibly_stale")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAVED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_FIELD_NUMBER: _ClassVar[int]
    POSSIBLY_STALE_FIELD_NUMBER: _ClassVar[int]
    role: str
    agent_id: str
    address: str
    prefill_agent_id: str
    decode_agent_id: str
    disaggregate: bool
    num_cached_tokens: int
    transfer_seconds: float
    saved_seconds: float
    reason: str
    candidates: _containers.RepeatedCompositeFieldContainer[RouteCandidate]
    backpressure: bool
    possibly_stale: bool
    def __init__(self, role: _Optional[str] = ..., agent_id: _Optional[str] = ..., address: _Optional[str] = ..., prefill_agent_id: _Optional[str] = ..., decode_agent_id: _Optional[str] = ..., disaggregate: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., saved_seconds: _Optional[float] = ..., reason: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RouteCandidate, _Mapping]]] = ..., backpressure: _Optional[bool] = ..., possibly_stale: _Optional[bool] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("values", "revision")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, str]
    revision: int
    def __init__(self, values: _Optional[_Mapping[str, str]] = ..., revision: _Optional[int] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, str]
    def __init__(self, values: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("kinds", "replay_recent")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_RECENT_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[str]
    replay_recent: bool
    def __init__(self, kinds: _Optional[_Iterable[str]] = ..., replay_recent: _Optional[bool] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("seq", "unix_seconds", "kind", "severity", "agent_id", "op_id", "pin_id", "message")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    unix_seconds: float
    kind: str
    severity: str
    agent_id: str
    op_id: str
    pin_id: str
    message: str
    def __init__(self, seq: _Optional[int] = ..., unix_seconds: _Optional[float] = ..., kind: _Optional[str] = ..., severity: _Optional[str] = ..., agent_id: _Optional[str] = ..., op_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
