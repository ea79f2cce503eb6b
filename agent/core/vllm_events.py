"""vLLM KV cache events, decoded, and the metadata-only blocks they describe.

vLLM (`vllm/distributed/kv_events.py`) publishes msgpack-encoded `KVEventBatch`es: a
batch is `[ts, events, data_parallel_rank]` (array-like structs) or the same as a map
(`{"ts", "events", "data_parallel_rank"}`, newer vLLM); each event is a tagged struct,
array-like `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, ...]` / `["BlockRemoved", block_hashes, medium, ...]` /
`["AllBlocksCleared"]`, or a map with the tag under "type". Array-like events carry
every field vLLM has added since (`lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window, locality, ...`): those named here are read, the rest left
out. A hybrid model (full and sliding-window attention) reports each KV cache group's
blocks under the same hashes, and a sliding-window group drops blocks the others keep:
one group is indexed (`group`, default 0; events without `group_idx` belong to it), the
others' events are counted and left out. Block hashes are ints or bytes and become 16-byte digests through
`protos.block_hash.external_block_hash`.

Which hash a block is indexed under (`index_by`): "tokens" (the default) computes kvcp's
own chained digest (`protos.block_hash.hash_block` of the model and the block's tokens,
which every `BlockStored` carries) from its parent's, so a `Lookup` by tokens, `kvctl
lookup --tokens`, `Route` and pins by tokens find the engine's blocks as they find any
agent's; a block whose KV its tokens do not decide (a LoRA adapter, multimodal or other
extra keys), whose tokens are missing or do not fill its blocks, or whose parent is not
indexed by tokens (an engine read from the middle of its history) stays under the
engine's hash, as do its descendants. "vllm" indexes every block under the engine's hash,
for a router that computes vLLM's hashes itself.

`decode_batch` validates a whole batch before anything is applied: a malformed one
raises `MalformedBatch` and changes nothing. An event of a kind this agent does not know
(a later vLLM's, a fork's) is counted and left out; the batch's known events apply. A
BlockStored whose `block_size` is not the model's is refused (`BlockSizeMismatch`): the
control plane counts a hit block as the model's block size in tokens. `ExternalBlocks` is the agent's inventory
of blocks the engine holds and this agent does not (it has no bytes for them, so they
stay out of the BlockPool): their events go into the pool's journal, in the same
sequence space as the pool's own, and they are part of every inventory the agent sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from agent.core.blocks import InventoryGroup
from agent.core.journal import REMOVED, STORED
from protos.block_hash import ROOT_PARENT_HASH, external_block_hash, hash_block, hash_chain, split_hashes
from protos.tier import Tier

MEDIUM_TIERS = {"GPU": Tier.GPU, "CPU": Tier.CPU, "DISK": Tier.DISK}
INDEX_BY = ("tokens", "vllm")  # kvcp's digest of the block's tokens; the engine's own hash
MAX_BLOCKS_PER_EVENT = 1 << 20


class MalformedBatch(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


class BlockSizeMismatch(MalformedBatch):
    """The engine's blocks hold another number of tokens than the model's block size."""


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: list[bytes]  # 16-byte digests
    parent_hash: bytes  # ROOT_PARENT_HASH when none
    tier: Tier
    block_size: int | None = None  # tokens per block, as the engine said (None: not said)
    group: int | None = None  # the engine's KV cache group (None: not said)
    token_ids: tuple[int, ...] | None = None  # every block's tokens, in order (None: not usable)
    keyed: bool = False  # a LoRA adapter or extra keys (multimodal inputs): tokens alone do not name the KV


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: list[bytes]
    tier: Tier
    group: int | None = None


@dataclass(frozen=True)
class AllCleared:
    pass


@dataclass(frozen=True)
class DecodedBatch:
    ts: float
    events: list[BlocksStored | BlocksRemoved | AllCleared]
    data_parallel_rank: int | None
    unknown_events: int = 0  # events of a kind not known here, left out
    other_group_events: int = 0  # events of a KV cache group not indexed here, left out


_decoder = msgspec.msgpack.Decoder()


def _tier(medium) -> Tier:
    if medium is None:
        return Tier.GPU  # vLLM before `medium`, and its default
    if not isinstance(medium, str):
        raise MalformedBatch(f"medium must be a string, not {type(medium).__name__}")
    return MEDIUM_TIERS.get(medium.upper(), Tier.REMOTE)  # an unknown medium: held, somewhere slower


def _hashes(value) -> list[bytes]:
    if not isinstance(value, list | tuple):
        raise MalformedBatch(f"block_hashes must be a list, not {type(value).__name__}")
    if len(value) > MAX_BLOCKS_PER_EVENT:
        raise MalformedBatch(f"{len(value)} block hashes in one event (at most {MAX_BLOCKS_PER_EVENT})")
    try:
        out = [external_block_hash(h) for h in value]
    except ValueError as exc:
        raise MalformedBatch(str(exc)) from None
    if len(set(out)) != len(out):  # one block twice in one event: which copy a removal means is unknown
        raise MalformedBatch("a block hash repeats within one event")
    return out


def _fields(event, names: tuple[str, ...]) -> tuple[str, list]:
    """(tag, values of `names` in order; None where absent)."""
    if isinstance(event, list | tuple):
        if not event or not isinstance(event[0], str):
            raise MalformedBatch("an array-like event must start with its tag")
        rest = list(event[1 : 1 + len(names)])  # fields added after these: not read here
        return event[0], rest + [None] * (len(names) - len(rest))
    if isinstance(event, dict):
        tag = event.get("type")
        if not isinstance(tag, str):
            raise MalformedBatch("a map event needs a string 'type' tag")
        return tag, [event.get(n) for n in names]
    raise MalformedBatch(f"an event must be an array or a map, not {type(event).__name__}")


# vLLM's field order (array-like events): later versions append, never reorder
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _group(value) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise MalformedBatch(f"group_idx must be an int, not {type(value).__name__}")
    return value


def _token_ids(value) -> tuple[int, ...] | None:
    """The event's token ids, or None where they cannot name blocks (absent, or not a
    list of ints): the blocks are then indexed under the engine's hashes."""
    if not isinstance(value, list | tuple) or not all(type(t) is int for t in value):
        return None
    return tuple(value)


def _keyed(lora_id, lora_name, extra_keys) -> bool:
    if lora_id is not None or lora_name is not None:
        return True
    if extra_keys is None:
        return False
    if isinstance(extra_keys, list | tuple):
        return any(k is not None for k in extra_keys)
    return True


def _event(raw) -> BlocksStored | BlocksRemoved | AllCleared | None:
    """The event, or None for a well-formed event of a kind not known here."""
    tag = raw[0] if isinstance(raw, list | tuple) and raw else raw.get("type") if isinstance(raw, dict) else None
    if tag == "BlockStored":
        _, (hashes, parent, tokens, block_size, lora, medium, lora_name, extra, group) = _fields(raw, _STORED_FIELDS)
        parent_hash = ROOT_PARENT_HASH
        if parent is not None:
            try:
                parent_hash = external_block_hash(parent)
            except ValueError as exc:
                raise MalformedBatch(f"parent_block_hash: {exc}") from None
        if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)):
            raise MalformedBatch(f"block_size must be an int, not {type(block_size).__name__}")
        return BlocksStored(
            _hashes(hashes),
            parent_hash,
            _tier(medium),
            block_size,
            _group(group),
            _token_ids(tokens),
            _keyed(lora, lora_name, extra),
        )
    if tag == "BlockRemoved":
        _, (hashes, medium, group) = _fields(raw, _REMOVED_FIELDS)
        return BlocksRemoved(_hashes(hashes), _tier(medium), _group(group))
    if tag == "AllBlocksCleared":
        return AllCleared()
    _fields(raw, ())  # the shape error, if that is what it is
    return None


def decode_batch(payload: bytes, group: int = 0) -> DecodedBatch:
    """One KVEventBatch payload, validated whole; MalformedBatch when it is not one.
    Events of another KV cache group than `group` are left out (counted)."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as exc:  # (nested past the stack)
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if isinstance(raw, list | tuple):
        if len(raw) < 2:
            raise MalformedBatch("a batch array needs [ts, events, ...]")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise MalformedBatch(f"a batch must be an array or a map, not {type(raw).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch("batch ts must be a number")
    if not isinstance(events, list | tuple):
        raise MalformedBatch("batch events must be a list")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise MalformedBatch("data_parallel_rank must be an int")
    try:
        decoded = [_event(e) for e in events]
    except MalformedBatch:
        raise
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:  # a shape no check above foresaw
        raise MalformedBatch(f"an event does not decode: {exc}") from None
    known = [e for e in decoded if e is not None]
    ours = [e for e in known if getattr(e, "group", None) in (None, group)]
    return DecodedBatch(float(ts), ours, rank, len(decoded) - len(known), len(known) - len(ours))


class BatchApplied(NamedTuple):
    num_stored: int
    num_removed: int


class ExternalBlocks:
    """Blocks an engine reported that this agent indexes but does not hold.

    Invariant: `_tiers[h]` is the non-empty set (bitmask of 1 << tier) of media the engine
    holds h in, and the control plane was last told h is in its fastest one. Every change
    goes through the pool's journal under the pool's lock, so an inventory taken under
    that lock (the pool's blocks plus `inventory_groups()`) and the events after it agree.
    """

    def __init__(self, pool, model_id: str, block_size: int = 0, index_by: str = "tokens"):
        """`block_size`: the model's tokens per block (0: not checked). `index_by`: one of
        INDEX_BY (module docstring)."""
        if index_by not in INDEX_BY:
            raise ValueError(f"index_by must be one of {', '.join(INDEX_BY)}, not {index_by!r}")
        self._pool = pool
        self.model_id = model_id
        self.block_size = block_size
        self.index_by = index_by
        # keyed by the hash a block is indexed under
        self._tiers: dict[bytes, int] = {}
        self._parents: dict[bytes, bytes] = {}
        # engine hash -> kvcp digest, for the blocks indexed by their tokens
        self._by_tokens: dict[bytes, bytes] = {}
        self.indexed_by_tokens_total = 0  # blocks first indexed under kvcp's digest
        self.indexed_by_engine_hash_total = 0  # ... under the engine's hash
        if index_by == "tokens":
            # the agent's own store (a connector's) may hold the same digests: the pool's
            # events then say the agent holds a block while either holds it
            pool.journal.other_tier = self._tier_of_indexed

    def _index_hashes(self, ev: BlocksStored) -> tuple[list[bytes], bytes]:
        """(the hash each block is indexed under, that of the first one's parent)."""
        by_tokens = self._by_tokens
        first_parent = by_tokens.get(ev.parent_hash, ev.parent_hash)
        bs = ev.block_size or self.block_size
        tokens = ev.token_ids or ()
        usable = (
            self.index_by == "tokens"
            and not ev.keyed
            and ev.token_ids is not None
            and bs > 0
            and len(tokens) == bs * len(ev.block_hashes)
        )
        # a chain is computable from a parent that is the root or indexed by tokens
        chained = usable and (ev.parent_hash == ROOT_PARENT_HASH or ev.parent_hash in by_tokens)
        chain: list[bytes] = []
        if chained:
            try:  # the whole event's chain at once; used while its blocks follow it
                chain = split_hashes(hash_chain(first_parent, self.model_id, tokens, bs))
            except ValueError:  # a token id out of range: not kvcp's tokens
                chained = False
        out: list[bytes] = []
        parent = first_parent
        on_chain = chained
        for i, h in enumerate(ev.block_hashes):
            known = by_tokens.get(h)
            if known is not None:  # indexed by tokens already (another medium, a repeat)
                idx = known
            elif h in self._tiers or not chained:
                idx, chained = h, False  # under the engine's hash, and so is what follows
            else:
                idx = chain[i] if on_chain else hash_block(parent, tokens[i * bs : (i + 1) * bs], self.model_id)
                if idx in self._tiers:
                    # the same tokens under another engine hash: vLLM's hash saw what the
                    # event does not carry (a cache salt, older vLLM's multimodal keys)
                    idx, chained = h, False
            on_chain = on_chain and idx == chain[i]
            out.append(idx)
            parent = idx
        return out, first_parent

    def _pool_tier(self, h: bytes) -> Tier | None:
        """The tier the agent's own store holds `h` in, if it does (a connector's copy)."""
        meta = self._pool.blocks.get(h)
        return meta.tier if meta is not None and meta.visible else None

    def _tier_of_indexed(self, h: bytes) -> Tier | None:
        mask = self._tiers.get(h)
        return None if mask is None else self._fastest(mask)

    def _record(self, kind: int, h: bytes, tier: Tier, parent: bytes) -> None:
        """Journal a change of the engine's copy, as the agent's: the agent still holds
        the block (or holds it faster) where its own store does."""
        own = self._pool_tier(h)
        if own is not None:
            kind, tier = STORED, own if kind == REMOVED else min(tier, own)
        self._pool.journal.record(kind, self.model_id, tier, h, parent, merged=True)

    @staticmethod
    def _fastest(mask: int) -> Tier:
        return Tier((mask & -mask).bit_length() - 1)

    def apply(self, batch: DecodedBatch) -> BatchApplied:
        """Apply a decoded batch: the blocks it stored and removed.
        BlockSizeMismatch, with nothing applied, when a store names another block size."""
        for ev in batch.events:
            if isinstance(ev, BlocksStored) and self.block_size and ev.block_size not in (None, self.block_size):
                raise BlockSizeMismatch(
                    f"the engine's blocks hold {ev.block_size} tokens, model {self.model_id!r} {self.block_size}: "
                    "its blocks are not indexed (give the agent the engine's block size in --model)"
                )
        stored = removed = 0
        with self._pool.lock:
            for ev in batch.events:
                if isinstance(ev, BlocksStored):
                    indexed, parent = self._index_hashes(ev)
                    bit = 1 << int(ev.tier)
                    for engine_hash, h in zip(ev.block_hashes, indexed, strict=True):
                        old = self._tiers.get(h, 0)
                        new = old | bit
                        if not old:  # a repeat in another medium keeps the parent it came with
                            self._parents[h] = parent
                            if h != engine_hash:
                                self._by_tokens[engine_hash] = h
                                self.indexed_by_tokens_total += 1
                            else:
                                self.indexed_by_engine_hash_total += 1
                        if new != old:
                            self._tiers[h] = new
                            if not old or self._fastest(new) != self._fastest(old):
                                self._record(STORED, h, self._fastest(new), self._parents[h])
                            stored += not old
                        parent = h
                elif isinstance(ev, BlocksRemoved):
                    bit = 1 << int(ev.tier)
                    for engine_hash in ev.block_hashes:
                        h = self._by_tokens.get(engine_hash, engine_hash)
                        old = self._tiers.get(h, 0)
                        new = old & ~bit
                        if new == old:
                            continue
                        parent = self._parents.get(h, ROOT_PARENT_HASH)
                        if new:
                            self._tiers[h] = new
                            if self._fastest(new) != self._fastest(old):
                                self._record(STORED, h, self._fastest(new), parent)
                        else:
                            del self._tiers[h]
                            self._parents.pop(h, None)
                            self._by_tokens.pop(engine_hash, None)
                            self._record(REMOVED, h, self._fastest(old), parent)
                            removed += 1
                else:
                    removed += self.clear()
        return BatchApplied(stored, removed)

    def clear(self) -> int:
        """Forget every block (AllBlocksCleared, an engine restart, or a gap replay could not
        fill: what the engine holds is unknown, so nothing is claimed); returns how many."""
        with self._pool.lock:
            for h, mask in self._tiers.items():
                self._record(REMOVED, h, self._fastest(mask), self._parents.get(h, ROOT_PARENT_HASH))
            n = len(self._tiers)
            self._tiers.clear()
            self._parents.clear()
            self._by_tokens.clear()
            return n

    def inventory_groups(self) -> list[InventoryGroup]:
        """Groups for an inventory (call under the pool's lock, with pool.inventory(),
        and send them after the pool's: of a block listed twice the last tier counts).
        A block the agent's own store holds as fast is left to the pool's groups."""
        acc: dict[Tier, tuple[bytearray, bytearray]] = {}
        for h, mask in self._tiers.items():
            tier, own = self._fastest(mask), self._pool_tier(h)
            if own is not None and own <= tier:
                continue
            hs, ps = acc.setdefault(tier, (bytearray(), bytearray()))
            hs += h
            ps += self._parents.get(h, ROOT_PARENT_HASH)
        return [InventoryGroup(self.model_id, t, bytes(h), bytes(p)) for t, (h, p) in acc.items()]

    @property
    def num_blocks(self) -> int:
        return len(self._tiers)

    def holds(self, block_hash: bytes) -> Tier | None:
        """The fastest medium of a block, named by the engine's hash or by the hash it
        is indexed under."""
        mask = self._tiers.get(self._by_tokens.get(block_hash, block_hash))
        return None if mask is None else self._fastest(mask)
