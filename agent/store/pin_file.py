"""The pins an agent enforces, kept next to its disk tier (`pins.json`), so that the
blocks a restart finds on disk are protected from the first store on: the control plane
re-sends its pins only once the agent's link is up (never, while it is away), and an
engine storing meanwhile would push pinned blocks out.

Expiries are written as wall-clock times (the monotonic clock does not survive a
restart) and read back as time left; a pin whose time ran out while the agent was down
is not restored. The file is replaced atomically (write, fsync, rename): a crash leaves
the old table or the new one, never a torn one; a file that does not parse is ignored
(the control plane re-sends what holds)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from agent.core.pins import AgentPin
from agent.store.disk_tier import fsync_dir

log = logging.getLogger(__name__)

PIN_FILE_NAME = "pins.json"


class PinFile:
    def __init__(self, directory: str | Path):
        self.path = Path(directory) / PIN_FILE_NAME

    def save(self, pins: list[AgentPin], monotonic_now: float, unix_now: float) -> None:
        rows = [
            {
                "pin_id": p.pin_id,
                "tier": p.tier,
                "expires_unix_seconds": unix_now + (p.expires_monotonic_seconds - monotonic_now)
                if p.expires_monotonic_seconds
                else 0.0,
                "namespace": p.namespace,
                "block_hashes": sorted(h.hex() for h in p.block_hashes),
                "version": p.version,
            }
            for p in pins
        ]
        tmp = self.path.with_suffix(".tmp")
        # owner-only, as the slab beside it; never through a link someone planted there
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pins": rows}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)  # the rename survives a power loss too

    def load(self, monotonic_now: float | None = None, unix_now: float | None = None) -> list[AgentPin]:
        """The pins still in force; [] when there is no file or it does not parse."""
        monotonic_now = time.monotonic() if monotonic_now is None else monotonic_now
        unix_now = time.time() if unix_now is None else unix_now
        try:
            rows = json.loads(self.path.read_text())["pins"]
            out = []
            for r in rows:
                expires = float(r["expires_unix_seconds"])
                if expires and expires <= unix_now:
                    continue  # ran out while the agent was down
                out.append(
                    AgentPin(
                        str(r["pin_id"]),
                        int(r["tier"]),
                        monotonic_now + (expires - unix_now) if expires else 0.0,
                        str(r.get("namespace", "")),
                        frozenset(bytes.fromhex(h) for h in r.get("block_hashes", [])),
                        str(r.get("version", "")),
                    )
                )
            return out
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the pin file %s (%s); the control plane re-sends its pins", self.path, exc)
            return []
