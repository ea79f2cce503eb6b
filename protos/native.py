"""C loops compiled on first use and loaded with ctypes, for the few per-element loops that
numpy or torch run slowly (the block index's per-event probes, the int8, int4 and fp8 codecs,
the credit tuner's shadow admission).

`load(source, name)` compiles `source` with the machine's C compiler (`cc`, or $CC) into
$XDG_CACHE_HOME/kvcp (or ~/.cache/kvcp), named by the source's digest and the flags, so an
edited source is rebuilt and processes share one copy; it returns None, after one warning,
when that cannot be done (no compiler, a read-only cache) or when KVCP_NATIVE=off, and the
caller runs its pure-Python path, which gives the same results. `-march=native` is safe
because the host's CPU is part of the cache name.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC")
_ENV = "KVCP_NATIVE"  # "off": never load native loops
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}


def enabled(switch: str = "") -> bool:
    """False when native loops are turned off, all of them (KVCP_NATIVE=off) or this
    one (its own switch variable set to "off" or "numpy")."""
    if os.environ.get(_ENV, "").lower() == "off":
        return False
    return not (switch and os.environ.get(switch, "").lower() in ("off", "numpy", "torch"))


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcp"


def _build(source: Path, target: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is as good
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{cc} failed: {exc.stderr.strip()[:500]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu() -> bytes:
    """What -march=native compiles for: the CPU's model and flags (and the architecture)."""
    out = platform.machine().encode()
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"model name", b"flags", b"Features", b"CPU part")):
                    out += line
                if line.strip() == b"":  # the first processor's block is enough
                    break
    except OSError:
        out += platform.processor().encode()
    return out


def load(source: Path, switch: str = "") -> ctypes.CDLL | None:
    """The compiled `source` (built on first use), or None: see the module docstring."""
    key = (str(source), switch)
    if key in _loaded:
        return _loaded[key]
    lib = None
    if enabled(switch):
        try:
            # -march=native: the host's CPU is part of the name, so a cache shared between
            # machines (an NFS home, a baked image) never hands one CPU another's build
            digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + _cpu()).hexdigest()[:16]
            target = cache_dir() / f"{source.stem}-{digest}.so"
            if not target.exists():
                _build(source, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("%s: native loops unavailable (%s); using the Python path", source.name, exc)
    _loaded[key] = lib
    return lib
