from protos.kvcp.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_EVENT_KIND_UNSPECIFIED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_STORED: _ClassVar[BlockEventKind]
    BLOCK_EVENT_KIND_REMOVED: _ClassVar[BlockEventKind]

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_KIND_UNSPECIFIED: _ClassVar[CommandKind]
    COMMAND_KIND_MOVE: _ClassVar[CommandKind]
    COMMAND_KIND_EVICT: _ClassVar[CommandKind]
    COMMAND_KIND_COMPRESS: _ClassVar[CommandKind]
    COMMAND_KIND_PIN: _ClassVar[CommandKind]
    COMMAND_KIND_UNPIN: _ClassVar[CommandKind]
    COMMAND_KIND_CANCEL: _ClassVar[CommandKind]
    COMMAND_KIND_CLEANUP: _ClassVar[CommandKind]
    COMMAND_KIND_TRANSFER: _ClassVar[CommandKind]
    COMMAND_KIND_DRAIN: _ClassVar[CommandKind]

class HandoffOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_OUTCOME_UNSPECIFIED: _ClassVar[HandoffOutcome]
    HANDOFF_OUTCOME_TRANSFERRED: _ClassVar[HandoffOutcome]
    HANDOFF_OUTCOME_PRESENT: _ClassVar[HandoffOutcome]
    HANDOFF_OUTCOME_RECOMPUTE: _ClassVar[HandoffOutcome]
BLOCK_EVENT_KIND_UNSPECIFIED: BlockEventKind
BLOCK_EVENT_KIND_STORED: BlockEventKind
BLOCK_EVENT_KIND_REMOVED: BlockEventKind
COMMAND_KIND_UNSPECIFIED: CommandKind
COMMAND_KIND_MOVE: CommandKind
COMMAND_KIND_EVICT: CommandKind
COMMAND_KIND_COMPRESS: CommandKind
COMMAND_KIND_PIN: CommandKind
COMMAND_KIND_UNPIN: CommandKind
COMMAND_KIND_CANCEL: CommandKind
COMMAND_KIND_CLEANUP: CommandKind
COMMAND_KIND_TRANSFER: CommandKind
COMMAND_KIND_DRAIN: CommandKind
HANDOFF_OUTCOME_UNSPECIFIED: HandoffOutcome
HANDOFF_OUTCOME_TRANSFERRED: HandoffOutcome
HANDOFF_OUTCOME_PRESENT: HandoffOutcome
HANDOFF_OUTCOME_RECOMPUTE: HandoffOutcome

class RegisterRequest(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: _types_pb2.AgentInfo
    def __init__(self, agent: _Optional[_Union[_types_pb2.AgentInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("epoch", "leader_address")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    leader_address: str
    def __init__(self, epoch: _Optional[int] = ..., leader_address: _Optional[str] = ...) -> None: ...

class BlockGroup(_message.Message):
    __slots__ = ("model_id", "tier", "block_hashes", "parent_hashes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tier: _types_pb2.Tier
    block_hashes: bytes
    parent_hashes: bytes
    def __init__(self, model_id: _Optional[str] = ..., tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., block_hashes: _Optional[bytes] = ..., parent_hashes: _Optional[bytes] = ...) -> None: ...

class BlockEventBatch(_message.Message):
    __slots__ = ("seq", "kind", "groups")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: BlockEventKind
    groups: _containers.RepeatedCompositeFieldContainer[BlockGroup]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[BlockEventKind, str]] = ..., groups: _Optional[_Iterable[_Union[BlockGroup, _Mapping]]] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("seq", "chunk_index", "last_chunk", "groups")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    chunk_index: int
    last_chunk: bool
    groups: _containers.RepeatedCompositeFieldContainer[BlockGroup]
    def __init__(self, seq: _Optional[int] = ..., chunk_index: _Optional[int] = ..., last_chunk: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[BlockGroup, _Mapping]]] = ...) -> None: ...

class NamespaceUsage(_message.Message):
    __slots__ = ("namespace", "num_blocks", "uncompressed_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    num_blocks: int
    uncompressed_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., num_blocks: _Optional[int] = ..., uncompressed_bytes: _Optional[int] = ...) -> None: ...

class AgentStats(_message.Message):
    __slots__ = ("namespaces", "tiers", "lookups_total", "lookup_tokens_total", "lookup_hit_tokens_total", "dataplane", "tier_moved_bytes_total")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceUsage]
    tiers: _containers.RepeatedCompositeFieldContainer[_types_pb2.TierUsage]
    lookups_total: int
    lookup_tokens_total: int
    lookup_hit_tokens_total: int
    dataplane: DataPlaneStats
    tier_moved_bytes_total: int
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceUsage, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[_types_pb2.TierUsage, _Mapping]]] = ..., lookups_total: _Optional[int] = ..., lookup_tokens_total: _Optional[int] = ..., lookup_hit_tokens_total: _Optional[int] = ..., dataplane: _Optional[_Union[DataPlaneStats, _Mapping]] = ..., tier_moved_bytes_total: _Optional[int] = ...) -> None: ...

class LinkStats(_message.Message):
    __slots__ = ("peer_agent_id", "throughput_bytes_per_second", "num_inflight_transfers", "num_queued_transfers", "transfers_total", "failures_total", "bytes_total", "last_path", "last_unix_seconds", "latency_seconds")
    PEER_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAST_PATH_FIELD_NUMBER: _ClassVar[int]
    LAST_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    peer_agent_id: str
    throughput_bytes_per_second: float
    num_inflight_transfers: int
    num_queued_transfers: int
    transfers_total: int
    failures_total: int
    bytes_total: int
    last_path: str
    last_unix_seconds: float
    latency_seconds: float
    def __init__(self, peer_agent_id: _Optional[str] = ..., throughput_bytes_per_second: _Optional[float] = ..., num_inflight_transfers: _Optional[int] = ..., num_queued_transfers: _Optional[int] = ..., transfers_total: _Optional[int] = ..., failures_total: _Optional[int] = ..., bytes_total: _Optional[int] = ..., last_path: _Optional[str] = ..., last_unix_seconds: _Optional[float] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class DataPlaneStats(_message.Message):
    __slots__ = ("links", "num_inbound_handoffs", "reserved_bytes", "handoff_free_bytes", "handoff_capacity_bytes", "num_outbound_inflight_handoffs", "num_outbound_queued_handoffs", "max_inbound_handoffs", "handoff_tier")
    LINKS_FIELD_NUMBER: _ClassVar[int]
    NUM_INBOUND_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTBOUND_INFLIGHT_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTBOUND_QUEUED_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    MAX_INBOUND_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TIER_FIELD_NUMBER: _ClassVar[int]
    links: _containers.RepeatedCompositeFieldContainer[LinkStats]
    num_inbound_handoffs: int
    reserved_bytes: int
    handoff_free_bytes: int
    handoff_capacity_bytes: int
    num_outbound_inflight_handoffs: int
    num_outbound_queued_handoffs: int
    max_inbound_handoffs: int
    handoff_tier: _types_pb2.Tier
    def __init__(self, links: _Optional[_Iterable[_Union[LinkStats, _Mapping]]] = ..., num_inbound_handoffs: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., handoff_free_bytes: _Optional[int] = ..., handoff_capacity_bytes: _Optional[int] = ..., num_outbound_inflight_handoffs: _Optional[int] = ..., num_outbound_queued_handoffs: _Optional[int] = ..., max_inbound_handoffs: _Optional[int] = ..., handoff_tier: _Optional[_Union[_types_pb2.Tier, str]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("agent_id", "session_id", "pins", "incarnation", "runs_commands_once")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RUNS_COMMANDS_ONCE_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    session_id: str
    pins: _containers.RepeatedCompositeFieldContainer[HeldPin]
    incarnation: str
    runs_commands_once: bool
    def __init__(self, agent_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pins: _Optional[_Iterable[_Union[HeldPin, _Mapping]]] = ..., incarnation: _Optional[str] = ..., runs_commands_once: _Optional[bool] = ...) -> None: ...

class HeldPin(_message.Message):
    __slots__ = ("pin_id", "version")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    version: str
    def __init__(self, pin_id: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("kind", "message", "unix_seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    unix_seconds: float
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., unix_seconds: _Optional[float] = ...) -> None: ...

class OpUpdate(_message.Message):
    __slots__ = ("op_id", "state", "num_done_blocks", "num_total_blocks", "num_failed_blocks", "moved_bytes", "error", "num_skipped_pinned_blocks", "freed", "pinned_block_hashes", "pinned_tiers", "result", "peer_taken_bytes")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DONE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PINNED_TIERS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PEER_TAKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    state: str
    num_done_blocks: int
    num_total_blocks: int
    num_failed_blocks: int
    moved_bytes: int
    error: str
    num_skipped_pinned_blocks: int
    freed: _containers.RepeatedCompositeFieldContainer[_types_pb2.TierUsage]
    pinned_block_hashes: bytes
    pinned_tiers: _containers.RepeatedScalarFieldContainer[int]
    result: str
    peer_taken_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op_id: _Optional[str] = ..., state: _Optional[str] = ..., num_done_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_failed_blocks: _Optional[int] = ..., moved_bytes: _Optional[int] = ..., error: _Optional[str] = ..., num_skipped_pinned_blocks: _Optional[int] = ..., freed: _Optional[_Iterable[_Union[_types_pb2.TierUsage, _Mapping]]] = ..., pinned_block_hashes: _Optional[bytes] = ..., pinned_tiers: _Optional[_Iterable[int]] = ..., result: _Optional[str] = ..., peer_taken_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "inventory", "events", "stats", "notice", "op_update")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    OP_UPDATE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    inventory: Inventory
    events: BlockEventBatch
    stats: AgentStats
    notice: Notice
    op_update: OpUpdate
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., events: _Optional[_Union[BlockEventBatch, _Mapping]] = ..., stats: _Optional[_Union[AgentStats, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ..., op_update: _Optional[_Union[OpUpdate, _Mapping]] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("op_id", "kind", "block_hashes", "tier", "codec", "namespace", "model_id", "older_than_seconds", "dry_run", "only_tier", "pin_id", "expires_unix_seconds", "peer_agent_id", "deadline_seconds", "ttl_seconds", "pin_version", "peer_agent_ids", "peer_free_bytes", "peer_fill_limit_bytes")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OLDER_THAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    ONLY_TIER_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_FILL_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: CommandKind
    block_hashes: bytes
    tier: _types_pb2.Tier
    codec: str
    namespace: str
    model_id: str
    older_than_seconds: float
    dry_run: bool
    only_tier: _types_pb2.Tier
    pin_id: str
    expires_unix_seconds: float
    peer_agent_id: str
    deadline_seconds: float
    ttl_seconds: float
    pin_version: str
    peer_agent_ids: _containers.RepeatedScalarFieldContainer[str]
    peer_free_bytes: _containers.RepeatedScalarFieldContainer[int]
    peer_fill_limit_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., block_hashes: _Optional[bytes] = ..., tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., codec: _Optional[str] = ..., namespace: _Optional[str] = ..., model_id: _Optional[str] = ..., older_than_seconds: _Optional[float] = ..., dry_run: _Optional[bool] = ..., only_tier: _Optional[_Union[_types_pb2.Tier, str]] = ..., pin_id: _Optional[str] = ..., expires_unix_seconds: _Optional[float] = ..., peer_agent_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., ttl_seconds: _Optional[float] = ..., pin_version: _Optional[str] = ..., peer_agent_ids: _Optional[_Iterable[str]] = ..., peer_free_bytes: _Optional[_Iterable[int]] = ..., peer_fill_limit_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("epoch", "resync", "command")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    resync: ResyncRequest
    command: Command
    def __init__(self, epoch: _Optional[int] = ..., resync: _Optional[_Union[ResyncRequest, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "kv", "extra_keys", "first_block", "namespace", "spec")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    first_block: int
    namespace: str
    spec: _types_pb2.ModelSpec
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[str]] = ..., first_block: _Optional[int] = ..., namespace: _Optional[str] = ..., spec: _Optional[_Union[_types_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("num_stored_blocks", "num_present_blocks")
    NUM_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_stored_blocks: int
    num_present_blocks: int
    def __init__(self, num_stored_blocks: _Optional[int] = ..., num_present_blocks: _Optional[int] = ...) -> None: ...

class EngineLookupRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "extra_keys", "spec")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    spec: _types_pb2.ModelSpec
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[str]] = ..., spec: _Optional[_Union[_types_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class EngineLookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "extra_keys", "first_block", "max_blocks", "spec")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    first_block: int
    max_blocks: int
    spec: _types_pb2.ModelSpec
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_keys: _Optional[_Iterable[str]] = ..., first_block: _Optional[int] = ..., max_blocks: _Optional[int] = ..., spec: _Optional[_Union[_types_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("num_cached_tokens", "kv", "truncated")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    kv: bytes
    truncated: bool
    def __init__(self, num_cached_tokens: _Optional[int] = ..., kv: _Optional[bytes] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("model_id", "block_hashes", "stored_bytes", "codecs", "namespace", "ttl_seconds", "source_agent_id", "path", "namespaces", "writer_pid", "writer_start_ticks", "reservation_id", "fill_limit_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    WRITER_PID_FIELD_NUMBER: _ClassVar[int]
    WRITER_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FILL_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_hashes: bytes
    stored_bytes: _containers.RepeatedScalarFieldContainer[int]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    namespace: str
    ttl_seconds: float
    source_agent_id: str
    path: str
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    writer_pid: int
    writer_start_ticks: int
    reservation_id: str
    fill_limit_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., stored_bytes: _Optional[_Iterable[int]] = ..., codecs: _Optional[_Iterable[str]] = ..., namespace: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., source_agent_id: _Optional[str] = ..., path: _Optional[str] = ..., namespaces: _Optional[_Iterable[str]] = ..., writer_pid: _Optional[int] = ..., writer_start_ticks: _Optional[int] = ..., reservation_id: _Optional[str] = ..., fill_limit_bytes: _Optional[int] = ...) -> None: ...

class BlockSlots(_message.Message):
    __slots__ = ("addresses", "lengths")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, addresses: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "num_present_blocks", "transfer_endpoint", "expires_unix_seconds", "slots")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    num_present_blocks: int
    transfer_endpoint: str
    expires_unix_seconds: float
    slots: BlockSlots
    def __init__(self, reservation_id: _Optional[str] = ..., num_present_blocks: _Optional[int] = ..., transfer_endpoint: _Optional[str] = ..., expires_unix_seconds: _Optional[float] = ..., slots: _Optional[_Union[BlockSlots, _Mapping]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("reservation_id", "block_index", "offset", "data")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    block_index: int
    offset: int
    data: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "checksums", "first_block", "last")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    checksums: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    last: bool
    def __init__(self, reservation_id: _Optional[str] = ..., checksums: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_committed_blocks", "num_present_blocks")
    NUM_COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_committed_blocks: int
    num_present_blocks: int
    def __init__(self, num_committed_blocks: _Optional[int] = ..., num_present_blocks: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id", "reason", "writes_quiesced")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITES_QUIESCED_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    reason: str
    writes_quiesced: bool
    def __init__(self, reservation_id: _Optional[str] = ..., reason: _Optional[str] = ..., writes_quiesced: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandoffRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "block_hashes", "extra_keys", "destination_agent_id", "deadline_seconds", "namespace", "paths")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: bytes
    extra_keys: _containers.RepeatedScalarFieldContainer[str]
    destination_agent_id: str
    deadline_seconds: float
    namespace: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[bytes] = ..., extra_keys: _Optional[_Iterable[str]] = ..., destination_agent_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., namespace: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ...) -> None: ...

class HandoffResponse(_message.Message):
    __slots__ = ("outcome", "path", "num_blocks", "num_sent_blocks", "sent_bytes", "elapsed_seconds", "attempts", "reason", "num_cached_tokens")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    outcome: HandoffOutcome
    path: str
    num_blocks: int
    num_sent_blocks: int
    sent_bytes: int
    elapsed_seconds: float
    attempts: int
    reason: str
    num_cached_tokens: int
    def __init__(self, outcome: _Optional[_Union[HandoffOutcome, str]] = ..., path: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_sent_blocks: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., elapsed_seconds: _Optional[float] = ..., attempts: _Optional[int] = ..., reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...
