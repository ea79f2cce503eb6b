from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class AgentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATE_UNSPECIFIED: _ClassVar[AgentState]
    AGENT_STATE_READY: _ClassVar[AgentState]
    AGENT_STATE_SYNCING: _ClassVar[AgentState]
    AGENT_STATE_DISCONNECTED: _ClassVar[AgentState]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_CPU: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
AGENT_STATE_UNSPECIFIED: AgentState
AGENT_STATE_READY: AgentState
AGENT_STATE_SYNCING: AgentState
AGENT_STATE_DISCONNECTED: AgentState

class ModelSpec(_message.Message):
    __slots__ = ("model_id", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_blocks", "uncompressed_bytes", "stored_bytes", "num_parked_blocks", "blocks_used_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    uncompressed_bytes: int
    stored_bytes: int
    num_parked_blocks: int
    blocks_used_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., uncompressed_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., num_parked_blocks: _Optional[int] = ..., blocks_used_bytes: _Optional[int] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_id", "address", "models", "tiers", "metrics_address", "lease_id", "role", "transfer_engine", "transfer_endpoint", "transfer_protocol", "transfer_buffer_address", "transfer_buffer_bytes", "transfer_engine_status", "shm_path", "shm_host_id", "shm_inode", "handoff_page_bytes")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BUFFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_INODE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[ModelSpec]
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    metrics_address: str
    lease_id: int
    role: str
    transfer_engine: str
    transfer_endpoint: str
    transfer_protocol: str
    transfer_buffer_address: int
    transfer_buffer_bytes: int
    transfer_engine_status: str
    shm_path: str
    shm_host_id: str
    shm_inode: int
    handoff_page_bytes: int
    def __init__(self, agent_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelSpec, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., metrics_address: _Optional[str] = ..., lease_id: _Optional[int] = ..., role: _Optional[str] = ..., transfer_engine: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., transfer_protocol: _Optional[str] = ..., transfer_buffer_address: _Optional[int] = ..., transfer_buffer_bytes: _Optional[int] = ..., transfer_engine_status: _Optional[str] = ..., shm_path: _Optional[str] = ..., shm_host_id: _Optional[str] = ..., shm_inode: _Optional[int] = ..., handoff_page_bytes: _Optional[int] = ...) -> None: ...
