"""The C loops of the block index (index_kernel.c), compiled on first use and loaded with
ctypes (protos.native); `load()` returns None when they cannot be (no C compiler, or
KVCP_INDEX_KERNEL=numpy), and the index then runs its vectorised numpy path, which gives
the same results.

Why C: the numpy path costs a few dozen numpy calls per batch, ~1 µs per event at the
wire's 1024-block batches; the C loop does each event's probe, insert and bit updates in
~0.1 µs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from protos import native

SOURCE = Path(__file__).with_name("index_kernel.c")
_ENV = "KVCP_INDEX_KERNEL"  # "numpy": never load the C loops
_P = ctypes.c_void_p
_I = ctypes.c_int64


class KvIndex(ctypes.Structure):
    """Mirrors `kv_index` in index_kernel.c (field order and types must match)."""

    _fields_ = [
        ("keys", _P),
        ("parents", _P),
        ("mask", _P),
        ("tlo", _P),
        ("thi", _P),
        ("tags", _P),
        ("ents", _P),
        ("free_ids", _P),
        ("counts", _P),
        ("stored", _P),
        ("cap", _I),
        ("W", _I),
        ("shift", ctypes.c_uint64),
        ("nfree", _I),
        ("hw", _I),
        ("live", _I),
        ("now", _I),
        ("s0", ctypes.c_uint64),
        ("s1", ctypes.c_uint64),
        ("old_tags", _P),
        ("old_ents", _P),
        ("moved", _P),
        ("old_shift", ctypes.c_uint64),
        ("old_nb", _I),
    ]


def load() -> ctypes.CDLL | None:
    """The C loops, or None (the numpy path is used); built on first use."""
    lib: Any = native.load(SOURCE, _ENV)  # the functions' signatures are set here
    if lib is None or hasattr(lib, "_kvcp_ready"):
        return lib
    p = ctypes.POINTER(KvIndex)
    lib.kv_find.argtypes = [p, _P, _I, _P, _P]
    lib.kv_find.restype = None
    lib.kv_prefix.argtypes = [p, _P, _I, _P]
    lib.kv_prefix.restype = _I
    lib.kv_matches.argtypes = [p, _P, _I, _P, _P]
    lib.kv_matches.restype = _I
    # a lookup's two calls take microseconds: they keep the GIL (the same library loaded as
    # a PyDLL), since letting it go hands it to whichever thread waits, and taking it back
    # can then cost the lookup a whole switch interval; batches of events let it go
    held = ctypes.PyDLL(lib._name)
    held.kv_prefix.argtypes, held.kv_prefix.restype = lib.kv_prefix.argtypes, _I
    held.kv_matches.argtypes, held.kv_matches.restype = lib.kv_matches.argtypes, _I
    lib.kv_prefix_gil, lib.kv_matches_gil = held.kv_prefix, held.kv_matches
    lib.kv_entries_of.argtypes = [p, _I, _P, _I]
    lib.kv_entries_of.restype = _I
    lib.kv_add.argtypes = [p, _P, _P, _I, _I, _I, _I]
    lib.kv_add.restype = _I
    lib.kv_remove.argtypes = [p, _P, _I, _I]
    lib.kv_remove.restype = _I
    lib.kv_move.argtypes = [p, _I, _I]
    lib.kv_move.restype = None
    lib._kvcp_ready = True
    return lib
