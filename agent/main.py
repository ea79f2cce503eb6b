"""`kvcp-agent`: run one agent (one per GPU)."""

from __future__ import annotations

import logging
import re
import sys

import click
import torch

from agent.core.codecs import available_codecs
from agent.core.model_spec import ModelSpec
from agent.dataplane import DataPlaneConfig
from agent.server import DEMO_MODEL, Agent, AgentConfig
from protos.etcd_keys import EtcdAuth
from protos.metrics import parse_listen
from protos.security import TLSConfig, read_secret
from protos.signals import wait_for_stop_signal
from protos.tier import Tier
from protos.units import parse_size


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
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


def _metrics_listen(ctx, param, value: str) -> str:
    if value:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


def _rdma_devices(ctx, param, value: str) -> str:
    """NIC names as `ibv_devices` lists them, comma separated (the transport is checked in main)."""
    if not value:
        return ""
    names = [n.strip() for n in value.split(",")]
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
            raise click.BadParameter(f"{name!r} is not an RDMA device name (as ibv_devices lists them)")
    return ",".join(names)


@click.command(context_settings={"auto_envvar_prefix": "KVCP_AGENT", "help_option_names": ["-h", "--help"]})
@click.option("--agent-id", required=True, help="Unique id of this agent (env KVCP_AGENT_AGENT_ID).")
@click.option("--listen", default="127.0.0.1:50061", show_default=True, help="gRPC listen address of the engine API.")
@click.option("--etcd", default="127.0.0.1:2379", show_default=True, help="etcd endpoints, comma separated.")
@click.option("--controlplane", default="", help="Control-plane address; default: the leader recorded in etcd.")
@click.option("--advertise", default="", help="Address peers and the control plane reach this agent at.")
@click.option(
    "--role",
    default="both",
    show_default=True,
    type=click.Choice(["prefill", "decode", "both"]),
    help="What a router may send here (Route).",
)
@click.option(
    "--transfer-engine",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "mooncake", "none"]),
    help="Data plane of handoffs; none: shared memory and the gRPC fallback only; auto: mooncake, "
    "unless the agent has --token-file (the engine's own port takes no token).",
)
@click.option(
    "--transfer-protocol",
    default="tcp",
    show_default=True,
    type=click.Choice(["tcp", "rdma"]),
    help="The engine's transport (rdma: memlock limits must cover the whole CPU slab, which is registered).",
)
@click.option(
    "--rdma-devices",
    default="",
    callback=_rdma_devices,
    help="RDMA NICs the engine uses, comma separated (mlx5_0,mlx5_1: those nearest the agent's GPU); "
    "empty: the engine discovers them. Only with --transfer-protocol rdma.",
)
@click.option(
    "--transfer-metadata",
    default="P2PHANDSHAKE",
    show_default=True,
    help="The engine's metadata: P2PHANDSHAKE, or etcd://host:port.",
)
@click.option(
    "--shm-handoff/--no-shm-handoff",
    default=True,
    show_default=True,
    help="Keep the CPU slab in shared memory (a memfd; pinned in place with CUDA) so agents on this host hand off by memcpy.",
)
@click.option(
    "--handoff-deadline-seconds",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.1, 600.0),
    help="Answer time of a handoff that names none (its caller waits up to 600 s for one).",
)
@click.option("--link-max-concurrent", default=2, show_default=True, type=click.IntRange(1, 64))
@click.option(
    "--link-bandwidth", default="0", show_default=True, type=SizeType(), help="Bytes/s per peer link (0: unlimited)."
)
@click.option("--max-inbound-handoffs", default=8, show_default=True, type=click.IntRange(1, 1024))
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
@click.option(
    "--disk-dir", default="", help="Directory of the disk tier (one slab file, blocks.kvslab); empty: no disk tier."
)
@click.option("--disk-capacity", default="1GiB", show_default=True, type=SizeType(), help="Disk tier size.")
@click.option(
    "--disk-fsync/--no-disk-fsync", default=False, show_default=True, help="fsync every block written to disk."
)
@click.option(
    "--gpu-device",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="CUDA device of this agent's GPU tier, pinned memory and CUDA context (one agent per GPU).",
)
@click.option("--gpu-codec", default="none", show_default=True, type=click.Choice(available_codecs()))
@click.option(
    "--cpu-codec",
    default="none",
    show_default=True,
    type=click.Choice(available_codecs()),
    help="Codec applied to raw blocks entering the CPU tier.",
)
@click.option(
    "--disk-codec",
    default="none",
    show_default=True,
    type=click.Choice(available_codecs()),
    help="Codec applied to raw blocks demoted to disk (int8: half the bytes, lossy; zstd: lossless, slow).",
)
@click.option("--lease-ttl-seconds", default=10, show_default=True, type=click.IntRange(2, 3600))
@click.option("--etcd-wait-seconds", default=30.0, show_default=True, type=float)
@click.option("--etcd-ca", default="", help="CA of etcd's certificate (TLS to etcd).")
@click.option("--etcd-cert", default="", help="Client certificate for etcd.")
@click.option("--etcd-key", default="", help="Client key for etcd.")
@click.option("--etcd-user", default="", help="etcd user (password from --etcd-password-file or KVCP_ETCD_PASSWORD).")
@click.option("--etcd-password-file", default="")
@click.option(
    "--metrics-listen",
    default="127.0.0.1:9401",
    show_default=True,
    callback=_metrics_listen,
    help="Prometheus /metrics address (port 0: any free port; empty: none); a taken port falls back to a free one.",
)
@click.option("--token-file", default="", help="Agent token for the control plane (else env KVCP_AGENT_TOKEN).")
@click.option(
    "--engine-token-file",
    default="",
    help="Token the inference engine must present on this agent's engine API (else env KVCP_ENGINE_TOKEN; none: open).",
)
@click.option(
    "--tls-ca",
    default="",
    help="CA of the control plane's and peers' certificates: TLS to them (with --tls-cert alone: the system's roots).",
)
@click.option(
    "--tls-cert",
    default="",
    help="This agent's certificate: TLS on its listener, mTLS to the CP; its calls out are TLS then, never plain.",
)
@click.option("--tls-key", default="", help="This agent's private key.")
@click.option(
    "--tls-client-ca",
    default="",
    help="CA of client certificates: the listener requires them (mTLS; peers and engines present theirs).",
)
@click.option(
    "--vllm-kv-events",
    default="",
    help="A vLLM engine's KV event publisher (tcp://host:port): index its blocks (see --vllm-index-by).",
)
@click.option("--vllm-kv-events-replay", default="", help="That engine's replay endpoint (tcp://host:port), for gaps.")
@click.option("--vllm-kv-events-topic", default="", help="Topic of the engine's KV events (vLLM's default: none).")
@click.option("--vllm-model-id", default="", help="Model the engine's blocks belong to (default: the first --model).")
@click.option(
    "--vllm-kv-group",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="The engine's KV cache group to index (hybrid models: a full-attention one); other groups' events are "
    "left out (counted).",
)
@click.option(
    "--vllm-index-by",
    default="tokens",
    show_default=True,
    type=click.Choice(["tokens", "vllm"]),
    help="Index the engine's blocks under kvcp's digest of their tokens (token lookups, kvctl, Route and pins "
    "find them; LoRA and multimodal blocks stay under vLLM's hash) or under vLLM's own hashes (a router that "
    "computes them).",
)
@click.option(
    "--vllm-disconnect-grace-seconds",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="The engine's event connection down this long: its blocks are forgotten (re-read when it is back).",
)
@click.option(
    "--torch-threads",
    default=1,
    show_default=True,
    type=click.IntRange(1, 256),
    help="torch's intra-op threads for codecs and copies (more than the agent's share of cores stalls them).",
)
@click.option(
    "--codec-threads",
    default=2,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Threads that encode blocks moving to a compressed tier while the blocks before them are written.",
)
@click.option(
    "--shm-copy-threads",
    default=DataPlaneConfig.shm_copy_threads,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Threads that copy one same-host handoff side by side (fewer leave more cores to the inference engine).",
)
@click.option("--log-level", default="INFO", show_default=True)
def main(
    agent_id,
    role,
    transfer_engine,
    transfer_protocol,
    rdma_devices,
    transfer_metadata,
    shm_handoff,
    handoff_deadline_seconds,
    link_max_concurrent,
    link_bandwidth,
    max_inbound_handoffs,
    listen,
    etcd,
    controlplane,
    advertise,
    models,
    cpu_capacity,
    gpu_capacity,
    gpu_device,
    disk_dir,
    disk_capacity,
    disk_fsync,
    gpu_codec,
    cpu_codec,
    disk_codec,
    lease_ttl_seconds,
    token_file,
    engine_token_file,
    tls_ca,
    tls_cert,
    tls_key,
    tls_client_ca,
    etcd_wait_seconds,
    etcd_ca,
    etcd_cert,
    etcd_key,
    etcd_user,
    etcd_password_file,
    metrics_listen,
    vllm_kv_events,
    vllm_kv_events_replay,
    vllm_kv_events_topic,
    vllm_model_id,
    vllm_kv_group,
    vllm_index_by,
    vllm_disconnect_grace_seconds,
    torch_threads,
    codec_threads,
    shm_copy_threads,
    log_level,
):
    """Run a kvcp agent: a tiered KV block store that reports to the control plane."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the agent's own threads (gRPC, mover, disk I/O) share the cores with torch's pool; a
    # pool as wide as the machine spins against them (int8 encode: 0.3 GB/s on one
    # thread, 0.02 GB/s on two, on a busy 2-core machine)
    torch.set_num_threads(torch_threads)
    try:
        token = read_secret(token_file, "KVCP_AGENT_TOKEN")
        engine_token = read_secret(engine_token_file, "KVCP_ENGINE_TOKEN")
        etcd_password = read_secret(etcd_password_file, "KVCP_ETCD_PASSWORD")
    except ValueError as exc:
        click.echo(f"kvcp-agent: {exc}", err=True)
        sys.exit(2)
    etcd_auth = EtcdAuth(etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password)
    if etcd_auth.problem():
        click.echo(f"kvcp-agent: {etcd_auth.problem()}", err=True)
        sys.exit(2)
    if rdma_devices and transfer_protocol != "rdma":
        click.echo(
            "kvcp-agent: --rdma-devices needs --transfer-protocol rdma (the TCP transport picks no NIC)", err=True
        )
        sys.exit(2)
    if listen.rpartition(":")[0].strip("[]") in ("0.0.0.0", "::") and not advertise:
        # the address registered with the control plane, and the engine's endpoint, would
        # be the wildcard: no peer reaches it
        click.echo(
            f"kvcp-agent: --listen {listen} binds every interface: give --advertise HOST:PORT, "
            "the address peers and the control plane reach this agent at",
            err=True,
        )
        sys.exit(2)
    if bool(tls_cert) != bool(tls_key):
        click.echo("kvcp-agent: --tls-cert and --tls-key go together", err=True)
        sys.exit(2)
    if tls_client_ca and not tls_cert:
        # a half-given TLS setup must not quietly serve in plain text
        click.echo(
            "kvcp-agent: --tls-client-ca needs --tls-cert and --tls-key (client certificates ride on TLS)", err=True
        )
        sys.exit(2)
    tls = TLSConfig(tls_cert, tls_key, tls_ca) if (tls_ca or tls_cert) else None
    if torch.cuda.is_available():  # before any CUDA call: the context, pinned memory and tier on this GPU
        if gpu_device >= torch.cuda.device_count():
            click.echo(
                f"kvcp-agent: --gpu-device {gpu_device}: this process sees {torch.cuda.device_count()} CUDA "
                "device(s) (CUDA_VISIBLE_DEVICES renumbers them from 0)",
                err=True,
            )
            sys.exit(2)
        torch.cuda.set_device(gpu_device)
    config = AgentConfig(
        controlplane_token=token,
        engine_token=engine_token,
        tls=tls,
        tls_client_ca=tls_client_ca,
        agent_id=agent_id,
        role=role,
        transfer_engine=transfer_engine,
        transfer_protocol=transfer_protocol,
        rdma_devices=rdma_devices,
        transfer_metadata=transfer_metadata,
        shm_handoff=shm_handoff,
        codec_threads=codec_threads,
        dataplane=DataPlaneConfig(
            deadline_seconds=handoff_deadline_seconds,
            link_max_concurrent=link_max_concurrent,
            link_bytes_per_second=float(link_bandwidth),
            max_inbound=max_inbound_handoffs,
            shm_copy_threads=shm_copy_threads,
        ),
        listen=listen,
        etcd=etcd,
        controlplane=controlplane,
        advertise=advertise,
        models=list(models) or [DEMO_MODEL],
        cpu_capacity_bytes=cpu_capacity,
        gpu_capacity_bytes=gpu_capacity,
        gpu_device=gpu_device,
        disk_dir=disk_dir,
        disk_capacity_bytes=disk_capacity,
        disk_fsync=disk_fsync,
        tier_codecs={Tier.GPU: gpu_codec, Tier.CPU: cpu_codec, Tier.DISK: disk_codec},
        lease_ttl_seconds=lease_ttl_seconds,
        etcd_wait_seconds=etcd_wait_seconds,
        etcd_auth=etcd_auth,
        metrics_listen=metrics_listen,
        vllm_kv_events=vllm_kv_events,
        vllm_kv_events_replay=vllm_kv_events_replay,
        vllm_kv_events_topic=vllm_kv_events_topic,
        vllm_model_id=vllm_model_id,
        vllm_disconnect_grace_seconds=vllm_disconnect_grace_seconds,
        vllm_kv_group=vllm_kv_group,
        vllm_index_by=vllm_index_by,
    )
    try:
        agent = Agent(config, log_fn=lambda m: click.echo(m, err=True)).start()
    except (ConnectionError, OSError, ValueError) as exc:
        click.echo(f"kvcp-agent: {exc}", err=True)
        sys.exit(2)
    metrics = f", metrics on http://{agent.metrics_address}/metrics" if agent.metrics_address else ""
    click.echo(f"kvcp-agent {agent_id} serving on {agent.address}{metrics}", err=True)
    wait_for_stop_signal()
    agent.stop()


if __name__ == "__main__":
    main()
