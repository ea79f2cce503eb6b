"""A pool of one-token int8 blocks over real memory slabs, for tests of the block pool's
bookkeeping: a block's bytes are its own hash."""

from __future__ import annotations

import torch

from agent.core.block_pool import BlockPool
from agent.core.model_spec import ModelSpec
from protos.block_hash import hash_prefix, split_hashes

SPEC = ModelSpec("m", block_size=1, num_layers=1, num_kv_heads=1, head_dim=8, dtype="int8")
PAGE = SPEC.block_bytes


def chain(tokens) -> list[bytes]:
    return split_hashes(hash_prefix("m", list(tokens), 1))


def insert(pool: BlockPool, hs: list[bytes], namespace: str = "") -> None:
    def block(i: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(hs[i]), dtype=torch.int8).reshape(SPEC.block_shape)

    assert pool.insert_chain("m", hs, block, namespace=namespace).num_stored == len(hs)
