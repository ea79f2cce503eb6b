"""What must survive a control-plane restart, in etcd: pins, operations, policy.

Every write the leader makes is a transaction guarded by the leader key: it applies
only while the leader key still has the create revision (the epoch) this replica won,
so a deposed leader that wakes up (SIGSTOP/SIGCONT, a long GC pause) can write nothing.
etcd being unreachable becomes `Unavailable` with a sentence saying so.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from collections.abc import Callable

from controlplane.core.cluster import AgentCommand
from controlplane.core.operations import AgentPart, Operation
from controlplane.core.pins import Pin
from protos import errors, etcd_keys
from protos.tier import Tier

log = logging.getLogger(__name__)


def pin_key(pin: Pin) -> str:
    return f"{etcd_keys.PINS_PREFIX}{pin.namespace}/{pin.pin_id}"


# prefix pins' digests as hex, which every release reads, up to this many bytes of hex;
# longer ones as base64 (a 65,536-block pin is 2 MiB in hex, over etcd's 1.5 MiB request
# limit; 1.4 MB in base64), which releases before 2026-12-06 cannot read
HEX_PIN_LIMIT_BYTES = 1 << 20


def pin_to_json(p: Pin) -> str:
    digests = (
        {"block_hashes": p.block_hashes.hex()}
        if 2 * len(p.block_hashes) <= HEX_PIN_LIMIT_BYTES
        else {"block_hashes_b64": base64.b64encode(p.block_hashes).decode()}
    )
    return json.dumps(
        {
            "pin_id": p.pin_id,
            "namespace": p.namespace,
            "model_id": p.model_id,
            **digests,
            "min_tier": p.min_tier.label,
            "created_unix_seconds": p.created_unix_seconds,
            "expires_unix_seconds": p.expires_unix_seconds,
            "owner": p.owner,
            "owner_lease_id": p.owner_lease_id,
            "agent_id": p.agent_id,
            "pinned_bytes": p.pinned_bytes,
        }
    )


def pin_from_json(raw: bytes) -> Pin:
    d = json.loads(raw)
    return Pin(
        pin_id=d["pin_id"],
        namespace=d["namespace"],
        model_id=d["model_id"],
        block_hashes=base64.b64decode(d["block_hashes_b64"], validate=True)
        if "block_hashes_b64" in d
        else bytes.fromhex(d["block_hashes"]),
        min_tier=Tier.parse(d["min_tier"]),
        created_unix_seconds=d["created_unix_seconds"],
        expires_unix_seconds=d["expires_unix_seconds"],
        owner=d.get("owner", ""),
        owner_lease_id=d.get("owner_lease_id", 0),
        agent_id=d.get("agent_id", ""),
        pinned_bytes=d.get("pinned_bytes", 0),
    )


# a part's block counts were stored under these keys before 2026-12-06: read where the new
# names are missing, and written beside them, so a replica of an earlier release reads the
# record during a rolling upgrade (it skips a record without them as malformed); the
# release after next may stop writing them
_OLD_PART_COUNT_KEYS = {
    "num_done_blocks": "done",
    "num_total_blocks": "total",
    "num_failed_blocks": "failed",
    "num_skipped_pinned_blocks": "skipped_pinned",
}


def _part_count(p: dict, key: str) -> int:
    """A part's count stored under `key`, or under its name before the rename (KeyError
    when under neither: the record is malformed)."""
    return p[key] if key in p else p[_OLD_PART_COUNT_KEYS[key]]


def op_to_json(op: Operation) -> str:
    return json.dumps(
        {
            "op_id": op.op_id,
            "kind": op.kind,
            "params": op.params,
            "state": op.state,
            "error": op.error,
            "dry_run": op.dry_run,
            "waiting_for_lock": op.waiting_for_lock,
            "commands_sent": op.commands_sent,
            "cancel_requested": op.cancel_requested,
            "created_unix_seconds": op.created_unix_seconds,
            "updated_unix_seconds": op.updated_unix_seconds,
            "parts": [
                {
                    "agent_id": p.agent_id,
                    "state": p.state,
                    "num_done_blocks": p.num_done_blocks,
                    "num_total_blocks": p.num_total_blocks,
                    "num_failed_blocks": p.num_failed_blocks,
                    "num_skipped_pinned_blocks": p.num_skipped_pinned_blocks,
                    # the same counts under their earlier names, which a replica of an
                    # earlier release (a rolling upgrade) reads: it skips a record without them
                    **{old: getattr(p, new) for new, old in _OLD_PART_COUNT_KEYS.items()},
                    "moved_bytes": p.moved_bytes,
                    "error": p.error,
                    "freed": {str(t): list(v) for t, v in p.freed.items()},
                    "given_up": p.given_up,
                    "incarnation": p.incarnation,
                    "result": p.result,
                }
                for p in op.parts.values()
            ],
        }
    )


def op_from_json(raw: bytes) -> Operation:
    d = json.loads(raw)
    op = Operation(
        d["op_id"],
        d["kind"],
        d["params"],
        d["state"],
        d["error"],
        d["dry_run"],
        created_unix_seconds=d["created_unix_seconds"],
        updated_unix_seconds=d["updated_unix_seconds"],
        waiting_for_lock=d.get("waiting_for_lock", False),
        # stored before the flag: an operation past its lock had its commands sent
        commands_sent=d.get("commands_sent", not d.get("waiting_for_lock", False)),
        cancel_requested=d.get("cancel_requested", False),
    )
    for p in d["parts"]:
        op.parts[p["agent_id"]] = AgentPart(
            p["agent_id"],
            p["state"],
            _part_count(p, "num_done_blocks"),
            _part_count(p, "num_total_blocks"),
            _part_count(p, "num_failed_blocks"),
            _part_count(p, "num_skipped_pinned_blocks"),
            p["moved_bytes"],
            p["error"],
            {int(t): (v[0], v[1]) for t, v in p["freed"].items()},
            d["updated_unix_seconds"],
            p.get("given_up", False),
            p.get("incarnation", ""),
            p.get("result", ""),
        )
    return op


# the most one agent's stored command takes (etcd refuses requests over 1.5 MiB by
# default): the largest scope, MAX_PROMPT_BLOCKS hashes, takes 1.40 MB in base64. Commands
# are written in transactions of at most this many bytes and MAX_TXN_OPS keys (etcd's
# --max-txn-ops default)
MAX_OP_COMMAND_BYTES = (3 << 19) - (64 << 10)
MAX_TXN_OPS = 128


def op_commands_to_json(commands: dict[str, AgentCommand]) -> str:
    """The commands one operation sent, by agent: what a next leader sends again to an
    agent whose command was lost with this leader's stream."""
    out = {}
    for agent_id, cmd in commands.items():
        d = dataclasses.asdict(cmd)
        d["block_hashes"] = base64.b64encode(cmd.block_hashes).decode()
        out[agent_id] = d
    return json.dumps(out)


def op_commands_from_json(raw: bytes) -> dict[str, AgentCommand]:
    """Commands stored by op_commands_to_json; fields a later release added are left out."""
    known = {f.name for f in dataclasses.fields(AgentCommand)}
    out = {}
    for agent_id, d in json.loads(raw).items():
        fields = {k: v for k, v in d.items() if k in known}
        fields["block_hashes"] = base64.b64decode(fields.get("block_hashes", ""))
        for name in ("peer_agent_ids", "peer_free_bytes", "peer_fill_limit_bytes"):
            fields[name] = tuple(fields.get(name, ()))
        out[agent_id] = AgentCommand(**fields)
    return out


# how gRPC says a call never left (no connection was made): a refusal, nothing applied
_NEVER_SENT = ("failed to connect", "connection refused", "no route to host", "dns resolution", "name resolution")


class LeaseNotFound(Exception):
    """etcd refused a write tied to a lease it does not have (expired or revoked)."""


def _lease_not_found(exc: Exception) -> bool:
    details = getattr(exc, "details", None)
    return "lease not found" in f"{details() if callable(details) else ''} {exc}"


def _timed_out(exc: Exception) -> bool:
    """A call that may have reached etcd and got no answer (maybe applied): a timeout, or
    a connection that broke mid-call ("Socket closed", a reset: etcd killed while the
    write was on its way), not one that never connected."""
    from pyetcd import exceptions as ex

    if isinstance(exc, ex.ConnectionTimeoutError):
        return True
    if isinstance(exc, ex.ConnectionFailedError):
        cause = exc.__context__  # the gRPC error pyetcd translated
        details = cause.details() if callable(getattr(cause, "details", None)) else ""
        return bool(details) and not any(s in details.lower() for s in _NEVER_SENT)
    return False


class DurableStore:
    def __init__(self, client, election, endpoint: str = ""):
        self._client = client
        self._election = election
        self.endpoint = endpoint
        self.errors_total = 0

    def _unavailable(self, exc: Exception) -> errors.Unavailable:
        self.errors_total += 1
        # pyetcd refuses calls for a second after a failed one with a bare ValueError
        why = "connection failed" if isinstance(exc, ValueError) else type(exc).__name__
        return errors.EtcdUnreachable(
            f"etcd is unreachable{(' at ' + self.endpoint) if self.endpoint else ''} ({why}); "
            "durable changes (pin, unpin, policy, operations) are rejected until it returns"
        )

    def _fenced(self, ops, compare=(), failure=()) -> tuple[bool, list]:
        """Run `ops` if this replica still leads and `compare` holds (else `failure`):
        (True, []) when they ran, (False, responses of `failure`) when a `compare` did
        not hold. NotLeader when the leadership compare failed."""
        c = self._client
        if getattr(self._election, "serving_from_memory", False):
            raise errors.EtcdUnreachable(
                f"etcd is unreachable{(' at ' + self.endpoint) if self.endpoint else ''}; durable changes (pin, unpin, "
                "policy, operations) are rejected until it returns; lookups are still answered from memory"
            )
        if not self._election.is_leader:
            raise errors.not_leader(self._election.leader_address)
        leader = c.transactions.create(etcd_keys.LEADER_KEY) == self._election.epoch
        try:
            ok, responses = c.transaction(
                compare=[leader, *compare],
                success=ops,
                failure=[c.transactions.get(etcd_keys.LEADER_KEY), *failure] if compare else [],
            )
        except Exception as exc:  # noqa: BLE001 - any other etcd failure is "unavailable"
            if _lease_not_found(exc):  # an owner's lease that ended since it was checked: etcd is fine
                raise LeaseNotFound() from None
            refusal = etcd_keys.refusal_reason(exc)
            if refusal == etcd_keys.NOSPACE_ADVICE:  # answered: nothing applied; deletes (unpin) still go
                self.errors_total += 1
                log.error("etcd refused a write: %s", refusal)
                raise errors.ResourceExhausted(f"{refusal}; unpin still works") from None
            if refusal:
                self.errors_total += 1
                raise errors.InvalidArgument("request", f"etcd refused to store it: {refusal}") from None
            if _timed_out(exc):
                # the transaction may be on the wire: etcd can still apply it when it answers
                # again, so this is no refusal (a caller told "rejected" would hold a ghost)
                self.errors_total += 1
                raise errors.OutcomeUnknown(
                    f"etcd did not answer in time{(' at ' + self.endpoint) if self.endpoint else ''}; "
                    "the change may or may not have been applied: list (kvctl pins, kvctl ops, kvctl policy get) "
                    "before trying again"
                ) from None
            raise self._unavailable(exc) from None
        if not ok:
            held = responses[0] if compare else []
            if not held or held[0][1].create_revision != self._election.epoch:
                raise errors.not_leader(self._election.leader_address)
            return False, responses[1:]
        return True, []

    def put(self, key: str, value: str, lease_id: int = 0, replacing: str = "") -> None:
        """Write `key`; `replacing`: another key deleted in the same transaction (a pin id
        made again in another namespace leaves no copy under the old one)."""
        c = self._client
        gone = [c.transactions.delete(replacing)] if replacing and replacing != key else []
        self._fenced([*gone, c.transactions.put(key, value, lease_id or None)])

    def create(self, key: str, value: str, lease_id: int = 0) -> bytes | None:
        """Put `key` only if it does not exist: None when written, else the value etcd
        holds (in one transaction, so a write whose answer was lost is found, not doubled)."""
        c = self._client
        ok, responses = self._fenced(
            [c.transactions.put(key, value, lease_id or None)],
            compare=[c.transactions.version(key) == 0],
            failure=[c.transactions.get(key)],
        )
        if ok:
            return None
        held = responses[0]
        return held[0][0] if held else b""

    def replace(self, key: str, value: str, mod_revision: int) -> bool:
        """Put `key` only if it is still at `mod_revision` (0: absent): False when someone
        wrote it since (read it again and merge), so a read-modify-write loses no edit."""
        c = self._client
        held = c.transactions.version(key) == 0 if mod_revision == 0 else c.transactions.mod(key) == mod_revision
        ok, _ = self._fenced([c.transactions.put(key, value)], compare=[held], failure=[c.transactions.get(key)])
        return ok

    def delete(self, key: str) -> None:
        self._fenced([self._client.transactions.delete(key)])

    def put_all(self, items: list[tuple[str, str]]) -> None:
        """Write every (key, value), as few transactions as etcd's request limits allow
        (MAX_OP_COMMAND_BYTES and MAX_TXN_OPS each); one that fails raises, and leaves
        the transactions before it written."""
        c = self._client
        batch: list = []
        size = 0
        for key, value in items:
            n = len(key) + len(value)
            if batch and (size + n > MAX_OP_COMMAND_BYTES or len(batch) >= MAX_TXN_OPS):
                self._fenced(batch)
                batch, size = [], 0
            batch.append(c.transactions.put(key, value))
            size += n
        if batch:
            self._fenced(batch)

    def delete_tree(self, key: str) -> None:
        """Delete `key` and every key under `key/`, in one transaction."""
        c = self._client
        self._fenced(
            [c.transactions.delete(key), c.transactions.delete(key + "/", range_end=key + "0")]
        )  # "0": "/" + 1

    def delete_pin(self, pin: Pin) -> None:
        """Delete `pin`'s key only while it holds this version of the pin: a pin made again
        under its id meanwhile (a client renewing it as it expires) stays."""
        c = self._client
        key = pin_key(pin)
        for _ in range(3):  # the key changed between the read and the delete: read it again
            try:
                raw, meta = c.get(key)
            except Exception as exc:  # noqa: BLE001
                raise self._unavailable(exc) from None
            if raw is None:
                return
            try:
                if pin_from_json(raw).version != pin.version:
                    return  # another pin under this id now: not ours to delete
            except (ValueError, KeyError):
                pass  # a record that does not parse under our pin's key: it goes with it
            ok, _ = self._fenced([c.transactions.delete(key)], compare=[c.transactions.mod(key) == meta.mod_revision])
            if ok:
                return
        raise errors.Unavailable(f"pin {pin.pin_id}'s key kept changing while it was being deleted; retried later")

    def _prefix(self, prefix: str) -> list[bytes]:
        try:
            return [value for value, _ in self._client.get_prefix(prefix)]
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None

    def watch_deletes(self, prefix: str, on_delete: Callable[[], None], on_end: Callable[[], None]):
        """Call `on_delete()` when a key under `prefix` is deleted (a pin released with its
        owner's lease: etcd deletes it, nobody writes), `on_end()` when the watch stream
        ends (etcd away; watch again). Returns the watch id."""
        import pyetcd.events

        def on_response(response) -> None:
            if response is None or isinstance(response, Exception):
                on_end()
            elif any(isinstance(e, pyetcd.events.DeleteEvent) for e in response.events):
                on_delete()

        try:
            return self._client.add_watch_prefix_callback(prefix, on_response)
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None

    def cancel_watch(self, watch_id) -> None:
        try:
            self._client.cancel_watch(watch_id)
        except Exception as exc:  # noqa: BLE001 - etcd away: the stream is gone with it
            log.debug("cancelling watch %s: %s", watch_id, exc)

    def exists(self, key: str) -> bool:
        try:
            return self._client.get(key)[0] is not None
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None

    def load_pins(self) -> list[Pin]:
        out = []
        for raw in self._prefix(etcd_keys.PINS_PREFIX):
            try:
                out.append(pin_from_json(raw))
            except (ValueError, KeyError) as exc:
                log.warning("ignoring a malformed pin in etcd: %s", exc)
        return out

    def load_ops(self) -> list[Operation]:
        out = []
        for raw in self._prefix(etcd_keys.OPS_PREFIX):
            try:
                out.append(op_from_json(raw))
            except (ValueError, KeyError) as exc:
                log.warning("ignoring a malformed operation in etcd: %s", exc)
        return out

    def load_op_commands(self) -> dict[str, dict[str, AgentCommand]]:
        """op id -> agent id -> the command it was sent (unfinished operations only)."""
        # one key at a time: the operations under way may hold many MiB of commands (up to
        # MAX_OP_COMMAND_BYTES an agent), more than one answer may carry (gRPC's 4 MiB)
        try:
            keys = [
                meta.key.decode() for _, meta in self._client.get_prefix(etcd_keys.OP_COMMANDS_PREFIX, keys_only=True)
            ]
            records = [(key, self._client.get(key)[0]) for key in keys]
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None
        out: dict[str, dict[str, AgentCommand]] = {}
        for key, raw in records:
            if raw is None:
                continue  # deleted since it was listed: its operation ended
            commands = out.setdefault(etcd_keys.op_id_of_command_key(key), {})  # (kept, to be deleted at its end)
            try:
                commands.update(op_commands_from_json(raw))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring malformed stored commands at %s: %s", key, exc)
        return out

    def load_policy(self) -> tuple[dict[str, str], int]:
        try:
            value, meta = self._client.get(etcd_keys.POLICY_KEY)
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None
        if value is None:
            return {}, 0
        return json.loads(value), meta.mod_revision

    def lease_alive(self, lease_id: int) -> bool:
        try:
            info = self._client.get_lease_info(lease_id)
        except Exception as exc:  # noqa: BLE001
            raise self._unavailable(exc) from None
        return info.TTL > 0
