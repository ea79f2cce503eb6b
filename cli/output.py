"""Rendering for kvctl: aligned tables for people, JSON for scripts."""

from __future__ import annotations

import dataclasses
import json

from protos.units import human_bytes

STALE_NOTE = "possibly stale: answered from memory (etcd unreachable) or while agents resync"


def to_jsonable(value):
    if dataclasses.is_dataclass(value):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def dumps(value) -> str:
    return json.dumps(to_jsonable(value), indent=2, sort_keys=False)


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in cells:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    return "\n".join(lines)


def usage_cell(used: int, capacity: int) -> str:
    pct = 100.0 * used / capacity if capacity else 0.0
    return f"{human_bytes(used)}/{human_bytes(capacity)} ({pct:.0f}%)"


def tier_cell(t) -> str:
    """A TierView as used/capacity, plus what compression saves where it saves any."""
    cell = usage_cell(t.used_bytes, t.capacity_bytes)
    if 0 < t.stored_bytes < t.uncompressed_bytes:
        cell += f" [stored {human_bytes(t.stored_bytes)} of {human_bytes(t.uncompressed_bytes)}]"
    if t.num_parked_blocks:  # their bytes are in `used`: say why the blocks do not show
        cell += f" [{parked_text(t.num_parked_blocks)}]"
    return cell


def parked_text(num_blocks: int) -> str:
    """Blocks recovered after a restart that wait for their prefix to be stored again
    (adopted then; freed first when the tier needs room, and after 10 minutes)."""
    return f"{num_blocks} blocks parked after a restart"


def tier_runs(tiers: list[str]) -> str:
    """['cpu','cpu','disk'] -> 'cpu×2 disk×1'."""
    runs: list[list] = []
    for t in tiers:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return " ".join(f"{t}×{n}" for t, n in runs) or "-"
