from protos.kvcp.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListAgentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("info", "state", "num_blocks", "last_seen_unix_seconds", "lookups_total", "lookup_hit_tokens_total", "lookup_tokens_total")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    info: _types_pb2.AgentInfo
    state: _types_pb2.AgentState
    num_blocks: int
    last_seen_unix_seconds: float
    lookups_total: int
    lookup_hit_tokens_total: int
    lookup_tokens_total: int
    def __init__(self, info: _Optional[_Union[_types_pb2.AgentInfo, _Mapping]] = ..., state: _Optional[_Union[_types_pb2.AgentState, str]] = ..., num_blocks: _Optional[int] = ..., last_seen_unix_seconds: _Optional[float] = ..., lookups_total: _Optional[int] = ..., lookup_hit_tokens_total: _Optional[int] = ..., lookup_tokens_total: _Optional[int] = ...) -> None: ...

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

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_agents", "num_blocks", "num_block_replicas", "lookups_total", "lookup_tokens_total", "lookup_hit_tokens_total", "tiers", "leader_address", "epoch", "is_leader", "models", "resyncs_total", "events_total")
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
    def __init__(self, num_agents: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_block_replicas: _Optional[int] = ..., lookups_total: _Optional[int] = ..., lookup_tokens_total: _Optional[int] = ..., lookup_hit_tokens_total: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_types_pb2.TierUsage, _Mapping]]] = ..., leader_address: _Optional[str] = ..., epoch: _Optional[int] = ..., is_leader: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[_types_pb2.ModelSpec, _Mapping]]] = ..., resyncs_total: _Optional[int] = ..., events_total: _Optional[int] = ...) -> None: ...
