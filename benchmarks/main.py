"""`kvcp-bench`: benchmarks and the demo workload. Each prints a table, or JSON with -o json."""

from __future__ import annotations

import json
import signal
import threading

import click

from benchmarks.workload import Workload, WorkloadConfig


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """kvcp benchmarks (figures are ratios against baselines measured in the same run)."""


@main.command()
@click.option("--controlplane", default="127.0.0.1:50051", show_default=True, envvar="KVCTL_ENDPOINT")
@click.option(
    "--rate",
    "rate_per_second",
    default=10.0,
    show_default=True,
    type=float,
    help="Requests per second (0: as fast as possible).",
)
@click.option("--duration", "duration_seconds", default=0.0, type=float, help="Seconds to run (0: until Ctrl-C).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def workload(controlplane, rate_per_second, duration_seconds, seed, output_format):
    """Drive a cluster with chat sessions sharing system prompts and Zipf-popular documents."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    w = Workload(controlplane, rate_per_second, WorkloadConfig(seed=seed))
    stats = w.run(stop, duration_seconds or None, report=lambda m: click.echo(m, err=True))
    data = {
        "requests": stats.requests_total,
        "prompt_tokens": stats.prompt_tokens_total,
        "hit_tokens": stats.hit_tokens_total,
        "hit_ratio": round(stats.hit_ratio, 4),
        "stored_blocks": stats.stored_blocks_total,
        "corrupt_blocks": stats.corrupt_blocks_total,
        "errors": stats.errors_total,
        "per_agent_requests": stats.per_agent_requests,
    }
    if output_format == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            click.echo(f"{k:20s} {v}")


@main.command()
@click.option("--block-mib", "block_mibs", multiple=True, type=int, default=[1, 4], show_default=True)
@click.option("--blocks", "num_blocks", default=32, show_default=True, type=int, help="Blocks of 1 MiB per run (fewer when larger).")
@click.option("--repeats", default=3, show_default=True, type=int)
@click.option("--fsync/--no-fsync", default=False, show_default=True, help="Durability of disk writes (baseline too).")
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def tiers(block_mibs, num_blocks, repeats, fsync, output_format):
    """Tier moves (CPU<->DISK, CPU<->GPU with CUDA) and codecs, against raw baselines."""
    from benchmarks import tiers as bench

    result = bench.run(tuple(block_mibs), num_blocks, repeats, fsync)
    click.echo(json.dumps(result, indent=2) if output_format == "json" else bench.format_table(result))
