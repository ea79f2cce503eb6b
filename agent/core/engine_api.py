"""The engine-facing API of an agent: what an inference engine's KV connector calls.

    store(model_id, token_ids, kv)      -> StoreResult   (kv of the full blocks)
    lookup(model_id, token_ids)         -> num_cached_tokens
    load(model_id, token_ids)           -> LoadResult    (kv of the cached prefix)

kv tensors have shape [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
in the model's dtype; tokens past the last full block are never cached.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent.core.block_pool import BlockPool
from agent.core.model_spec import TORCH_DTYPES, ModelSpec
from agent.core.mover import Mover
from protos import errors
from protos.block_hash import (
    MAX_PROMPT_BLOCKS,
    MAX_PROMPT_TOKENS,
    check_extra_keys,
    check_prompt_size,
    hash_prefix,
    split_hashes,
    token_array,
)
from protos.namespaces import check_namespace
from protos.tier import Tier


@dataclass(frozen=True)
class StoreResult:
    num_stored_blocks: int
    num_present_blocks: int


# One engine RPC carries at most this much (both sides' gRPC limit); KV bigger than one
# message goes in several Stores and Loads (first_block / max_blocks).
ENGINE_MESSAGE_BYTES = 256 << 20
# blocks of one prompt an engine call may name: as a control-plane lookup
MAX_BLOCKS_PER_CALL, MAX_TOKENS_PER_CALL = MAX_PROMPT_BLOCKS, MAX_PROMPT_TOKENS
_MESSAGE_HEADROOM_BYTES = 4 << 20  # token ids and framing


_TOKEN_ID_BYTES = 5  # the most one token id takes in a message (packed varint)


def blocks_per_message(block_bytes: int) -> int:
    """How many blocks of `block_bytes` one engine message carries (at least one)."""
    return max(1, (ENGINE_MESSAGE_BYTES - _MESSAGE_HEADROOM_BYTES) // block_bytes)


def blocks_in_store_message(block_bytes: int, block_size: int, first_block: int) -> int:
    """How many blocks from `first_block` one Store message carries: it also carries
    every token id up to its last block, so the further into a long prompt, the fewer
    (a 1.5M-token prompt's last message went over the limit). ValueError when the
    token ids before `first_block` alone would not fit."""
    room = ENGINE_MESSAGE_BYTES - _MESSAGE_HEADROOM_BYTES - _TOKEN_ID_BYTES * first_block * block_size
    count = room // (block_bytes + _TOKEN_ID_BYTES * block_size)
    if count < 1:
        raise ValueError(f"a prompt of {first_block * block_size} tokens does not fit in one engine message")
    return count


@dataclass(frozen=True)
class LoadResult:
    num_cached_tokens: int  # through the last block in kv, counting blocks before first_block
    kv: torch.Tensor  # blocks [first_block, first_block + len(kv))
    tiers: tuple[Tier, ...] = ()
    truncated: bool = False  # more cached blocks follow beyond max_blocks


class KVEngineAPI:
    def __init__(self, pool: BlockPool, models: Sequence[ModelSpec], mover: Mover | None = None):
        self.pool = pool
        self.mover = mover  # when set, loads from a lower tier promote in the background
        self.models = {m.model_id: m for m in models}
        self._lock = threading.Lock()
        self.lookups_total = 0
        self.lookup_tokens_total = 0
        self.lookup_hit_tokens_total = 0

    def model(self, model_id: str) -> ModelSpec:
        m = self.models.get(model_id)
        if m is None:
            raise errors.NotFound(
                f"model_id: this agent serves no model {model_id!r} (serves {', '.join(self.models)})"
            )
        return m

    def hashes(self, model: ModelSpec, token_ids, extra_keys: Sequence[str] = ()) -> list[bytes]:
        return self._prompt(model, token_ids, extra_keys)[1]

    def _prompt(self, model: ModelSpec, token_ids, extra_keys: Sequence[str] = ()) -> tuple[int, list[bytes]]:
        """(its number of tokens, its full blocks' hashes): token ids as a sequence, an
        array or a tensor, [T] or an engine's [1, T]."""
        try:
            keys = check_extra_keys(extra_keys)
        except ValueError as exc:
            raise errors.InvalidArgument("extra_keys", str(exc)) from None
        try:
            tokens = token_array(token_ids)
        except ValueError as exc:
            raise errors.InvalidArgument("token_ids", str(exc)) from None
        check_prompt_size(len(tokens), model.block_size, "call")
        return len(tokens), split_hashes(hash_prefix(model.model_id, tokens, model.block_size, keys))

    def store(
        self,
        model_id: str,
        token_ids,
        kv: torch.Tensor,
        first_block: int = 0,
        extra_keys: Sequence[str] = (),
        namespace: str = "",
    ) -> StoreResult:
        """Cache the full blocks of `token_ids`; `kv` holds blocks [first_block, n)."""
        if namespace:
            check_namespace(namespace, "namespace")  # it goes into each block's record on disk
        model = self.model(model_id)
        hashes = self.hashes(model, token_ids, extra_keys)
        n_given = len(hashes) - first_block
        if first_block < 0 or n_given < 0:
            raise errors.InvalidArgument("first_block", f"must be in [0, {len(hashes)}]")
        expected = (n_given, *model.block_shape)
        if tuple(kv.shape) != expected:
            raise errors.InvalidArgument("kv", f"shape {tuple(kv.shape)} != expected {expected}")
        if kv.dtype != TORCH_DTYPES[model.dtype]:
            raise errors.InvalidArgument("kv", f"dtype {kv.dtype} != model dtype {model.dtype}")
        if first_block and self.pool.num_leading(hashes[:first_block]) < first_block:
            return StoreResult(0, 0)  # the prefix the caller skipped is not cached here
        stored, present = self.pool.insert_chain(
            model_id, hashes, lambda i: kv[i - first_block] if i >= first_block else None, namespace
        )
        return StoreResult(stored, present)

    def lookup(self, model_id: str, token_ids, extra_keys: Sequence[str] = ()) -> int:
        model = self.model(model_id)
        num_tokens, hashes = self._prompt(model, token_ids, extra_keys)
        n = self.pool.num_leading(hashes)
        self._count(num_tokens, n * model.block_size)
        return n * model.block_size

    def load(
        self,
        model_id: str,
        token_ids,
        extra_keys: Sequence[str] = (),
        first_block: int = 0,
        max_blocks: int | None = None,
    ) -> LoadResult:
        """The cached prefix's blocks from `first_block` on (at most `max_blocks`); blocks
        before `first_block` must be cached here, else nothing is loaded."""
        model = self.model(model_id)
        num_tokens, hashes = self._prompt(model, token_ids, extra_keys)
        if first_block < 0 or first_block > len(hashes):
            raise errors.InvalidArgument("first_block", f"must be in [0, {len(hashes)}]")
        if max_blocks is not None and max_blocks < 1:
            raise errors.InvalidArgument("max_blocks", "must be at least 1")
        empty = torch.empty((0, *model.block_shape), dtype=TORCH_DTYPES[model.dtype])
        if first_block and self.pool.num_leading(hashes[:first_block]) < first_block:
            return LoadResult(0, empty)  # the prefix before first_block is gone
        end = len(hashes) if max_blocks is None else min(len(hashes), first_block + max_blocks)
        blocks, tiers = self.pool.read_chain(hashes[first_block:end])
        kv = torch.stack(blocks) if blocks else empty
        top = self.pool.top.tier
        lower = [h for h, t in zip(hashes[first_block:], tiers, strict=False) if t != top]
        if lower and self.mover is not None:
            self.mover.promote(lower)
        loaded_to = first_block + len(blocks)
        truncated = loaded_to == end < len(hashes) and self.pool.num_leading(hashes[end : end + 1]) == 1
        if first_block == 0:  # one engine load = one lookup, however many messages it takes
            hit_blocks = self.pool.num_leading(hashes) if truncated else len(blocks)
            self._count(num_tokens, hit_blocks * model.block_size)
        num_cached = loaded_to * model.block_size if blocks else 0
        return LoadResult(num_cached, kv, tuple(tiers), truncated)

    def _count(self, num_tokens: int, hit_tokens: int) -> None:
        with self._lock:
            self.lookups_total += 1
            self.lookup_tokens_total += num_tokens
            self.lookup_hit_tokens_total += hit_tokens
