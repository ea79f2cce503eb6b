"""The policy key in etcd is the truth: a policy written there by other means than
SetPolicy (etcdctl, a restore) applies within a resync, and a SetPolicy merges into it
instead of writing back what the leader read before (a read-modify-write loses no edit)."""

from __future__ import annotations

import json

from cli.client import ControlPlaneClient
from protos.etcd_keys import POLICY_KEY, connect
from protos.tier import Tier
from tests.helpers import wait_for


def _write_by_hand(etcd: str, **values: str) -> None:
    client = connect(etcd)
    try:
        raw, _ = client.get(POLICY_KEY)
        stored = json.loads(raw) if raw else {}
        client.put(POLICY_KEY, json.dumps({**stored, **values}))
    finally:
        client.close()


def test_a_policy_written_in_etcd_applies_live(etcd, controlplane):
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.7", "cpu.low_watermark": "0.5"})
        _write_by_hand(etcd, **{"cpu.high_watermark": "0.8"})
        # the reconcile loop reads the key again every resync (2 s)
        wait_for(lambda: c.get_policy()["cpu.high_watermark"] == "0.8", 10, 0.1, "the hand edit applied")
        assert controlplane.manager.policy["cpu.low_watermark"] == "0.5"
        assert controlplane.manager.tier_policy().tier(Tier.CPU).high_watermark == 0.8  # what the passes use


def test_set_policy_keeps_an_edit_made_in_etcd_since_it_read(etcd, controlplane):
    manager = controlplane.manager
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.7", "cpu.low_watermark": "0.5"})
        manager.resync_seconds = 3600.0  # no reload: SetPolicy alone must find the edit
        manager._next_reload = float("inf")
        _write_by_hand(etcd, promote_hot="false")
        after = c.set_policy({"cpu.low_watermark": "0.3"})
    assert after["promote_hot"] == "false"  # kept, not overwritten by the leader's older copy
    assert after["cpu.high_watermark"] == "0.7" and after["cpu.low_watermark"] == "0.3"
    stored, revision = manager.durable.load_policy()
    assert stored["promote_hot"] == "false" and stored["cpu.low_watermark"] == "0.3"
    assert manager.policy_revision == revision


def test_an_edit_landing_right_after_a_set_policy_is_applied_and_kept(etcd, controlplane):
    """SetPolicy took its revision from a second read: an etcdctl edit landing between its
    write and that read was never applied (its revision looked seen) and the next
    SetPolicy overwrote it (a review of this change)."""
    manager = controlplane.manager
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"cpu.high_watermark": "0.7", "cpu.low_watermark": "0.5"})
        real_replace = manager.durable.replace

        def replace_then_hand_edit(key, value, revision):
            ok = real_replace(key, value, revision)
            if ok:
                _write_by_hand(etcd, promote_hot="false")  # etcdctl, just after our write
            return ok

        manager.durable.replace = replace_then_hand_edit
        try:
            c.set_policy({"cpu.low_watermark": "0.3"})
        finally:
            manager.durable.replace = real_replace
        assert manager.policy["promote_hot"] == "false" and manager.policy["cpu.low_watermark"] == "0.3"
        c.set_policy({"cpu.low_watermark": "0.4"})
    stored, _ = manager.durable.load_policy()
    assert stored["promote_hot"] == "false" and stored["cpu.low_watermark"] == "0.4"


def test_a_deleted_policy_key_is_written_back_not_emptied(etcd, controlplane):
    """The policy key deleted in etcd: the reload keeps what it holds (as after an etcd
    reset); a SetPolicy then wrote {} plus its change, dropping every quota."""
    manager = controlplane.manager
    with ControlPlaneClient(controlplane.address) as c:
        c.set_policy({"quota.team-a": "1GiB", "cpu.high_watermark": "0.7", "cpu.low_watermark": "0.5"})
        client = connect(etcd)
        client.delete(POLICY_KEY)
        client.close()
        manager._next_reload = 0.0
        wait_for(lambda: manager._next_reload > 0.0, 5, 0.05, "a reload")
        assert manager.policy["quota.team-a"] == "1GiB"
        after = c.set_policy({"gpu.low_watermark": "0.8"})
    assert after["quota.team-a"] == "1GiB" and after["cpu.low_watermark"] == "0.5"
    stored, _ = manager.durable.load_policy()
    assert stored["quota.team-a"] == "1GiB"
