"""`kvcp-controlplane`: run one control-plane replica."""

from __future__ import annotations

import logging
import sys

import click

from controlplane.server import ControlPlane, ControlPlaneConfig
from protos.etcd_keys import EtcdAuth
from protos.metrics import parse_listen
from protos.security import TLSConfig, read_secret
from protos.signals import wait_for_stop_signal


def _metrics_listen(ctx, param, value: str) -> str:
    if value:
        try:
            parse_listen(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return value


@click.command(context_settings={"auto_envvar_prefix": "KVCP", "help_option_names": ["-h", "--help"]})
@click.option("--listen", default="127.0.0.1:50051", show_default=True, help="gRPC listen address (env KVCP_LISTEN).")
@click.option(
    "--etcd", default="127.0.0.1:2379", show_default=True, help="etcd endpoints, comma separated (env KVCP_ETCD)."
)
@click.option("--advertise", default="", help="Address agents and clients reach this replica at.")
@click.option("--election-ttl-seconds", default=5, show_default=True, type=click.IntRange(1, 3600))
@click.option(
    "--etcd-wait-seconds", default=30.0, show_default=True, type=float, help="How long to wait for etcd at start."
)
@click.option(
    "--metrics-listen",
    default="127.0.0.1:9400",
    show_default=True,
    callback=_metrics_listen,
    help="Prometheus /metrics address (env KVCP_METRICS_LISTEN; port 0: any free port; empty: none).",
)
@click.option("--admin-tokens-file", default="", help="'viewer|operator TOKEN' lines; empty: admin API open.")
@click.option("--agent-token-file", default="", help="Agents must present this token (env KVCP_AGENT_TOKEN).")
@click.option("--tls-cert", default="", help="Server certificate (PEM): TLS on the gRPC listener.")
@click.option("--tls-key", default="", help="Server private key (PEM).")
@click.option("--tls-client-ca", default="", help="CA of client certificates: require them (mTLS).")
@click.option("--etcd-ca", default="", help="CA of etcd's certificate (TLS to etcd).")
@click.option("--etcd-cert", default="", help="Client certificate for etcd.")
@click.option("--etcd-key", default="", help="Client key for etcd.")
@click.option("--etcd-user", default="", help="etcd user (password from --etcd-password-file or KVCP_ETCD_PASSWORD).")
@click.option("--etcd-password-file", default="")
@click.option(
    "--etcd-timeout-seconds",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.1, 60),
    help="Timeout of each etcd call (keep it under clients' deadlines: a durable change to an etcd that "
    "does not answer is then refused UNAVAILABLE).",
)
@click.option(
    "--expected-blocks",
    default=0,
    show_default=True,
    type=click.IntRange(0, 1 << 34),
    envvar="KVCP_EXPECTED_BLOCKS",
    help="Distinct blocks to size the index for at start (0: it grows as blocks come, doubling).",
)
@click.option(
    "--gil-switch-interval-ms",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0.05, 100.0),
    help="How long a Python thread keeps the GIL while another waits (Python's default: 5): the "
    "event applier and the policy pass are CPU-bound, and a lookup waits up to this behind them.",
)
@click.option(
    "--lookup-listen",
    default="",
    envvar="KVCP_LOOKUP_LISTEN",
    help="Also answer Lookup on a plain socket, HOST:PORT or unix:PATH (length-prefixed protobuf, "
    "kvcp.v1.LookupFrame): a router's lookup without gRPC's round trip. Same admin tokens; TLS over TCP "
    "when --tls-cert is given.",
)
@click.option(
    "--op-timeout-seconds",
    default=60.0,
    show_default=True,
    type=click.FloatRange(15.0, 86400.0),
    help="An operation's part fails when its agent says nothing of it for this long (agents report "
    "progress, an operation queued behind another every 10 s, a transfer every 5 s).",
)
@click.option("--log-level", default="INFO", show_default=True)
def main(
    listen,
    etcd,
    advertise,
    election_ttl_seconds,
    etcd_wait_seconds,
    metrics_listen,
    admin_tokens_file,
    agent_token_file,
    tls_cert,
    tls_key,
    tls_client_ca,
    etcd_ca,
    etcd_cert,
    etcd_key,
    etcd_user,
    etcd_password_file,
    etcd_timeout_seconds,
    expected_blocks,
    gil_switch_interval_ms,
    lookup_listen,
    op_timeout_seconds,
    log_level,
):
    """Run a kvcp control-plane replica (global block index, lookup, policy)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(gil_switch_interval_ms / 1000.0)  # the whole process: set here, not by the library
    if bool(tls_cert) != bool(tls_key):
        click.echo("kvcp-controlplane: --tls-cert and --tls-key go together", err=True)
        sys.exit(2)
    # a half-given TLS setup must not quietly serve (or reach etcd) in plain text
    if tls_client_ca and not tls_cert:
        click.echo(
            "kvcp-controlplane: --tls-client-ca needs --tls-cert and --tls-key (client certificates ride on TLS)",
            err=True,
        )
        sys.exit(2)
    try:
        agent_token = read_secret(agent_token_file, "KVCP_AGENT_TOKEN")
        etcd_password = read_secret(etcd_password_file, "KVCP_ETCD_PASSWORD")
    except ValueError as exc:
        click.echo(f"kvcp-controlplane: {exc}", err=True)
        sys.exit(2)
    etcd_auth = EtcdAuth(etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password)
    if etcd_auth.problem():
        click.echo(f"kvcp-controlplane: {etcd_auth.problem()}", err=True)
        sys.exit(2)
    config = ControlPlaneConfig(
        admin_tokens_file=admin_tokens_file,
        agent_token=agent_token,
        tls=TLSConfig(tls_cert, tls_key, tls_client_ca) if tls_cert else None,
        require_client_cert=bool(tls_client_ca),
        etcd_auth=etcd_auth,
        listen=listen,
        etcd=etcd,
        advertise=advertise,
        election_ttl_seconds=election_ttl_seconds,
        etcd_wait_seconds=etcd_wait_seconds,
        etcd_timeout_seconds=etcd_timeout_seconds,
        metrics_listen=metrics_listen,
        expected_blocks=expected_blocks,
        lookup_listen=lookup_listen,
        op_timeout_seconds=op_timeout_seconds,
    )
    cp = ControlPlane(config, log_fn=lambda m: click.echo(m, err=True))
    try:
        cp.start()
    except (ConnectionError, OSError, ValueError) as exc:
        click.echo(f"kvcp-controlplane: {exc}", err=True)
        sys.exit(2)
    election = cp.election
    assert election is not None  # start() made it
    click.echo(
        f"kvcp-controlplane serving on {cp.address} (leader: {election.is_leader}, epoch {election.epoch})"
        + (f", metrics on http://{cp.metrics_address}/metrics" if cp.metrics_address else "")
        + (f", lookups on {cp.lookup_socket.address}" if cp.lookup_socket is not None else ""),
        err=True,
    )
    wait_for_stop_signal()
    cp.stop()


if __name__ == "__main__":
    main()
