"""kvctl commands that change the cluster: pin/unpin/pins, move, cleanup, compress,
ops/op/cancel, policy get/set. Thin calls on ControlPlaneClient, like the rest."""

from __future__ import annotations

import json
import re
import sys
import time

import click

from cli import output
from cli.client import ClientError, OperationView, PinList, PinView
from cli.main import (
    HASHES_HELP,
    Context,
    check_extra_keys_use,
    fail,
    main,
    parse_duration,
    parse_hashes,
    pass_ctx,
    read_tokens,
)
from protos.etcd_keys import POLICY_ENTRY_REMOVED
from protos.tier import Tier


def scope_options(fn):
    fn = click.option("--agent", "agent_id", default="", help="Only this agent.")(fn)
    fn = click.option("--namespace", default="", help="A namespace (alone: all its blocks).")(fn)
    fn = click.option("--extra-key", "extra_keys", multiple=True, help="Extra hash key, repeatable.")(fn)
    fn = click.option("--hashes", multiple=True, help=HASHES_HELP + ".")(fn)
    fn = click.option("--tokens-file", help="File of token ids.")(fn)
    fn = click.option("--tokens", help="Token ids, comma separated.")(fn)
    fn = click.option("--model", "model_id", default="", help="Model id (for a prefix).")(fn)
    return fn


NO_SCOPE = "give a prefix (--tokens, --tokens-file, --hashes) or --namespace"


def scope_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, namespace, agent_id, missing=NO_SCOPE) -> dict:
    """The scope options as the client takes them; `missing`: what to say when none is given."""
    token_ids = read_tokens(tokens, tokens_file)
    packed = parse_hashes(hashes) if hashes else b""
    if token_ids is not None and packed:
        fail("give tokens or --hashes, not both")
    check_extra_keys_use(extra_keys, packed)
    if (token_ids is not None or packed) and not model_id:
        fail("--model is needed with --tokens, --tokens-file or --hashes")
    if token_ids is None and not packed and not namespace:
        fail(missing)
    return dict(
        model_id=model_id,
        token_ids=token_ids,
        block_hashes=packed,
        extra_keys=tuple(extra_keys),
        namespace=namespace,
        agent_id=agent_id,
    )


def prefix_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, what: str) -> dict:
    """A prefix's options, for commands that take no namespace (`what` it is, when missing)."""
    missing = f"give {what}: --tokens, --tokens-file or --hashes"
    return scope_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, "", "", missing)


def _ttl(p: PinView, now: float) -> str:
    left = p.ttl_left_seconds(now)
    if left is None:
        return "owner lease"
    return f"{int(left) // 3600}h{int(left) % 3600 // 60:02d}m{int(left) % 60:02d}s"


def print_pins(ctx: Context, pins: PinList) -> None:
    if ctx.output == "json":
        click.echo(output.dumps(pins))  # a list, as before the flag: the flag goes to stderr
        if pins.possibly_stale:
            click.echo(f"kvctl: {output.STALE_NOTE}", err=True)
        return
    if not pins:
        click.echo("no pins" + (f" ({output.STALE_NOTE})" if pins.possibly_stale else ""))
        return
    now = time.time()
    rows = [
        [
            p.pin_id,
            p.namespace,
            "namespace" if p.whole_namespace else f"{p.num_blocks} blocks of {p.model_id}",
            p.min_tier,
            output.human_bytes(p.pinned_bytes),
            p.agent_id or "*",
            _ttl(p, now),
            p.owner or "-",
        ]
        for p in pins
    ]
    click.echo(output.table(["PIN", "NAMESPACE", "WHAT", "TIER>=", "BYTES", "AGENT", "TTL LEFT", "OWNER"], rows))
    if pins.possibly_stale:
        click.echo(output.STALE_NOTE)


def print_op(ctx: Context, op: OperationView) -> None:
    if ctx.output == "json":
        click.echo(output.dumps(op))
        return
    line = f"{op.kind} {op.op_id}: {op.state}"
    if op.num_total_blocks:
        line += f", {op.num_done_blocks}/{op.num_total_blocks} blocks"
    if op.num_failed_blocks:
        line += f", {op.num_failed_blocks} failed"
    if op.num_skipped_pinned_blocks:
        line += f", {op.num_skipped_pinned_blocks} pinned skipped"
    if op.moved_bytes:
        line += f", {output.human_bytes(op.moved_bytes)} moved"
    if op.result:
        line += f", {op.result}"
    if op.error:
        line += f" ({op.error})"
    click.echo(line)
    if op.freed:
        verb = "would free" if op.dry_run else "freed"
        for t in op.freed:
            click.echo(f"  {verb} {t.num_blocks} blocks, {output.human_bytes(t.used_bytes)} in {t.tier}")
    elif op.kind == "cleanup" and op.state == "SUCCEEDED":  # a failed or cancelled one did not look at all
        if op.num_skipped_pinned_blocks:
            click.echo(
                "  would free nothing: pins hold every block it matched"
                if op.dry_run
                else "  nothing freed: pins hold every block it matched"
            )
        else:
            click.echo("  nothing matched" if not op.dry_run else "  would free nothing")
    elif op.kind in ("move", "compress") and op.state == "SUCCEEDED" and not op.num_total_blocks:
        click.echo("  nothing matched (no agent holds a block of it)")


DEFAULT_WAIT_TIMEOUT = "300"
# `kvctl drain --wait`: it ended SUCCEEDED but left blocks behind (1: it failed, 2: bad input)
DRAIN_LEFT_BLOCKS_EXIT = 3


def wait_timeout_option(fn):
    """--wait-timeout, the same on every command with --wait."""
    return click.option(
        "--wait-timeout",
        default=DEFAULT_WAIT_TIMEOUT,
        show_default=True,
        help="With --wait: give up after this long (seconds, or 90s, 10m, 1h); exit 1 if still running.",
    )(fn)


def wait_timeout_seconds(text: str) -> float:
    seconds = parse_duration(text, "--wait-timeout")
    if seconds <= 0:
        fail(f"--wait-timeout: {text!r} must be positive")
    return seconds


def wait_and_print(
    ctx: Context,
    op: OperationView,
    wait: bool,
    wait_timeout: str = DEFAULT_WAIT_TIMEOUT,
    seconds_left: float | None = None,
) -> OperationView:
    """`seconds_left`: what is left of --wait-timeout (part of it went on the first answer).
    Exits 1 for an operation that ended other than SUCCEEDED; returns it otherwise."""
    timeout_seconds = wait_timeout_seconds(wait_timeout) if seconds_left is None else seconds_left
    if wait and not op.finished:
        tty = sys.stderr.isatty() and ctx.output != "json"

        def progress(o: OperationView):
            if tty:
                width = 30
                filled = int(o.progress * width)
                click.echo(
                    f"\r[{'#' * filled}{'.' * (width - filled)}] {o.progress:4.0%} {o.state:<9}", nl=False, err=True
                )

        started = op

        def wait_for(c):
            try:
                return c.wait_operation(started.op_id, timeout_seconds, on_progress=progress)
            except ClientError as exc:  # the operation goes on: say which one it is
                raise ClientError(
                    exc.code,
                    f"{exc} (while waiting for {started.kind} {started.op_id}, which goes on: "
                    f"`kvctl op {started.op_id} --wait` waits again)",
                ) from None

        op = ctx.call(wait_for)
        if tty:
            click.echo("", err=True)
    print_op(ctx, op)
    if wait and not op.finished:
        fail(
            f"--wait-timeout: {op.kind} {op.op_id} is still {op.state} after {wait_timeout_seconds(wait_timeout):g}s; "
            f"it goes on: `kvctl op {op.op_id} --wait` waits again, `kvctl cancel {op.op_id}` stops it",
            1,
        )
    if op.finished and op.state != "SUCCEEDED":
        sys.exit(1)
    return op


def parse_lease_id(text: str) -> int:
    """An etcd lease id in decimal, or in hex with 0x (etcdctl prints it in hex without)."""
    text = text.strip()
    try:
        value = int(text, 0)
    except ValueError:
        hint = f" (hex, as etcdctl prints it? write 0x{text})" if re.fullmatch(r"[0-9a-fA-F]+", text) else ""
        fail(f"--owner-lease: {text!r} is not a lease id: decimal, or hex with 0x{hint}")
    if not 0 < value < 1 << 63:
        fail(f"--owner-lease: {text} is out of range (a lease id is a positive 64-bit integer)")
    return value


@main.command()
@scope_options
@click.option("--tier", default="cpu", show_default=True, help="Keep at this tier or faster: gpu|cpu|disk.")
@click.option("--ttl", default="", help="How long the pin holds (90s, 30m, 2h, 1d).")
@click.option("--owner", default="", help="Who asked (shown in kvctl pins).")
@click.option(
    "--owner-lease",
    default="",
    help="etcd lease id, decimal or 0x-hex (etcdctl prints hex without 0x): the pin goes when this lease goes.",
)
@click.option(
    "--pin-id",
    default="",
    help="Choose the pin's id (letters, digits, . _ -): running the same pin again is then a no-op "
    "that prints the same pin, so a script may retry after a lost answer. Default: a fresh id.",
)
@pass_ctx
def pin(
    ctx: Context,
    model_id,
    tokens,
    tokens_file,
    hashes,
    extra_keys,
    namespace,
    agent_id,
    tier,
    ttl,
    owner,
    owner_lease,
    pin_id,
):
    """Pin a prefix or a namespace: never evicted, never demoted below --tier."""
    scope = scope_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, namespace, agent_id)
    owner_lease = parse_lease_id(owner_lease) if owner_lease else 0
    try:  # a bad tier is said first: it is wrong whatever the TTL
        Tier.parse(tier)
    except ValueError as exc:
        fail(f"--tier: {exc}")
    if not ttl and not owner_lease:
        fail("--ttl: a pin needs a TTL (or --owner-lease that bounds its life)")
    ttl_seconds = parse_duration(ttl, "--ttl") if ttl else 0.0
    if ttl and ttl_seconds <= 0:
        fail("--ttl: must be positive")
    p = ctx.call(
        lambda c: c.pin(
            min_tier=tier, ttl_seconds=ttl_seconds, owner=owner, owner_lease_id=owner_lease, pin_id=pin_id, **scope
        )
    )
    if ctx.output == "json":
        click.echo(output.dumps(p))
    else:
        click.echo(p.pin_id)


@main.command()
@click.argument("pin_id")
@pass_ctx
def unpin(ctx: Context, pin_id):
    """Remove a pin."""
    p = ctx.call(lambda c: c.unpin(pin_id), {"pin_id": "PIN_ID"})
    click.echo(output.dumps(p) if ctx.output == "json" else f"unpinned {p.pin_id}")


@main.command()
@click.option("--namespace", default="", help="Only this namespace.")
@pass_ctx
def pins(ctx: Context, namespace):
    """List pins with the time they have left."""
    print_pins(ctx, ctx.call(lambda c: c.list_pins(namespace)))


@main.command()
@scope_options
@click.option("--to", "to_tier", required=True, help="Destination tier: gpu|cpu|disk.")
@click.option("--codec", default="", help="Re-encode on the way: none|int8|int4|fp8|zstd.")
@click.option("--wait", is_flag=True, help="Wait until the move finishes.")
@wait_timeout_option
@pass_ctx
def move(
    ctx: Context,
    model_id,
    tokens,
    tokens_file,
    hashes,
    extra_keys,
    namespace,
    agent_id,
    to_tier,
    codec,
    wait,
    wait_timeout,
):
    """Move a prefix or a namespace to a tier, on every agent that holds it (or --agent)."""
    scope = scope_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, namespace, agent_id)
    wait_timeout_seconds(wait_timeout)  # bad input is told before anything starts
    wait_and_print(ctx, ctx.call(lambda c: c.move(to_tier, codec=codec.lower(), **scope)), wait, wait_timeout)


@main.command()
@click.option("--older-than", default="", help="Blocks not accessed for this long (2h, 30m); default: any age.")
@click.option("--namespace", default="")
@click.option("--agent", "agent_id", default="")
@click.option("--model", "model_id", default="")
@click.option("--dry-run", is_flag=True, help="Report what would be freed; change nothing.")
@click.option("--wait", is_flag=True)
@wait_timeout_option
@pass_ctx
def cleanup(ctx: Context, older_than, namespace, agent_id, model_id, dry_run, wait, wait_timeout):
    """Drop unpinned blocks idle for --older-than (leaves first); pinned ones are skipped and counted."""
    seconds = parse_duration(older_than, "--older-than") if older_than else 0.0
    wait_timeout_seconds(wait_timeout)
    op = ctx.call(lambda c: c.cleanup(seconds, namespace, agent_id, model_id, dry_run))
    wait_and_print(ctx, op, wait or dry_run, wait_timeout)


@main.command()
@scope_options
@click.option("--codec", required=True, help="int8|int4|fp8|zstd|none")
@click.option("--tier", default="", help="Only blocks in this tier.")
@click.option("--wait", is_flag=True)
@wait_timeout_option
@pass_ctx
def compress(
    ctx: Context,
    model_id,
    tokens,
    tokens_file,
    hashes,
    extra_keys,
    namespace,
    agent_id,
    codec,
    tier,
    wait,
    wait_timeout,
):
    """Re-encode blocks in place with a codec (transparent on load)."""
    scope = scope_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, namespace, agent_id)
    wait_timeout_seconds(wait_timeout)
    wait_and_print(ctx, ctx.call(lambda c: c.compress(codec.lower(), tier=tier, **scope)), wait, wait_timeout)


@main.command()
@click.option("--model", "model_id", required=True, help="Model id of the prefix.")
@click.option("--tokens", help="Token ids, comma separated.")
@click.option("--tokens-file", help="File of token ids.")
@click.option("--hashes", multiple=True, help=HASHES_HELP + ".")
@click.option("--extra-key", "extra_keys", multiple=True, help="Extra hash key, repeatable.")
@click.option("--from", "from_agent_id", required=True, help="Agent that holds the prefix (prefill).")
@click.option("--to", "to_agent_id", required=True, help="Agent that gets it (decode).")
@click.option("--deadline", default="", help="Answer within this (10s, 1m); default: the agent's.")
@click.option("--wait", is_flag=True, help="Wait until the transfer finishes.")
@wait_timeout_option
@pass_ctx
def transfer(
    ctx: Context,
    model_id,
    tokens,
    tokens_file,
    hashes,
    extra_keys,
    from_agent_id,
    to_agent_id,
    deadline,
    wait,
    wait_timeout,
):
    """Hand a prefix's KV from one agent to another (prefill -> decode handoff)."""
    scope = prefix_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, "the prefix")
    seconds = parse_duration(deadline, "--deadline") if deadline else 0.0
    wait_timeout_seconds(wait_timeout)
    op = ctx.call(
        lambda c: c.transfer(
            model_id,
            from_agent_id,
            to_agent_id,
            token_ids=scope["token_ids"],
            block_hashes=scope["block_hashes"],
            extra_keys=scope["extra_keys"],
            deadline_seconds=seconds,
        )
    )
    wait_and_print(ctx, op, wait, wait_timeout)


@main.command()
@click.option("--model", "model_id", required=True)
@click.option("--tokens", help="Token ids, comma separated.")
@click.option("--tokens-file", help="File of token ids.")
@click.option("--hashes", multiple=True, help=HASHES_HELP + ".")
@click.option("--extra-key", "extra_keys", multiple=True)
@click.option("--role", type=click.Choice(["pair", "prefill", "decode"]), default="pair", show_default=True)
@click.option("--prefill-agent", "prefill_agent_id", default="", help="decode: the agent that prefilled.")
@pass_ctx
def route(ctx: Context, model_id, tokens, tokens_file, hashes, extra_keys, role, prefill_agent_id):
    """Where a router would send a request: prefill agent, decode agent, and whether to split."""
    scope = prefix_kwargs(model_id, tokens, tokens_file, hashes, extra_keys, "the request")
    if prefill_agent_id and role != "decode":
        fail(f"--prefill-agent: only with --role decode (--role {role} chooses the prefill agent itself)")
    r = ctx.call(
        lambda c: c.route(
            model_id,
            token_ids=scope["token_ids"],
            block_hashes=scope["block_hashes"],
            extra_keys=scope["extra_keys"],
            role=role,
            prefill_agent_id=prefill_agent_id,
        )
    )
    if ctx.output == "json":
        click.echo(output.dumps(r))
    if not r.agent_id:  # the same exit status for scripts as for people
        fail(f"no agent to route to: {r.reason}")
    if ctx.output == "json":
        return
    if r.role == "pair":
        how = "split" if r.disaggregate else "not split"
        said = r.reason.startswith(f"{how}:")  # the reason may say it already: not twice
        where = f"prefill {r.prefill_agent_id}, decode {r.decode_agent_id or '-'}"
        click.echo(f"{where}: {r.reason}" if said else f"{where} ({how}): {r.reason}")
    else:
        click.echo(f"{r.role} {r.agent_id} ({r.address}): {r.reason}")
    if r.backpressure:
        click.echo("backpressure: decode agents are behind; queue the request or its handoff")
    if r.possibly_stale:
        click.echo(output.STALE_NOTE)
    rows = [
        [
            c.agent_id,
            f"{c.estimated_seconds * 1e3:.1f}ms",
            c.num_cached_blocks,
            output.human_bytes(c.free_bytes),
            f"{c.link_bytes_per_second / 1e9:.2f}" if c.link_bytes_per_second else "-",
            "behind" if c.behind else "",
            c.note,  # whole (the last column): cut at 60 characters, it lost digits of a byte count
        ]
        for c in r.candidates
    ]
    click.echo(output.table(["AGENT", "ESTIMATE", "CACHED", "FREE", "LINK GB/s", "STATE", "NOTE"], rows))


@main.command()
@click.option("--limit", default=20, show_default=True, type=click.IntRange(1, 1000))
@pass_ctx
def ops(ctx: Context, limit):
    """Recent operations, newest first; one still running is kept over newer ones that
    ended."""
    views = ctx.call(lambda c: c.list_operations(max_operations=limit))
    if ctx.output == "json":
        click.echo(output.dumps(views))
        return
    if not views:
        click.echo("no operations")
        return
    rows = [
        [
            o.op_id,
            o.kind,
            o.state,
            f"{o.progress:.0%}",
            f"{o.num_done_blocks}/{o.num_total_blocks}",
            o.num_failed_blocks,
            time.strftime("%H:%M:%S", time.localtime(o.created_unix_seconds)),
            o.error[:40],
        ]
        for o in views
    ]
    click.echo(output.table(["OP", "KIND", "STATE", "PROGRESS", "BLOCKS", "FAILED", "CREATED", "ERROR"], rows))


@main.command()
@click.argument("op_id")
@click.option("--wait", is_flag=True)
@wait_timeout_option
@pass_ctx
def op(ctx: Context, op_id, wait, wait_timeout):
    """One operation (with --wait: until it finishes)."""
    seconds = wait_timeout_seconds(wait_timeout)
    if not wait:
        print_op(ctx, ctx.call(lambda c: c.get_operation(op_id), {"op_id": "OP_ID"}))
        return
    # patient from the first poll (a failover may be under way), one --wait-timeout in all
    start = time.monotonic()
    first = ctx.call(lambda c: c.wait_operation(op_id, seconds, until_finished=False), {"op_id": "OP_ID"})
    wait_and_print(ctx, first, wait, wait_timeout, seconds_left=max(0.0, seconds - (time.monotonic() - start)))


@main.command()
@click.argument("op_id")
@pass_ctx
def cancel(ctx: Context, op_id):
    """Cancel a running operation."""
    op = ctx.call(lambda c: c.cancel_operation(op_id), {"op_id": "OP_ID"})
    print_op(ctx, op)
    if ctx.output != "json" and not op.finished:  # agents stop at their next batch
        click.echo(f"  cancel requested: `kvctl op {op.op_id} --wait` shows where it stopped")


@main.group()
def policy():
    """Tier policy and namespace quotas (stored in etcd, applied live)."""


@policy.command("get")
@pass_ctx
def policy_get(ctx: Context):
    """The effective policy: every tier-policy key with its value, and the namespace quotas."""
    values = ctx.call(lambda c: c.get_policy())
    if ctx.output == "json":
        click.echo(json.dumps(values, indent=2, sort_keys=True))
    else:
        click.echo(
            output.table(["KEY", "VALUE"], [[k, v] for k, v in sorted(values.items())]) if values else "(defaults)"
        )


@policy.command("set")
@click.argument("assignments", nargs=-1, required=True)
@pass_ctx
def policy_set(ctx: Context, assignments):
    """kvctl policy set key=value ...: any key `kvctl policy get` lists (validated, applied
    live), and `quota.<namespace>=<size>` (e.g. 2GiB; `none` lifts it)."""
    changes: dict[str, str] = {}
    for a in assignments:
        key, eq, value = a.partition("=")
        if not eq or not key.strip():
            fail(f"{a!r} is not key=value")
        key, value = key.strip(), value.strip()
        if changes.get(key, value) != value:  # the later one must not win unsaid
            fail(f"{key}: given twice ({changes[key]!r} and {value!r}); give it once")
        changes[key] = value
    values = ctx.call(lambda c: c.set_policy(changes))
    if ctx.output == "json":
        click.echo(json.dumps(values, indent=2, sort_keys=True))
    else:
        click.echo(output.table(["KEY", "VALUE"], [[k, v] for k, v in sorted(values.items())]))


@main.command()
@click.argument("agent_id")
@click.option("--reason", default="cordoned with kvctl", show_default=True, help="Why (shown by kvctl agents).")
@pass_ctx
def cordon(ctx: Context, agent_id, reason):
    """Take an agent out of rotation: Lookup and Route leave it out (routers send it no new
    requests, handoffs do not go to it) until `kvctl uncordon`. It keeps its blocks, and a
    transfer can still move them out. Durable in etcd (the policy key cordon.<agent_id>)."""
    if not agent_id or not agent_id.isprintable():
        fail(f"AGENT_ID: {agent_id!r} is not an agent id (kvctl agents lists them)")
    if reason.strip().lower() in POLICY_ENTRY_REMOVED:  # the values that uncordon
        fail(f"--reason: {reason!r} would uncordon the agent; say why it is cordoned")
    stored = ctx.call(
        lambda c: c.cordon(agent_id, reason),
        {f"values[cordon.{agent_id}]": "--reason", f"cordon.{agent_id}": "AGENT_ID"},  # (the policy key: internal)
    )
    if ctx.output == "json":
        click.echo(json.dumps({"agent_id": agent_id, "cordon_reason": stored}))
    else:
        click.echo(f"cordoned {agent_id} ({stored}): no new work goes to it; kvctl uncordon {agent_id} undoes it")


@main.command()
@click.argument("agent_id")
@click.option(
    "--to", "to_agent_ids", default="", help="Destinations, comma separated (default: every agent in rotation)."
)
@click.option("--model", "model_id", default="", help="Only this model's blocks (default: every model).")
@click.option("--reason", default="drained with kvctl", show_default=True, help="The cordon's reason.")
@click.option("--deadline", default="", help="Each handoff's answer time (10s, 1m); default: the agent's.")
@click.option(
    "--wait", is_flag=True, help="Wait until the drain finishes; exit 3 if it left blocks behind (no room for them)."
)
@wait_timeout_option
@pass_ctx
def drain(ctx: Context, agent_id, to_agent_ids, model_id, reason, deadline, wait, wait_timeout):
    """Before maintenance: cordon an agent (as `kvctl cordon`) and hand every prefix it holds
    to agents in rotation, most recently used first, into the room they have free (none of
    their own blocks is pushed out), so that taking it down costs no hits. Its blocks stay
    where they are too; `kvctl uncordon` puts it back in rotation."""
    if not agent_id or not agent_id.isprintable():
        fail(f"AGENT_ID: {agent_id!r} is not an agent id (kvctl agents lists them)")
    if reason.strip().lower() in POLICY_ENTRY_REMOVED:
        fail(f"--reason: {reason!r} would uncordon the agent; say why it is drained")
    targets = [t.strip() for t in to_agent_ids.split(",")] if to_agent_ids else []
    if any(not t for t in targets):
        fail(f"--to: {to_agent_ids!r} has an empty agent id")
    seconds = parse_duration(deadline, "--deadline") if deadline else 0.0
    wait_timeout_seconds(wait_timeout)
    op = ctx.call(
        lambda c: c.drain(agent_id, targets, model_id, seconds, reason),
        {"agent_id": "AGENT_ID", "to_agent_ids": "--to", "model_id": "--model", "reason": "--reason"},
    )
    op = wait_and_print(ctx, op, wait, wait_timeout)
    if wait and op.finished and op.num_failed_blocks:  # SUCCEEDED, yet not empty: taking it down loses those
        fail(
            f"drain {op.op_id} left {op.num_failed_blocks} of {op.num_total_blocks} blocks on {agent_id} "
            f"(why: `kvctl op {op.op_id}`); taking it down now loses their hits",
            DRAIN_LEFT_BLOCKS_EXIT,
        )


@main.command()
@click.argument("agent_id")
@pass_ctx
def uncordon(ctx: Context, agent_id):
    """Put a cordoned agent back in rotation."""
    was = ctx.call(lambda c: c.uncordon(agent_id))
    if not was and agent_id not in {a.agent_id for a in ctx.call(lambda c: c.list_agents())}:
        # a typo must not read as done while the agent meant stays out of rotation
        fail(f"AGENT_ID: no agent {agent_id!r} is registered, and none of that name is cordoned", 1)
    # a drain of it still running goes on handing its prefixes away: said, with how to stop it
    # (a listing that fails does not hide the uncordon, which took: said on stderr, exit 0)
    draining: list[str] | None = None  # (-o json: null when not known)
    try:
        with ctx.client() as c:
            listed = c.list_operations(1000)
    except (ClientError, ValueError) as exc:
        click.echo(
            f"kvctl: the uncordon took; a drain of {agent_id} still running could not be looked for: {exc}", err=True
        )
    else:
        draining = [
            o.op_id for o in listed if o.kind == "drain" and not o.finished and o.params.get("agent") == agent_id
        ]
    if ctx.output == "json":
        click.echo(json.dumps({"agent_id": agent_id, "was_cordoned": was, "running_drains": draining}))
    else:
        click.echo(f"uncordoned {agent_id}" if was else f"{agent_id} was not cordoned")
        for op_id in draining or []:
            click.echo(f"drain {op_id} of {agent_id} is still running: kvctl cancel {op_id} stops it")
