"""Fixed views for the dashboard's snapshots and the README screenshot: the dataclasses
of cli/client.py, as the control plane would answer, fed through the app's own update
methods with the clock frozen at NOW."""

from __future__ import annotations

from cli.client import (
    AgentProgressView,
    AgentView,
    EventView,
    OperationView,
    PinView,
    StatsView,
    TierView,
)

NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC
MiB = 1 << 20


def agents() -> list[AgentView]:
    return [
        AgentView(
            "agent-1",
            "127.0.0.1:50061",
            "ready",
            523,
            [TierView("gpu", 64 * MiB, 61 * MiB, 310), TierView("cpu", 256 * MiB, 40 * MiB, 213)],
            ["demo-model"],
            812,
            64_000,
            42_600,
            NOW - 1,
        ),
        AgentView(
            "agent-2",
            "127.0.0.1:50062",
            "ready",
            491,
            [TierView("cpu", 32 * MiB, 30 * MiB, 491)],
            ["demo-model"],
            790,
            61_000,
            43_000,
            NOW - 2,
        ),
        AgentView(
            "agent-3",
            "127.0.0.1:50063",
            "syncing",
            0,
            [TierView("cpu", 32 * MiB, 0, 0)],
            ["demo-model"],
            0,
            0,
            0,
            NOW - 4,
        ),
    ]


def stats_series() -> list[tuple[float, StatsView]]:
    """Stats sampled every 2 s for a minute: a lookup rate that ramps up, a hit ratio that
    climbs as the caches warm."""
    out = []
    lookups = tokens = hits = 0
    for i in range(31):
        at = NOW - 60 + 2 * i
        rate = 4 + (i % 10)
        lookups += 2 * rate
        tokens += 2 * rate * 800
        hits += int(2 * rate * 800 * min(0.9, 0.3 + i / 40))
        out.append(
            (
                at,
                StatsView(
                    num_agents=3,
                    num_blocks=1014,
                    num_block_replicas=1014,
                    lookups_total=lookups,
                    lookup_tokens_total=tokens,
                    lookup_hit_tokens_total=hits,
                    resyncs_total=1,
                    events_total=2210,
                    leader_address="127.0.0.1:50051",
                    epoch=2,
                    is_leader=True,
                    tiers=[TierView("gpu", 64 * MiB, 61 * MiB, 310), TierView("cpu", 320 * MiB, 70 * MiB, 704)],
                    models=[{"model_id": "demo-model", "block_size": 16}],
                    # what agents moved between tiers grows through the minute: the sparkline
                    tier_moved_bytes_total=int(96 * MiB * (i / 31) ** 2),
                ),
            )
        )
    return out


def pins() -> list[PinView]:
    return [
        PinView("pin-7f3a2c", "legal-kb", "demo-model", "gpu", 128, 8 * MiB, True, "", "ops", NOW - 600, NOW + 3000),
        PinView(
            "pin-91be04", "default", "demo-model", "cpu", 12, 768 * 1024, False, "agent-1", "router", NOW - 30, NOW + 45
        ),
        PinView("pin-c0ffee", "chat", "demo-model", "cpu", 40, 2 * MiB, True, "", "session-svc", NOW - 5, 0.0),
    ]


def operations(moved_bytes: int = 96 * MiB) -> list[OperationView]:
    return [
        OperationView(
            "op-move-4d2e91",
            "move",
            "RUNNING",
            0.62,
            310,
            500,
            0,
            4,
            moved_bytes,
            [],
            "",
            NOW - 12,
            NOW - 1,
            {"to_tier": "disk", "namespace": "legal-kb"},
            [
                AgentProgressView("agent-1", "RUNNING", 200, 300, 0, ""),
                AgentProgressView("agent-2", "RUNNING", 110, 200, 0, ""),
            ],
            False,
        ),
        OperationView(
            "op-clean-8a10f3",
            "cleanup",
            "SUCCEEDED",
            1.0,
            220,
            220,
            0,
            12,
            0,
            [TierView("cpu", 0, 14 * MiB, 220)],
            "",
            NOW - 300,
            NOW - 290,
            {"older_than_seconds": "600"},
            [],
            False,
        ),
        OperationView(
            "op-comp-5b77c0",
            "compress",
            "FAILED",
            0.4,
            40,
            100,
            60,
            0,
            0,
            [],
            "agent-2: disk tier full",
            NOW - 900,
            NOW - 880,
            {"codec": "int8"},
            [],
            False,
        ),
    ]


def events() -> list[EventView]:
    rows = [
        (-58, "agent_joined", "info", "agent-1", "", "", "agent-1 joined from 127.0.0.1:50061"),
        (-57, "agent_state", "info", "agent-1", "", "", "agent-1 ready (0 blocks)"),
        (-55, "agent_joined", "info", "agent-2", "", "", "agent-2 joined from 127.0.0.1:50062"),
        (-54, "agent_state", "info", "agent-2", "", "", "agent-2 ready (0 blocks)"),
        (-40, "pin_created", "info", "", "", "pin-7f3a2c", "pinned namespace legal-kb at gpu or faster"),
        (-30, "op_state", "info", "", "op-clean-8a10f3", "", "cleanup SUCCEEDED: 220 blocks freed"),
        (
            -21,
            "notice",
            "warning",
            "agent-2",
            "",
            "",
            "corrupt_block: block 3fa9c1d2e4b7 in the disk tier is unreadable",
        ),
        (-15, "op_state", "error", "", "op-comp-5b77c0", "", "compress FAILED: agent-2: disk tier full"),
        (-12, "op_state", "info", "", "op-move-4d2e91", "", "move RUNNING: 0/500 blocks"),
        (-6, "agent_joined", "info", "agent-3", "", "", "agent-3 joined from 127.0.0.1:50063"),
        (-5, "agent_state", "info", "agent-3", "", "", "agent-3 connected; syncing its inventory"),
        (-2, "agent_state", "warning", "agent-2", "", "", "agent-2 resyncing: event batch seq 88 arrived, expected 87"),
    ]
    return [EventView(i + 1, NOW + dt, k, sev, a, op, pin, msg) for i, (dt, k, sev, a, op, pin, msg) in enumerate(rows)]


def load(app) -> None:
    """Feed everything through the app's update methods, as its workers do."""
    app.apply_connection("connected")
    app.apply_operations(operations(moved_bytes=0))
    series = stats_series()
    for at, stats in series:
        app.apply_stats(stats, at)
    app.apply_operations(operations())
    app.apply_agents(agents())
    app.apply_pins(pins())
    for e in events():
        app.apply_event(e)
