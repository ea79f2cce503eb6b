"""Writes that race on the leader: a pin made again while the loop sweeps its expired self,
a pin id made again in another namespace, an owner lease that ends between its check and
the write, two agents' reports of one operation written from two threads, and bad input
during the grace after a takeover. Each race is forced at the point a real thread could
reach it (a store call wrapped to run the competing call there); real etcd throughout."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import pytest

from controlplane.core import operations as ops
from controlplane.core.scope import Scope
from protos import errors, etcd_keys
from protos.tier import Tier


@pytest.fixture
def m(controlplane):
    """The leader's manager with its reconcile loop idle: each test runs the steps itself."""
    manager = controlplane.manager
    manager.ensure_loaded()
    manager.run_once = lambda now=None: None
    time.sleep(0.5)  # a pass under way ends
    return manager


def _pin_keys(m) -> list[str]:
    return sorted(meta.key.decode() for _, meta in m._etcd.get_prefix(etcd_keys.PINS_PREFIX))


def test_a_pin_made_again_while_its_expired_self_is_swept_stays(m):
    old = m.pin(Scope(namespace="kb"), Tier.CPU, 1.0, owner="svc", pin_id="renewed")
    time.sleep(1.2)  # expired, not swept yet
    made = []
    real = m.durable.delete_pin

    def renew_first(pin):  # the client renews right as the loop deletes the old one
        if not made:
            made.append(m.pin(Scope(namespace="kb"), Tier.CPU, 600.0, owner="svc", pin_id="renewed"))
        return real(pin)

    m.durable.delete_pin = renew_first
    try:
        m._expire_pins(m.clock())
    finally:
        m.durable.delete_pin = real
    new = made[0]
    assert new.version != old.version
    assert _pin_keys(m) == [etcd_keys.PINS_PREFIX + "kb/renewed"]
    assert m.pins["renewed"] is new
    assert [p.pin_id for p in m.list_pins()] == ["renewed"]
    m._reload_pins()  # etcd agrees
    assert m.pins["renewed"].version == new.version


def test_a_pin_id_made_again_in_another_namespace_leaves_no_old_key(m):
    m.pin(Scope(namespace="zz"), Tier.CPU, 1.0, pin_id="moved")
    time.sleep(1.2)  # expired, not swept yet
    new = m.pin(Scope(namespace="aa"), Tier.CPU, 600.0, pin_id="moved")
    assert _pin_keys(m) == [etcd_keys.PINS_PREFIX + "aa/moved"]
    m._expire_pins(m.clock())
    m.load()  # a leader loading etcd holds the live pin
    assert m.pins["moved"].version == new.version and m.pins["moved"].namespace == "aa"
    assert [(p.pin_id, p.namespace) for p in m.list_pins()] == [("moved", "aa")]


def test_a_load_prefers_the_newest_pin_of_an_id_and_deletes_the_older(m):
    """Two keys for one id (written by a release before the fix, or a lost answer): the
    newest is held, the older deleted."""
    m.pin(Scope(namespace="aa"), Tier.CPU, 600.0, pin_id="twice")
    old_value = m._etcd.get(etcd_keys.PINS_PREFIX + "aa/twice")[0]
    record = json.loads(old_value)
    record["namespace"] = "zz"
    record["created_unix_seconds"] -= 100  # made earlier
    m._etcd.put(etcd_keys.PINS_PREFIX + "zz/twice", json.dumps(record))
    m.load()
    assert m.pins["twice"].namespace == "aa"
    assert _pin_keys(m) == [etcd_keys.PINS_PREFIX + "aa/twice"]


def test_an_owner_lease_that_ends_after_its_check_is_invalid_argument(m):
    lease = m._etcd.lease(5)
    real = m.durable.lease_alive

    def alive_then_revoked(lease_id):
        ok = real(lease_id)
        lease.revoke()  # the owner exits right after the check
        return ok

    m.durable.lease_alive = alive_then_revoked
    before = m.durable.errors_total
    try:
        with pytest.raises(errors.InvalidArgument, match="owner_lease_id") as info:
            m.pin(Scope(namespace="kb"), Tier.CPU, 0.0, owner_lease_id=lease.id, pin_id="leased")
    finally:
        m.durable.lease_alive = real
    assert f"lease {lease.id}" in str(info.value)
    assert m.durable.errors_total == before  # etcd answered: not counted as an etcd failure
    assert _pin_keys(m) == [] and "leased" not in m.pins


def test_two_agents_reports_of_one_operation_reach_etcd_in_order(m):
    op = ops.new_operation("move", {"to": "cpu"}, ["a", "b"], now=m.clock())
    op.commands_sent = True
    m._register_op(op)
    real = m.durable.put
    first_in, release = threading.Event(), threading.Event()

    def slow_first(key, value, lease_id=0, replacing=""):
        if key.endswith(op.op_id) and not first_in.is_set():
            first_in.set()
            release.wait(5)  # agent a's write is slow on the wire
        return real(key, value, lease_id, replacing)

    m.durable.put = slow_first
    try:
        a = threading.Thread(target=m.on_op_update, args=("a", op.op_id, ops.SUCCEEDED, 4, 4, 0, 0, ""))
        a.start()
        assert first_in.wait(5)
        # agent b finishes meanwhile: the operation SUCCEEDED (its write waits for a's)
        b = threading.Thread(target=m.on_op_update, args=("b", op.op_id, ops.SUCCEEDED, 6, 6, 0, 0, ""))
        b.start()
        time.sleep(0.3)
        release.set()
        a.join(10)
        b.join(10)
    finally:
        m.durable.put = real
    assert op.state == ops.SUCCEEDED
    stored = json.loads(m._etcd.get(etcd_keys.OPS_PREFIX + op.op_id)[0])
    assert stored["state"] == ops.SUCCEEDED
    with m._lock:  # a leader that loads etcd now holds what this one answered
        m.ops = OrderedDict()
    m.load()
    assert m.ops[op.op_id].state == ops.SUCCEEDED


BAD_DURING_GRACE = {
    "move, hashes not a multiple of 16": (
        lambda m: m.move(Scope(model_id="m", block_hashes=b"x" * 5), Tier.CPU),
        "scope.block_hashes",
    ),
    "move, bad namespace": (lambda m: m.move(Scope(namespace="bad ns!"), Tier.CPU), "scope.namespace"),
    "move, neither prefix nor namespace": (lambda m: m.move(Scope(), Tier.CPU), "scope.namespace"),
    "compress, tokens and hashes": (
        lambda m: m.compress(Scope(model_id="m", token_ids=(1,), block_hashes=b"x" * 16), "int8"),
        "scope.token_ids",
    ),
    "transfer, hashes not a multiple of 16": (
        lambda m: m.transfer(Scope(model_id="m", block_hashes=b"x" * 5), "away", "b"),
        "scope.block_hashes",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DURING_GRACE))
def test_bad_input_right_after_a_takeover_is_invalid_argument_not_unavailable(controlplane, m, case):
    controlplane.membership.run_once = lambda: []  # etcd's listing stays as set here
    time.sleep(0.6)
    m.cluster._expected_agents = frozenset({"away"})  # listed in etcd, its stream not back yet
    m._loaded_monotonic = time.monotonic()  # took over a moment ago
    call, field = BAD_DURING_GRACE[case]
    with pytest.raises(errors.InvalidArgument, match=field.replace(".", r"\.")):
        call(m)
    # a well-formed request still waits for the agent: Unavailable, try again
    with pytest.raises(errors.Unavailable, match="not back"):
        m.move(Scope(namespace="ok"), Tier.CPU)


def test_an_operation_a_takeover_adopted_is_timed_when_it_finishes(m):
    """kvcp_operation_duration_seconds missed every operation a new leader adopted: only
    the ones it started or requeued had the event its end is timed at (a review)."""
    op = ops.new_operation("move", {"to": "cpu"}, ["a"], now=m.clock())
    op.commands_sent = True
    m._register_op(op)
    with m._lock:  # another replica's memory: what it knows of the operation is in etcd
        m.ops = OrderedDict()
        m._op_done.clear()
    m.load()
    timed = []
    m.on_finished = lambda kind, state, seconds: timed.append((kind, state))
    m.on_op_update("a", op.op_id, ops.SUCCEEDED, 4, 4, 0, 0, "")
    assert timed == [("move", ops.SUCCEEDED)]
