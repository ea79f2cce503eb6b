"""`kvctl`: operate a kvcp cluster from the shell. Every command is a thin call on
ControlPlaneClient; `-o json` prints the stable shape scripts rely on."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import ssl
import string
import sys
from pathlib import Path
from typing import NoReturn

import click

from cli import output
from cli.client import DEFAULT_ENDPOINT, ClientError, ControlPlaneClient
from cli.tokens import parse_token_ids
from protos.block_hash import BLOCK_HASH_BYTES
from protos.lookup_wire import split_address
from protos.security import TLSConfig, read_secret


def fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"kvctl: {message}", err=True)
    sys.exit(code)


class Context:
    def __init__(
        self,
        endpoint: str,
        output_format: str,
        timeout_seconds: float,
        token: str = "",
        tls=None,
        lookup_endpoint: str = "",
    ):
        self.endpoint = endpoint
        self.output = output_format
        self.timeout_seconds = timeout_seconds
        self.token = token
        self.tls = tls
        self.lookup_endpoint = lookup_endpoint

    def client(self) -> ControlPlaneClient:
        return ControlPlaneClient(self.endpoint, self.timeout_seconds, self.token, self.tls, self.lookup_endpoint)

    def call(self, fn, flags: dict[str, str] | None = None):
        """`fn(client)`; an error is one line naming the flag (`flags`: this command's own
        names for request fields, e.g. its PIN_ID argument) and exit 1."""
        try:
            client = self.client()
        except ValueError as exc:  # a TLS file that went away since main() checked it
            fail(str(exc))
        try:
            with client as c:
                return fn(c)
        except ClientError as exc:
            fail(flag_named(str(exc), flags), 1)


# the request fields a server's error may start with, and the kvctl flag that sets each
MAX_TIMEOUT_SECONDS = 86400.0

FLAG_OF_FIELD = {
    "to_tier": "--to",
    "to_agent_id": "--to",
    "from_agent_id": "--from",
    "min_tier": "--tier",
    "tier": "--tier",
    "ttl_seconds": "--ttl",
    "older_than_seconds": "--older-than",
    "owner_lease_id": "--owner-lease",
    "owner": "--owner",
    "codec": "--codec",
    "model_id": "--model",
    "scope.model_id": "--model",
    "scope.namespace": "--namespace",
    "scope.agent_id": "--agent",
    "scope.token_ids": "--tokens/--tokens-file",
    "scope.block_hashes": "--hashes",
    "scope.extra_keys": "--extra-key",
    "extra_keys": "--extra-key",
    "token_ids": "--tokens/--tokens-file",
    "namespace": "--namespace",
    "agent_id": "--agent",
    "pin_id": "--pin-id",
    "prefill_agent_id": "--prefill-agent",
    "deadline_seconds": "--deadline",
}


def flag_named(message: str, flags: dict[str, str] | None = None) -> str:
    """A server error about a request field, said with the flag that set it:
    `to_tier: unknown tier 'tape'` -> `--to (to_tier): unknown tier 'tape'`."""
    field, sep, rest = message.partition(": ")
    if sep and field.startswith("values[") and field.endswith("]"):  # `policy set KEY=VALUE`'s KEY
        flag = (flags or {}).get(field)  # a command that sets the key itself (cordon's --reason)
        return f"{flag} ({field[7:-1]}): {rest}" if flag else f"{field[7:-1]}: {rest}"
    flag = ((flags or {}).get(field) or FLAG_OF_FIELD.get(field)) if sep else None
    return f"{flag} ({field}): {rest}" if flag else message


pass_ctx = click.make_pass_decorator(Context)


# options of kvctl itself (before the command), named when given after one
GLOBAL_OPTIONS = (
    "-o",
    "--output",
    "--endpoint",
    "--timeout",
    "--token-file",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--lookup-endpoint",
)


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.NoSuchOption as exc:
            # `kvctl pins -o json`: a global option after the command is no option there
            if exc.option_name in GLOBAL_OPTIONS:
                # click's stubs make `message` Final, but it is a plain attribute that
                # format_message reads when the error is shown: this is how the hint gets there
                exc.message = (  # type: ignore[misc]
                    f"{exc.option_name} is an option of kvctl itself: put it before the command "
                    f"(kvctl {exc.option_name} ... {ctx.invoked_subcommand or 'COMMAND'} ...)"
                )
            raise

    def main(self, *args, **kwargs):
        """Output that cannot be written (a full disk, a closed terminal) is one line on
        stderr and exit 1, not a traceback (a closed pipe stays click's quiet exit)."""
        try:
            return super().main(*args, **kwargs)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise
            fail(f"cannot write the output: {exc.strerror or exc}", 1)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)(ms|s|m|h|d)?$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(text: str, option: str) -> float:
    """'30m' -> 1800.0; a sentence naming the option when it does not parse."""
    m = _DURATION.match(text.strip().lower())
    if not m:
        fail(f"{option}: {text!r} is not a duration (examples: 5, 500ms, 90s, 30m, 2h, 1d; a bare number is seconds)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--endpoint",
    envvar="KVCTL_ENDPOINT",
    default=DEFAULT_ENDPOINT,
    show_default=True,
    help="Control-plane address, or every replica's, comma separated: a replica that cannot be "
    "reached is skipped (env KVCTL_ENDPOINT).",
)
@click.option(
    "-o",
    "--output",
    "output_format",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Tables for people, JSON for scripts.",
)
@click.option("--timeout", "timeout", default="5s", show_default=True, help="Time per call: 5, 5s, 500ms, 2m.")
@click.option("--token-file", default="", help="Bearer token for the admin API (else env KVCTL_TOKEN).")
@click.option("--tls-ca", default="", envvar="KVCTL_TLS_CA", help="CA of the control plane's certificate: use TLS.")
@click.option("--tls-cert", default="", help="Client certificate (mTLS).")
@click.option("--tls-key", default="", help="Client key (mTLS).")
@click.option(
    "--lookup-endpoint",
    default="",
    envvar="KVCTL_LOOKUP_ENDPOINT",
    help="The leader's lookup socket (HOST:PORT or unix:PATH, kvcp-controlplane --lookup-listen): "
    "`kvctl lookup` goes there instead of gRPC (env KVCTL_LOOKUP_ENDPOINT).",
)
@click.pass_context
def main(ctx, endpoint, output_format, timeout, token_file, tls_ca, tls_cert, tls_key, lookup_endpoint):
    """kvctl: inspect and operate a kvcp KV cache cluster."""
    timeout_seconds = parse_duration(timeout, "--timeout")
    if not (math.isfinite(timeout_seconds) and timeout_seconds > 0):
        fail(f"--timeout: {timeout_seconds:g} is not a positive number of seconds (e.g. --timeout 5)")
    if timeout_seconds > MAX_TIMEOUT_SECONDS:  # gRPC's deadline overflows far beyond this
        fail(f"--timeout: {timeout_seconds:g} s is longer than {MAX_TIMEOUT_SECONDS:.0f} s (one day)")
    from_env = ctx.get_parameter_source("endpoint") != click.core.ParameterSource.COMMANDLINE
    if from_env and os.environ.get("KVCTL_ENDPOINT") == "":  # click reads an empty variable as unset
        fail("KVCTL_ENDPOINT: set but empty (give HOST:PORT, or unset it for the default 127.0.0.1:50051)")
    check_endpoint(endpoint, from_env and "KVCTL_ENDPOINT" in os.environ)
    try:
        token = read_secret(token_file, "KVCTL_TOKEN")
    except ValueError as exc:
        fail(f"--token-file: {exc}")
    if lookup_endpoint:
        try:
            split_address(lookup_endpoint)
        except ValueError as exc:
            fail(f"--lookup-endpoint: {exc}")
    tls = tls_config(tls_ca, tls_cert, tls_key)
    ctx.obj = Context(endpoint, output_format, timeout_seconds, token, tls, lookup_endpoint)


def check_endpoint(endpoint: str, from_env: bool = False) -> None:
    """Each control-plane address HOST:PORT (a port 1-65535; [v6]:PORT), or gRPC's unix:PATH;
    an empty one (an unset shell variable) must not mean the default."""
    where = "KVCTL_ENDPOINT" if from_env else "--endpoint"
    if not [e for e in endpoint.split(",") if e.strip()]:
        fail(f"{where}: empty (give HOST:PORT, or leave it out for the default 127.0.0.1:50051)")
    for e in (e.strip() for e in endpoint.split(",") if e.strip()):
        if e.startswith("unix:"):
            continue
        host, sep, port = e.rpartition(":")
        if "/" in e or not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            fail(f"{where}: {e!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")


def tls_config(ca_file: str, cert_file: str, key_file: str) -> TLSConfig | None:
    """The TLS files, checked now: a file that cannot be read or is not PEM gets one line
    naming its option here, not a traceback when the first channel (or the dashboard) opens."""
    if not ca_file:
        if cert_file or key_file:  # mTLS asked for, plain text would be used: say so
            fail("--tls-cert/--tls-key need --tls-ca (the CA of the control plane's certificate) to use TLS")
        return None
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        fail(f"--tls-ca: cannot use {ca_file} as a CA certificate (PEM): {_reason(exc)}")
    if cert_file or key_file:
        if not (cert_file and key_file):
            fail("--tls-cert and --tls-key go together (mTLS): give both or neither")
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            fail(f"--tls-cert/--tls-key: cannot load {cert_file} with key {key_file}: {_reason(exc)}")
    return TLSConfig(cert_file, key_file, ca_file)


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)


@main.command()
@pass_ctx
def agents(ctx: Context):
    """List agents with their tiers and blocks."""
    views = ctx.call(lambda c: c.list_agents())
    if ctx.output == "json":
        click.echo(output.dumps(views))
        return
    if not views:
        click.echo("no agents registered")
        return
    rows = []
    for a in views:
        tiers = " ".join(f"{t.tier}:{output.tier_cell(t)}" for t in a.tiers)
        state = f"{a.state},cordoned" if a.cordon_reason else a.state
        rows.append([a.agent_id, a.address, state, a.num_blocks, f"{a.hit_ratio:.1%}", tiers])
    click.echo(output.table(["AGENT", "ADDRESS", "STATE", "BLOCKS", "HIT", "TIERS (used/capacity)"], rows))
    for a in views:
        if a.cordon_reason:
            click.echo(f"{a.agent_id}: cordoned ({a.cordon_reason}): no new work goes to it (kvctl uncordon)")
    for a in views:  # an engine that did not start: handoffs go the slower ways, said once here
        if not a.transfer_engine and a.transfer_engine_status:
            click.echo(
                f"{a.agent_id}: no transfer engine ({a.transfer_engine_status}); "
                f"its handoffs go by {' then '.join(a.handoff_paths)}"
            )


def _cordoned_agents(ctx: Context) -> list[str]:
    """The agents out of rotation, for a lookup that found nothing ([] if it cannot tell)."""
    try:
        with ctx.client() as c:
            return [a.agent_id for a in c.list_agents() if a.cordon_reason]
    except (ClientError, ValueError):
        return []


def parse_tokens(text: str, source: str) -> list[int]:
    try:
        return parse_token_ids(text)
    except ValueError as exc:
        fail(f"{source}: {exc}")


def read_tokens(tokens: str | None, tokens_file: str | None) -> list[int] | None:
    if tokens is not None and tokens_file is not None:
        fail("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        path = Path(tokens_file)
        if not path.exists():
            fail(f"--tokens-file: {tokens_file} does not exist")
        if path.is_dir():
            fail(f"--tokens-file: {tokens_file} is a directory")
        if not (path.is_file() or path.is_fifo()):  # a pipe: `--tokens-file <(make_prompt)`
            fail(f"--tokens-file: {tokens_file} is not a file or a pipe")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            fail(f"--tokens-file: {tokens_file} is not UTF-8 text (token ids as digits, e.g. 1,2,3)")
        except OSError as exc:
            fail(f"--tokens-file: cannot read {tokens_file}: {exc.strerror}")
        return parse_tokens(text, f"--tokens-file {tokens_file}")
    if tokens is not None:
        return parse_tokens(tokens, "--tokens")
    return None


HASHES_HELP = "Block hashes as hex, 32 digits each (comma separated, repeated, or packed together)"


def parse_hashes(hashes: tuple[str, ...]) -> bytes:
    out = bytearray()
    for h in hashes:
        if "," in h and any(not field.strip() for field in h.split(",")):
            fail('--hashes: no empty field ("A,,B" is a slip: a hash lost in a paste names another chain)')
        for part in h.replace(",", " ").split():
            if any(c not in string.hexdigits for c in part):
                fail(f"--hashes: {part[:40]!r} is not hexadecimal")
            if len(part) % (2 * BLOCK_HASH_BYTES):  # one hash, or several packed together
                fail(
                    f"--hashes: {part[:40]!r} is {len(part)} hex digits; block hashes are {BLOCK_HASH_BYTES} bytes "
                    f"({2 * BLOCK_HASH_BYTES} hex digits) each"
                )
            raw = bytes.fromhex(part)
            out += raw
    if hashes and not out:
        fail("--hashes: no hash given (an empty value)")
    return bytes(out)


def check_extra_keys_use(extra_keys, packed: bytes) -> None:
    """--extra-key goes into the hash of each block of tokens: block hashes given as they
    are leave it nothing to change, and a key silently ignored would find another prefix."""
    if extra_keys and packed:
        fail("--extra-key: it is hashed with the tokens; with --hashes, give hashes computed with it instead")


@main.command()
@click.option("--model", "model_id", required=True, help="Model id.")
@click.option("--tokens", help="Token ids, comma separated: 1,2,3")
@click.option("--tokens-file", help="File of token ids (commas, spaces or a JSON list).")
@click.option("--hashes", multiple=True, help=HASHES_HELP + ", instead of tokens.")
@click.option("--extra-key", "extra_keys", multiple=True, help="Extra hash key (e.g. a LoRA id), repeatable.")
@pass_ctx
def lookup(ctx: Context, model_id, tokens, tokens_file, hashes, extra_keys):
    """Which agent holds the longest cached prefix of a prompt, and in which tiers."""
    token_ids = read_tokens(tokens, tokens_file)
    packed = parse_hashes(hashes) if hashes else b""
    if token_ids is None and not packed:
        fail("give the prompt as --tokens, --tokens-file or --hashes")
    if token_ids is not None and packed:
        fail("give tokens or --hashes, not both")
    check_extra_keys_use(extra_keys, packed)
    view = ctx.call(lambda c: c.lookup(model_id, token_ids=token_ids, block_hashes=packed, extra_keys=extra_keys))
    if ctx.output == "json":
        click.echo(output.dumps(view))
        return
    best = view.best_agent_id
    if not best:
        cordoned = _cordoned_agents(ctx)  # they may hold it: lookups leave them out
        best = (
            f"(none in rotation; cordoned, not looked at: {', '.join(cordoned)})"
            if cordoned
            else "(none: nothing cached)"
        )
    click.echo(
        f"model {view.model_id}: {view.num_tokens} tokens, {view.num_blocks} full block{'' if view.num_blocks == 1 else 's'}; "
        f"best agent: {best}"
    )
    if view.agents:
        rows = [[m.agent_id, m.num_hit_blocks, m.num_hit_tokens, output.tier_runs(m.tiers)] for m in view.agents]
        click.echo(output.table(["AGENT", "HIT_BLOCKS", "HIT_TOKENS", "TIERS"], rows))
    if view.possibly_stale:
        click.echo(output.STALE_NOTE)


@main.command()
@pass_ctx
def stats(ctx: Context):
    """Cluster totals: agents, blocks, lookups, hit ratio, tiers."""
    s = ctx.call(lambda c: c.stats())
    if ctx.output == "json":
        data = output.to_jsonable(s)
        data["hit_ratio"] = s.hit_ratio
        click.echo(json.dumps(data, indent=2))
        return
    rows = [
        [
            "leader",
            f"{s.leader_address} (epoch {s.epoch})"
            + ("" if s.is_leader else ", answering from memory: etcd unreachable, possibly stale"),
        ],
        *([["lookup socket", s.lookup_address]] if s.lookup_address else []),
        ["agents", s.num_agents],
        ["blocks (distinct)", s.num_blocks],
        ["block replicas", s.num_block_replicas],
        ["lookups", s.lookups_total],
        ["lookup tokens", s.lookup_tokens_total],
        ["hit tokens", f"{s.lookup_hit_tokens_total} ({s.hit_ratio:.1%})"],
        ["block events", s.events_total],
        ["resyncs", s.resyncs_total],
        ["policy passes", s.policy_passes_total],
        [
            "policy order",
            f"{'most recent first (loops larger than the cache)' if s.policy_recent_first else 'least recent first'},"
            f" reuse credit {s.policy_reuse_credit_turnovers:g} turnovers",
        ],
    ]
    for t in s.tiers:
        blocks = f"{t.num_blocks} blocks" + (
            f" (+{output.parked_text(t.num_parked_blocks)})" if t.num_parked_blocks else ""
        )
        rows.append([f"tier {t.tier}", f"{output.usage_cell(t.used_bytes, t.capacity_bytes)}, {blocks}"])
    for m in s.models:
        rows.append(["model", f"{m['model_id']} (block_size {m['block_size']})"])
    click.echo(output.table(["FIELD", "VALUE"], rows))


@main.command()
@click.option("--endpoint", "endpoint", default=None, help="Control-plane address (overrides kvctl --endpoint).")
@pass_ctx
def dashboard(ctx: Context, endpoint):
    """Open the terminal dashboard: cluster, agents, pins, operations, live events."""
    from dashboard.app import DashboardApp  # Textual loads only for this command

    if endpoint is not None:  # given, even empty: checked as kvctl's own --endpoint is
        check_endpoint(endpoint)
        ctx.endpoint = endpoint
    DashboardApp(ctx.endpoint, ctx.timeout_seconds, connect=ctx.client).run()


from cli import operate  # noqa: E402,F401 - registers pin/unpin/pins/move/cleanup/compress/ops/op/cancel/policy

if __name__ == "__main__":
    main()
