"""Text pieces the screens share: usage bars, byte sizes, durations, times. Rich `Text`
only (no widgets), so a cell of a table and a line of a panel look the same."""

from __future__ import annotations

import time

from rich.text import Text

from cli.output import human_bytes, parked_text

BAR_WIDTH = 10
SEVERITY_STYLES = {"info": "", "warning": "yellow", "error": "bold red"}
STATE_STYLES = {
    "ready": "green",
    "syncing": "yellow",
    "disconnected": "red",
    "RUNNING": "cyan",
    "PENDING": "yellow",
    "SUCCEEDED": "green",
    "FAILED": "red",
    "CANCELLED": "dim",
}


def bar(fraction: float, width: int = BAR_WIDTH, style: str = "") -> Text:
    """A horizontal bar in eighths: `fraction` of `width` cells filled; coloured by how
    full it is unless `style` is given (progress bars)."""
    fraction = min(1.0, max(0.0, fraction))
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    filled = "█" * full + partial
    style = style or ("red" if fraction >= 0.95 else "yellow" if fraction >= 0.8 else "green")
    out = Text(filled, style=style)
    out.append("░" * (width - len(filled)), style="grey37")
    return out


def usage_bar(used: int, capacity: int, label: str = "", width: int = BAR_WIDTH) -> Text:
    fraction = used / capacity if capacity else 0.0
    out = Text(f"{label:<4} " if label else "")
    out.append_text(bar(fraction, width))
    out.append(f" {fraction:>4.0%}")
    return out


def bytes_text(n: int) -> str:
    return human_bytes(n)


def parked_suffix(t) -> str:
    """What a tier's bytes hold besides its blocks: blocks parked after a restart (a disk
    tier with bytes used and no blocks says why)."""
    return f" (+{parked_text(t.num_parked_blocks)})" if t.num_parked_blocks else ""


def rate_bytes(bytes_per_second: float) -> str:
    return f"{human_bytes(int(bytes_per_second))}/s"


def duration(seconds: float) -> str:
    """Compact duration: 45s, 3m05s, 2h10m, 3d04h."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def clock_time(unix_seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix_seconds))


def styled(value: str, styles: dict[str, str] = STATE_STYLES) -> Text:
    return Text(value, style=styles.get(value, ""))


def short_id(value: str, width: int = 12) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"
