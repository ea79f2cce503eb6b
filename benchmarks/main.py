"""`kvcp-bench`: benchmarks and the demo workload. Each prints a table, or JSON with -o json."""

from __future__ import annotations

import json
import math
import signal
import threading

import click

from benchmarks.workload import Workload, WorkloadConfig


def _json(data) -> str:
    """Strict JSON: a ratio or rate with no finite value (a zero baseline) is null."""

    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [finite(v) for v in x]
        return x

    return json.dumps(finite(data), indent=2, allow_nan=False)


def _finite(ctx, param, value):
    """A number option that is a number (click's ranges let NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _positive_rate(*names: str, default: float, limit: float, help: str):
    """A rate option: a finite number above 0, at most `limit`."""
    kind = click.FloatRange(min=0, min_open=True, max=limit)
    return click.option(*names, default=default, show_default=True, type=kind, callback=_finite, help=help)


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
    type=click.FloatRange(min=0),
    callback=_finite,
    help="Requests per second (0: as fast as possible).",
)
@click.option(
    "--duration",
    "duration_seconds",
    default=0.0,
    type=click.FloatRange(min=0),
    callback=_finite,
    help="Seconds to run (0: until Ctrl-C).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def workload(controlplane, rate_per_second, duration_seconds, seed, output_format):
    """Drive a cluster with chat sessions sharing system prompts and Zipf-popular documents."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    w = Workload(controlplane, rate_per_second, WorkloadConfig(seed=seed))
    stats = w.run(stop, duration_seconds or None, report=lambda m: click.echo(m, err=True))
    failed = stats.errors_total and not stats.requests_total  # nothing served: no control plane?
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
        click.echo(_json(data))
    else:
        for k, v in data.items():
            click.echo(f"{k:20s} {v}")
    if failed:  # (it said 0 with every request failed)
        click.echo(
            f"kvcp-bench workload: no request was served ({stats.errors_total} failed): is a control plane at "
            f"{controlplane}? (--controlplane HOST:PORT)",
            err=True,
        )
        raise SystemExit(1)


@main.command()
@click.option(
    "--block-mib", "block_mibs", multiple=True, type=click.IntRange(1, 1024), default=[1, 4], show_default=True
)
@click.option(
    "--blocks",
    "num_blocks",
    default=32,
    show_default=True,
    type=click.IntRange(1),
    help="Blocks of 1 MiB per run (fewer when larger).",
)
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 1000))
@click.option("--fsync/--no-fsync", default=False, show_default=True, help="Durability of disk writes (baseline too).")
@click.option(
    "--torch-threads", default=1, show_default=True, type=click.IntRange(1, 256), help="As kvcp-agent --torch-threads."
)
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def tiers(block_mibs, num_blocks, repeats, fsync, torch_threads, output_format):
    """Tier moves (CPU<->DISK, CPU<->GPU with CUDA) and codecs, against raw baselines."""
    from benchmarks import tiers as bench

    result = bench.run(tuple(block_mibs), num_blocks, repeats, fsync, torch_threads)
    click.echo(_json(result) if output_format == "json" else bench.format_table(result))


@main.command()
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--capacity-blocks",
    "capacities",
    multiple=True,
    type=click.IntRange(min=1),
    help="Blocks in the agent's one tier (repeat for several runs).",
)
@click.option(
    "--capacity-fraction",
    "fractions",
    multiple=True,
    help="Capacity as a fraction of the trace's unique blocks: 1/16, 0.0625, 6.25% (default 1/16; repeatable).",
)
@click.option("--tiers", "tiers_text", default="", help="A tiered agent instead: gpu=N1,cpu=N2,disk=N3 blocks.")
@click.option(
    "--set", "settings", multiple=True, metavar="KEY=VALUE", help="Override a policy key (as kvctl policy set)."
)
@click.option(
    "--oracles",
    is_flag=True,
    help="Also three bounds that see part of the future (dead blocks; total counts; class statistics in hindsight).",
)
@click.option(
    "--evidence",
    type=click.Choice(["lookups", "events", "none"]),
    default="lookups",
    show_default=True,
    help="What the policy learns of each request: a router's lookup before the store; only the engine's "
    "store events (a vLLM fleet's KV events: the blocks' store times); nothing.",
)
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def replay(trace, capacities, fractions, tiers_text, settings, oracles, evidence, output_format):
    """Replay a Mooncake-format trace through the tier policy, against LRU, Belady and an infinite cache.

    One JSON object with -o json for one run; a list of them for several."""
    from benchmarks import replay as bench
    from controlplane.core.policy import Policy
    from protos import errors

    try:
        tiers = bench.parse_tiers(tiers_text) if tiers_text else None
        fracs = [bench.parse_fraction(f) for f in fractions]
        trace_requests = bench.load_trace(trace)
    except ValueError as exc:  # TraceError is a ValueError
        raise click.UsageError(str(exc)) from None
    policy = bench.replay_policy()
    if settings:
        values = {}
        for s in settings:
            key, sep, value = s.partition("=")
            if not sep:
                raise click.UsageError(f"--set {s!r}: expected KEY=VALUE")
            values[key.strip()] = value
        try:
            policy = Policy.from_mapping(values, field="--set", base=policy)
        except errors.InvalidArgument as exc:
            raise click.UsageError(str(exc)) from None
    runs: list[dict] = []
    if tiers:
        runs.append({"tiers": tiers})
    runs += [{"capacity_blocks": n} for n in capacities]
    runs += [{"capacity_fraction": f} for f in fracs]
    if not runs:
        runs.append({"capacity_fraction": 1 / 16})
    results = []
    for kw in runs:
        results.append(
            bench.replay(trace, policy=policy, trace=trace_requests, oracles=oracles, evidence=evidence, **kw)
        )
    if output_format == "json":
        data = [r.to_json() for r in results]
        click.echo(_json(data[0] if len(data) == 1 else data))
    else:
        click.echo(bench.format_table(results))


@main.command()
@click.option("--agents", default=64, show_default=True, type=click.IntRange(1, 4096))
@click.option("--blocks-per-agent", default=1_000_000, show_default=True, type=click.IntRange(1))
@click.option(
    "--lookup-blocks", default=128, show_default=True, type=click.IntRange(1, 65536), help="Blocks per lookup prefix."
)
@click.option(
    "--event-batch-blocks", default=1024, show_default=True, type=click.IntRange(1), help="Blocks per event batch."
)
@click.option(
    "--agent-processes",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Processes the agents are spread over.",
)
@_positive_rate("--lookup-rate", default=200.0, limit=1e7, help="Offered lookups per second.")
@click.option(
    "--lookup-seconds", default=10.0, show_default=True, type=float, help="Duration of the lookup phase after ingest."
)
@click.option(
    "--shared-fraction",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="Fraction of each agent's chains that every agent holds.",
)
@click.option("--etcd", default="", help="Use this etcd (HOST:PORT) instead of starting one.")
@click.option(
    "--peers/--no-peers",
    default=True,
    show_default=True,
    help="Also measure Dynamo's RadixTree, Mooncake's master and the kvcp index in process.",
)
@click.option(
    "--peer-blocks",
    default=2_000_000,
    show_default=True,
    type=click.IntRange(1),
    help="Block events fed to each in-process peer.",
)
@click.option("--mooncake-keys", default=1_000_000, show_default=True, type=click.IntRange(1))
@click.option(
    "--churn-fraction",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0, 1),
    help="Steady-state phase: share of each agent's blocks removed and replaced by new ones.",
)
@click.option(
    "--policy-loop/--no-policy-loop",
    default=False,
    show_default=True,
    help="Run the control plane's tier-policy pass; agents report full tiers so every one has blocks to shed.",
)
@click.option(
    "--expected-blocks",
    default=0,
    show_default=True,
    type=click.IntRange(0, 1 << 34),
    help="Size the control plane's index for this many distinct blocks at start, as "
    "`kvcp-controlplane --expected-blocks` does (0: it grows from empty).",
)
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def controlplane(output_format, **kwargs):
    """Control-plane ingest, lookup latency, memory and resync under simulated agents (real gRPC, real etcd)."""
    from benchmarks import controlplane as bench

    cfg = bench.BenchConfig(**kwargs)
    try:
        result = bench.run(cfg, report=lambda m: click.echo(m, err=True))
    except (RuntimeError, ValueError, ConnectionError) as exc:
        click.echo(f"kvcp-bench controlplane: {exc}", err=True)
        raise SystemExit(2) from None
    click.echo(_json(result) if output_format == "json" else bench.format_table(result))


@main.command()
@click.option("--sizes", default="1,16,64,256", show_default=True, help="Payloads in MiB, comma separated.")
@click.option("--block-mib", default=1, show_default=True, type=click.IntRange(1, 64), help="Block size in MiB.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--chunk-mib", default=8, show_default=True, type=click.IntRange(1, 1024), help="Engine write batch.")
@click.option("--fault/--no-fault", default=True, show_default=True, help="Also kill a receiver mid-transfer.")
@click.option("--etcd", default="", help="An etcd to use (default: start one on free ports).")
@click.option("--simulate", is_flag=True, help="Instead: N prefill / M decode agents under a request stream.")
@click.option("--prefill", "num_prefill", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option("--decode", "num_decode", default=2, show_default=True, type=click.IntRange(1, 64))
@_positive_rate("--rate", "requests_per_second", default=6.0, limit=1e6, help="Simulated requests/s.")
@click.option("--requests", "num_requests", default=2000, show_default=True, type=click.IntRange(1))
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def handoff(
    sizes,
    block_mib,
    repeats,
    chunk_mib,
    fault,
    etcd,
    simulate,
    num_prefill,
    num_decode,
    requests_per_second,
    num_requests,
    output_format,
):
    """Prefill->decode handoff between two agent processes next to the raw Transfer Engine
    (same bytes, same processes, same run), the gRPC fallback, and a peer killed mid-transfer;
    with --simulate, decode-queue length and TTFT with and without backpressure."""
    from benchmarks import handoff as bench

    if simulate:
        cfg = bench.SimConfig(
            num_prefill=num_prefill,
            num_decode=num_decode,
            requests_per_second=requests_per_second,
            num_requests=num_requests,
        )
        result = bench.simulate_both(cfg)
        click.echo(_json(result) if output_format == "json" else bench.format_sim(result))
        return
    try:
        size_list = tuple(int(x) for x in sizes.split(",") if x.strip())
    except ValueError:
        size_list = ()
    if not size_list or min(size_list) < 1 or max(size_list) > 65536:
        raise click.BadParameter(
            f"{sizes!r} is not a list of MiB sizes from 1 to 65536 (example: 1,16,256)", param_hint="--sizes"
        ) from None
    try:
        result = bench.run(size_list, block_mib, repeats, etcd, fault, chunk_mib)
    except RuntimeError as exc:
        click.echo(f"kvcp-bench handoff: {exc}", err=True)
        raise SystemExit(2) from None
    click.echo(_json(result) if output_format == "json" else bench.format_table(result))


main.add_command(handoff, name="transfer")  # the name for the same benchmark


@main.command()
@click.option(
    "--seconds",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=10),
    help="How long the load runs; the faults are spread over it, and their own pauses (etcd stopped and restarted, a leader paused, the recoveries) make a run last about a minute at least.",
)
@click.option("--rate", "rate_per_second", default=8.0, show_default=True, type=click.FloatRange(min=0.1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--log-dir", default="", help="Where the processes' logs go (default: a new temporary directory).")
@click.option("-o", "--output", "output_format", type=click.Choice(["table", "json"]), default="table")
def chaos(seconds, rate_per_second, seed, log_dir, output_format):
    """A loopback cluster (etcd, 2 control planes, 3 agents) under load while agents, the leader,
    etcd and a handoff are killed or paused, tier moves running across it all: wrong KV served, pins
    lost and moves accepted but never ended (all must be 0)."""
    from benchmarks import chaos as bench

    cfg = bench.ChaosConfig(seconds=seconds, rate_per_second=rate_per_second, seed=seed, log_dir=log_dir)
    try:
        result = bench.run(cfg, report=lambda m: click.echo(m, err=True))
    except (RuntimeError, ValueError, ConnectionError) as exc:
        click.echo(f"kvcp-bench chaos: {exc}", err=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        click.echo("kvcp-bench chaos: interrupted; every process it started is stopped", err=True)
        raise SystemExit(130) from None
    click.echo(_json(result.to_json()) if output_format == "json" else bench.format_table(result))
    click.echo(f"logs: {result.log_dir}", err=True)
