"""How full agents keep a tier: sample their metrics endpoints and report the share of
samples over a fill level (the high watermark), the largest fill seen, and the blocks the
tier lost to the policy's commands and to stores that found it full, over the run.

    python scripts/tier_fill.py 127.0.0.1:9401 127.0.0.1:9402 --seconds 60
"""

from __future__ import annotations

import argparse
import re
import time
import urllib.request

USAGE = re.compile(r"^kvcp_tier_(used|capacity)_bytes\{([^}]*)\} (\S+)", re.M)
DEMOTED = re.compile(r"^kvcp_(?:demotions|evictions)_total\{([^}]*)\} (\S+)", re.M)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as r:
        return r.read().decode()


def fill(text: str, tier: str) -> float | None:
    used = capacity = 0.0
    for kind, labels, value in USAGE.findall(text):
        if f'tier="{tier}"' in labels:
            used, capacity = (used + float(value), capacity) if kind == "used" else (used, capacity + float(value))
    return used / capacity if capacity else None


def left(text: str, tier: str) -> dict[str, float]:
    """Blocks that left the tier (demoted or evicted) so far, by reason."""
    out: dict[str, float] = {}
    for labels, value in DEMOTED.findall(text):
        if f'tier="{tier}"' in labels:
            reason = re.search(r'reason="(\w+)"', labels).group(1)
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="agents' metrics addresses, host:port")
    p.add_argument("--tier", default="cpu")
    p.add_argument("--level", type=float, default=0.95, help="the fill level to count samples over")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--interval-seconds", type=float, default=0.25)
    a = p.parse_args()
    first = {m: left(scrape(m), a.tier) for m in a.metrics}
    samples: dict[str, list[float]] = {m: [] for m in a.metrics}
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        for m in a.metrics:
            f = fill(scrape(m), a.tier)
            if f is not None:
                samples[m].append(f)
        time.sleep(a.interval_seconds)
    print(
        f"{'AGENT METRICS':22} {'SAMPLES':>7} {'OVER ' + str(a.level):>9} {'MAX':>6} {'MEAN':>6}  BLOCKS LEFT BY REASON"
    )
    for m in a.metrics:
        s = samples[m] or [0.0]
        last = left(scrape(m), a.tier)
        gone = {k: int(v - first[m].get(k, 0.0)) for k, v in sorted(last.items())}
        over = sum(x > a.level for x in s) / len(s)
        print(f"{m:22} {len(s):7d} {over:9.2f} {max(s):6.3f} {sum(s) / len(s):6.3f}  {gone}")


if __name__ == "__main__":
    main()
