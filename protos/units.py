"""Sizes as people write them, one parser for every flag and policy value:
'4096', '64MiB' / '64Mi' / '64M' (binary), '64MB' (decimal), up to TiB/TB; and one
way to show them (`human_bytes`)."""

from __future__ import annotations

import math

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i
    _UNITS[_p + "b"] = 1000**_i


def parse_size(text: str) -> int:
    """'64MiB' -> 67108864; ValueError with an example when it does not parse."""
    s = str(text).strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in _UNITS or not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64MiB, 2GiB, 500MB)")
    return int(value * _UNITS[unit])


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as sizes are given)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
