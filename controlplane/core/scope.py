"""What an admin action is about (`Scope`: a prefix of one model, or a namespace;
optionally one agent), and a model's block size in bytes."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.core.cluster import ModelInfo
from protos.kv_format import kv_block_bytes


def block_bytes(m: ModelInfo) -> int:
    return kv_block_bytes(m.num_layers, m.block_size, m.num_kv_heads, m.head_dim, m.dtype)


@dataclass(frozen=True)
class Scope:
    """What an action is about: a prefix of one model, or a namespace; optionally one agent."""

    model_id: str = ""
    token_ids: tuple[int, ...] = ()
    block_hashes: bytes = b""
    extra_keys: tuple[str, ...] = ()
    namespace: str = ""
    agent_id: str = ""
