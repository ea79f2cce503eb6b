"""The control plane's clock for pins and operations: Unix seconds that a step of the
host's clock does not move.

Pins expire at an absolute Unix time kept in etcd (any replica may be the one that
expires them, so it must be a time all replicas read alike). A leader that compared it
with `time.time()` would end every pin early when its host's clock was stepped forward
(an NTP step, an operator's `date -s`) and keep them late after a backward step. This
clock reads the host's clock once, when the control plane starts, and advances it by the
monotonic clock from then on: NTP's slewing still reaches it (it slews the monotonic
clock too), a step does not. Replicas' clocks must still agree (NTP), as for any
absolute expiry."""

from __future__ import annotations

import time


class SteadyWallClock:
    def __init__(self, wall=time.time, monotonic=time.monotonic):
        self._monotonic = monotonic
        self._wall_at_start = wall()
        self._monotonic_at_start = monotonic()

    def __call__(self) -> float:
        return self._wall_at_start + (self._monotonic() - self._monotonic_at_start)
