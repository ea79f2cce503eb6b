"""The Grafana dashboard's disk compaction panel draws bytes per second, compactions per
interval and a 0-1 fragmentation ratio: each needs its own unit and axis, or the ratio
and the counts lie flat at zero under megabytes per second."""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboard" / "grafana" / "kvcp.json"


def _units(panel: dict) -> dict[str, str]:
    """refId -> the unit Grafana draws that query in (the default, or its override's)."""
    default = panel["fieldConfig"]["defaults"].get("unit", "")
    units = {t["refId"]: default for t in panel["targets"]}
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"]["id"] == "byFrameRefID":
            for prop in override["properties"]:
                if prop["id"] == "unit":
                    units[override["matcher"]["options"]] = prop["value"]
    return units


def test_the_disk_compaction_panel_gives_bytes_counts_and_the_ratio_their_own_units():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panel = next(p for p in panels if p.get("title") == "Disk compaction")
    by_metric = {}
    for t in panel["targets"]:
        if "kvcp_disk_relocated_bytes_total" in t["expr"]:
            by_metric["relocated"] = t["refId"]
        elif "kvcp_disk_compactions_total" in t["expr"]:
            by_metric["compactions"] = t["refId"]
        elif "kvcp_disk_largest_free_run_bytes" in t["expr"]:
            by_metric["fragmentation"] = t["refId"]
    units = _units(panel)
    assert units[by_metric["relocated"]] in ("Bps", "binBps"), units
    assert units[by_metric["fragmentation"]] == "percentunit", units
    assert units[by_metric["compactions"]] not in ("Bps", "binBps", "percentunit"), units
