"""Parent links of indexed blocks (block hash -> its parent's hash), for the tier policy:
`decide` shrinks chains from their tails and needs to know who is whose child. A chained
digest has the same parent wherever it is held, so one map serves every agent. Entries of
blocks no agent holds any more are pruned by the owner (`prune`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from protos.block_hash import BLOCK_HASH_BYTES, ROOT_PARENT_HASH


class ParentMap:
    def __init__(self) -> None:
        self._parent: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def note(self, packed_hashes: bytes, packed_parents: bytes) -> None:
        """Record parents from a STORED event or inventory group (parents may be absent)."""
        n = BLOCK_HASH_BYTES
        if len(packed_parents) != len(packed_hashes) or len(packed_hashes) % n:
            return  # malformed (the cluster rejects the batch): a short key would break prune()
        with self._lock:
            for i in range(0, len(packed_hashes), n):
                self._parent[packed_hashes[i : i + n]] = packed_parents[i : i + n]

    def get(self, block_hash: bytes) -> bytes:
        return self._parent.get(block_hash, ROOT_PARENT_HASH)

    def prune(self, held: Callable[[bytes], bool]) -> int:
        with self._lock:
            gone = [h for h in self._parent if not held(h)]
            for h in gone:
                del self._parent[h]
            return len(gone)

    def __len__(self) -> int:
        return len(self._parent)
