"""The KV block format agents and the control plane agree on: the dtypes a model may
declare (bytes per element), the codec names a policy or an operation may name, and a
block's size in bytes (K and V of every layer for `block_size` tokens)."""

from __future__ import annotations

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
CODECS = ("none", "int8", "int4", "fp8", "zstd")  # agent/core/codecs.py implements all but "none"


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one uncompressed block; an unknown or unset dtype counts 2 bytes (fp16)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)


# the longest a handoff (or a control plane's transfer) may be given: one that would take
# longer is better recomputed (a deadline of 1e10 s overflowed timeouts)
MAX_HANDOFF_DEADLINE_SECONDS = 3600.0
