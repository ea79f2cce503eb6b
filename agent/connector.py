"""KVConnector: the small class an inference engine calls to reuse KV through its
local agent, in the engine's own layout (one (key, value) pair per layer, each shaped
[batch=1, num_kv_heads, num_tokens, head_dim], as Hugging Face caches hold them).

    connector.lookup(token_ids)          -> num_cached_tokens
    connector.load(token_ids)            -> (num_cached_tokens, [(k, v) per layer])
    connector.store(token_ids, kv)       -> number of blocks newly stored

It talks to the agent in process (KVEngineAPI) or over gRPC (EngineClient); both move
whole blocks in the agent's layout [num_blocks, num_layers, 2, block_size, heads, dim].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agent.core.engine_api import blocks_in_store_message, blocks_per_message
from agent.core.model_spec import ModelSpec
from protos.block_hash import check_extra_keys, token_array

LayerKV = tuple[torch.Tensor, torch.Tensor]


def layers_to_blocks(kv: Sequence[LayerKV], spec: ModelSpec, first_block: int, num_blocks: int) -> torch.Tensor:
    """Per-layer [1, H, T, D] pairs -> blocks [n, L, 2, block_size, H, D] for blocks
    [first_block, first_block + num_blocks). A pair in another layout is refused
    (ValueError naming it): its bytes would be cached in the wrong shape."""
    bs = spec.block_size
    start, end = first_block * bs, (first_block + num_blocks) * bs
    if len(kv) != spec.num_layers:
        raise ValueError(f"kv has {len(kv)} layers, model {spec.model_id} has {spec.num_layers}")
    want = f"[1, {spec.num_kv_heads}, >= {end}, {spec.head_dim}]"
    out = torch.empty((num_blocks, *spec.block_shape), dtype=spec.torch_dtype)
    for layer, (k, v) in enumerate(kv):
        for which, t in ((0, k), (1, v)):
            if not isinstance(t, torch.Tensor):  # (numpy's float16 read as "float16 != float16")
                raise ValueError(f"kv layer {layer} {'kv'[which]}: a torch tensor, not {type(t).__name__}")
            shape = tuple(t.shape)
            if len(shape) != 4 or shape[0] != 1 or shape[1] != spec.num_kv_heads or shape[3] != spec.head_dim:
                raise ValueError(
                    f"kv layer {layer} {'kv'[which]}: shape {list(shape)}, model {spec.model_id} wants {want}"
                )
            if shape[2] < end:
                raise ValueError(f"kv layer {layer} {'kv'[which]}: {shape[2]} tokens, {end} needed for the full blocks")
            if t.dtype != spec.torch_dtype:  # converted quietly, float32 overflowed float16 to inf in a shared cache
                raise ValueError(
                    f"kv layer {layer} {'kv'[which]}: dtype {str(t.dtype).removeprefix('torch.')}, "
                    f"model {spec.model_id} stores {spec.dtype} (convert it, or give the spec its dtype)"
                )
            seg = t[0, :, start:end, :].to("cpu")  # [H, n*bs, D]
            out[:, layer, which] = seg.reshape(spec.num_kv_heads, num_blocks, bs, spec.head_dim).permute(1, 2, 0, 3)
    return out


def blocks_to_layers(blocks: torch.Tensor, spec: ModelSpec, device="cpu", dtype=None) -> list[LayerKV]:
    """Inverse of layers_to_blocks for the whole prefix."""
    n = blocks.shape[0]
    out = []
    for layer in range(spec.num_layers):
        pair = []
        for which in (0, 1):
            t = blocks[:, layer, which].reshape(n * spec.block_size, spec.num_kv_heads, spec.head_dim).permute(1, 0, 2)
            pair.append(t.unsqueeze(0).to(device=device, dtype=dtype or blocks.dtype).contiguous())
        out.append((pair[0], pair[1]))
    return out


class KVConnector:
    def __init__(self, spec: ModelSpec, engine, extra_keys: Sequence[str] = ()):
        """`engine`: a KVEngineAPI (in process) or an agent.client.EngineClient (gRPC)."""
        self.spec = spec
        self.engine = engine
        self.extra_keys = check_extra_keys(extra_keys)  # one string is one key; int ids in decimal
        self._remote = not hasattr(engine, "pool")
        if self._remote:  # told to the agent with every call: a different layout is refused
            from protos.kvcp.v1 import types_pb2

            self._spec_pb = types_pb2.ModelSpec(
                model_id=spec.model_id,
                block_size=spec.block_size,
                num_layers=spec.num_layers,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=spec.dtype,
            )
            self._blocks_per_message = blocks_per_message(spec.block_bytes)
        else:
            theirs = engine.model(spec.model_id)
            diff = theirs.differences(spec)
            if diff:
                raise ValueError(f"model {spec.model_id}: the agent's KV layout differs ({'; '.join(diff)})")

    def lookup(self, token_ids: Sequence[int]) -> int:
        tokens = _tokens(token_ids)
        if len(tokens) < self.spec.block_size:  # no full block: nothing to look up, in process or not
            return 0
        if self._remote:  # its layout said, as a load says it: a lookup must not promise what a load refuses
            return self.engine.lookup(self.spec.model_id, tokens, self.extra_keys, spec=self._spec_pb)
        return self.engine.lookup(self.spec.model_id, tokens, self.extra_keys)

    def load(self, token_ids: Sequence[int], device="cpu", dtype=None) -> tuple[int, list[LayerKV]]:
        tokens = _tokens(token_ids)
        if len(tokens) < self.spec.block_size:
            return 0, []
        if self._remote:
            blocks = self._load_remote(tokens)
            num_tokens = blocks.shape[0] * self.spec.block_size
        else:
            result = self.engine.load(self.spec.model_id, tokens, self.extra_keys)
            blocks, num_tokens = result.kv, result.num_cached_tokens
        if num_tokens == 0:
            return 0, []
        return num_tokens, blocks_to_layers(blocks, self.spec, device, dtype)

    def _load_remote(self, tokens: list[int]) -> torch.Tensor:
        """The cached prefix's blocks, one message at a time; a prefix that shrinks
        between messages (evicted meanwhile) ends where it was still whole."""
        parts: list[torch.Tensor] = []
        first = 0
        while True:
            loaded = self.engine.load(
                self.spec.model_id, tokens, self.extra_keys, first_block=first, spec=self._spec_pb
            )
            n = loaded.num_cached_tokens // self.spec.block_size - first
            if n <= 0:
                break
            raw = torch.frombuffer(bytearray(loaded.kv), dtype=torch.uint8)
            parts.append(raw.view(self.spec.torch_dtype).reshape(n, *self.spec.block_shape))
            first += n
            if not loaded.truncated:
                break
        if not parts:
            return torch.empty((0, *self.spec.block_shape), dtype=self.spec.torch_dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def store(self, token_ids: Sequence[int], kv: Sequence[LayerKV], first_block: int = 0) -> int:
        """Store the full blocks of `token_ids` from per-layer KV covering at least them;
        blocks before `first_block` are assumed cached already (not sent)."""
        tokens = _tokens(token_ids)
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        n = len(tokens) // self.spec.block_size - first_block
        if n <= 0:
            if len(kv) != self.spec.num_layers:
                raise ValueError(f"kv has {len(kv)} layers, model {self.spec.model_id} has {self.spec.num_layers}")
            return 0
        if not self._remote:
            blocks = layers_to_blocks(kv, self.spec, first_block, n)
            return self.engine.store(self.spec.model_id, tokens, blocks, first_block, self.extra_keys).num_stored_blocks
        stored = 0
        end = first_block + n
        first = first_block
        while first < end:  # one message at a time
            fits = blocks_in_store_message(self.spec.block_bytes, self.spec.block_size, first)
            count = min(self._blocks_per_message, fits, end - first)
            raw = layers_to_blocks(kv, self.spec, first, count).view(torch.uint8).numpy().tobytes()
            upto = tokens[: (first + count) * self.spec.block_size]
            r = self.engine.store(self.spec.model_id, upto, raw, first, self.extra_keys, spec=self._spec_pb)
            if r.num_stored_blocks + r.num_present_blocks < first + count:  # stopped short (prefix gone, no room)
                break
            stored += r.num_stored_blocks
            first += count
        return stored


def _tokens(token_ids) -> list[int]:
    """An engine's token ids (a list, a numpy array or a torch tensor, [T] or [1, T]) as
    one prompt's list; ValueError for anything else ([B, T] is several prompts)."""
    return token_array(token_ids).tolist()
