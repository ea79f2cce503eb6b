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
