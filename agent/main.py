"""`kvcp-agent`: run one agent (one per GPU)."""

from __future__ import annotations

import logging
import signal
import sys
import threading

import click

from agent.core.model_spec import ModelSpec
from agent.server import DEMO_MODEL, Agent, AgentConfig

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """'64MiB' -> 67108864."""
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in SIZE_UNITS or not num:
        raise ValueError(f"{text!r} is not a size (examples: 4096, 64MiB, 2GiB)")
    return int(float(num) * SIZE_UNITS[unit])


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class ModelType(click.ParamType):
    name = "MODEL_SPEC"

    def convert(self, value, param, ctx):
        if isinstance(value, ModelSpec):
            return value
        try:
            return ModelSpec.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.command(context_settings={"auto_envvar_prefix": "KVCP_AGENT", "help_option_names": ["-h", "--help"]})
@click.option("--agent-id", required=True, help="Unique id of this agent (env KVCP_AGENT_AGENT_ID).")
@click.option("--listen", default="127.0.0.1:50061", show_default=True, help="gRPC listen address of the engine API.")
@click.option("--etcd", default="127.0.0.1:2379", show_default=True, help="etcd endpoints, comma separated.")
@click.option("--controlplane", default="", help="Control-plane address; default: the leader recorded in etcd.")
@click.option("--advertise", default="", help="Address peers and the control plane reach this agent at.")
@click.option(
    "--model",
    "models",
    multiple=True,
    type=ModelType(),
    help=f"Model KV layout, repeatable (default {DEMO_MODEL.format()}).",
)
@click.option("--cpu-capacity", default="64MiB", show_default=True, type=SizeType(), help="Host-memory tier size.")
@click.option(
    "--gpu-capacity", default="0", show_default=True, type=SizeType(), help="GPU tier size (used when CUDA is present)."
)
@click.option("--lease-ttl-seconds", default=10, show_default=True, type=click.IntRange(2, 3600))
@click.option("--etcd-wait-seconds", default=30.0, show_default=True, type=float)
@click.option("--log-level", default="INFO", show_default=True)
def main(
    agent_id,
    listen,
    etcd,
    controlplane,
    advertise,
    models,
    cpu_capacity,
    gpu_capacity,
    lease_ttl_seconds,
    etcd_wait_seconds,
    log_level,
):
    """Run a kvcp agent: a tiered KV block store that reports to the control plane."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = AgentConfig(
        agent_id=agent_id,
        listen=listen,
        etcd=etcd,
        controlplane=controlplane,
        advertise=advertise,
        models=list(models) or [DEMO_MODEL],
        cpu_capacity_bytes=cpu_capacity,
        gpu_capacity_bytes=gpu_capacity,
        lease_ttl_seconds=lease_ttl_seconds,
        etcd_wait_seconds=etcd_wait_seconds,
    )
    try:
        agent = Agent(config, log_fn=lambda m: click.echo(m, err=True)).start()
    except (ConnectionError, OSError, ValueError) as exc:
        click.echo(f"kvcp-agent: {exc}", err=True)
        sys.exit(2)
    click.echo(f"kvcp-agent {agent_id} serving on {agent.address}", err=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    agent.stop()


if __name__ == "__main__":
    main()
