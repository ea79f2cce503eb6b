"""The C loop of the credit tuner's shadow admission (tuning_kernel.c), compiled on first use
and loaded with ctypes (protos.native); `load()` returns None when it cannot be (no C
compiler, or KVCP_TUNING_KERNEL=numpy), and the shadows then admit with numpy or block by
block (controlplane.core.tuning), which gives the same shadows.

Why C: admitting a lookup into a shadow with numpy costs a dozen fancy-indexing calls and
their temporaries, most of a shadow's ~1 µs a block; the C loop touches each block's
columns once (a few ns a block) and also lays the blocks out by run for the heap.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from protos import native

SOURCE = Path(__file__).with_name("tuning_kernel.c")
_ENV = "KVCP_TUNING_KERNEL"  # "numpy": never load the C loop
_P = ctypes.c_void_p
_I = ctypes.c_int64


class Shadow(ctypes.Structure):
    """Mirrors `tn_shadow` in tuning_kernel.c (field order and types must match)."""

    _fields_ = [
        ("parent", _P),
        ("num_children", _P),
        ("holders", _P),
        ("key", _P),
        ("tick", _P),
        ("level_key", _P),
        ("run_of_level", _P),
        ("num_runs", _I),
        ("t", _I),
        ("out", _P),
        ("run_counts", _P),
        ("hits", _I),
        ("added", _I),
    ]


class Lookup(ctypes.Structure):
    """Mirrors `tn_lookup` in tuning_kernel.c."""

    _fields_ = [("ids", _P), ("counts", _P), ("n", _I), ("cap", _I), ("missing", _I)]


def load() -> Any:
    """The C loop, or None (the Python paths are used); built on first use."""
    lib: Any = native.load(SOURCE, _ENV)  # the functions' signatures are set here
    if lib is None or hasattr(lib, "_kvcp_ready"):
        return lib
    # a call takes a µs: keep the GIL (the library loaded again as a PyDLL) rather than
    # hand it to another thread and wait a switch interval to get it back
    held = ctypes.PyDLL(lib._name)
    for name in ("tn_admit_i32", "tn_admit_i64"):
        fn = getattr(held, name)
        fn.argtypes = [_P, _P]  # the addresses of a Shadow and a Lookup
        fn.restype = None
        setattr(lib, name, fn)
    lib._kvcp_ready = True
    return lib
