"""Operations, pins and policy across a new leader's first moments, etcd failures and
cancels: real etcd, real in-process control planes, and stand-in agents whose commands
land in a queue (so an operation stays where the test leaves it until it answers)."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time

import pytest

from cli.client import ClientError, ControlPlaneClient
from controlplane.core.cluster import AgentRecord, ModelInfo, TierUsage
from controlplane.core.pins import new_pin
from controlplane.core.scope import Scope
from controlplane.manager import Manager
from controlplane.manager_ops import CANCEL_RESEND_SECONDS
from controlplane.server import ControlPlane, ControlPlaneConfig
from controlplane.store.durable import pin_key, pin_to_json
from protos import errors, etcd_keys
from protos.tier import Tier
from tests.helpers import EtcdServer, wait_for


def start_cp(endpoint: str, **overrides) -> ControlPlane:
    config = {
        "listen": "127.0.0.1:0",
        "etcd": endpoint,
        "election_ttl_seconds": 3,
        "metrics_listen": "",
        "policy_enabled": False,
        "etcd_wait_seconds": 5,
    }
    cp = ControlPlane(ControlPlaneConfig(**{**config, **overrides})).start()
    wait_for(lambda: cp.election.is_leader, 15, 0.02, "leadership")
    return cp


class StandInAgent:
    """Registered straight into the cluster; commands are kept, answers sent by the test."""

    def __init__(self, cp: ControlPlane, agent_id: str = "a1"):
        self.cp, self.agent_id = cp, agent_id
        # its key in etcd (membership drops agents without one), under a lease that outlives the test
        client = etcd_keys.connect(cp.config.etcd)
        client.put(etcd_keys.agent_key(agent_id), b"{}", client.lease(60))
        client.close()
        self.outbox: queue.Queue = queue.Queue()
        record = AgentRecord(
            agent_id=agent_id,
            address="127.0.0.1:1",
            models=[ModelInfo("m", 16, 2, 2, 8, "float16")],
            tiers=[TierUsage(Tier.CPU, 1 << 20, 0, 0)],
        )
        cp.cluster.register(record)
        cp.cluster.hello(agent_id, "s1")
        cp.cluster.attach_outbox(agent_id, "s1", self.outbox)
        self.received: list = []

    def commands(self, kind: str = "", op_id: str = "") -> list:
        while True:
            try:
                self.received.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        # the outbox also carries what the stream would send besides commands (errors)
        cmds = [c for c in self.received if hasattr(c, "kind")]
        return [c for c in cmds if (not kind or c.kind == kind) and (not op_id or c.op_id == op_id)]

    def report(self, op_id: str, state: str, num_done_blocks: int = 0, num_total_blocks: int = 0, freed=None) -> None:
        self.cp.manager.on_op_update(self.agent_id, op_id, state, num_done_blocks, num_total_blocks, 0, 0, "", 0, freed)


def stored_op(etcd_endpoint: str, op_id: str) -> dict:
    client = etcd_keys.connect(etcd_endpoint)
    try:
        raw, _ = client.get(etcd_keys.OPS_PREFIX + op_id)
        return json.loads(raw) if raw else {}
    finally:
        client.close()


@pytest.fixture
def late_reconcile(monkeypatch):
    """The reconcile loop's first pass comes late (a busy process): what a new leader
    answers before it must not depend on that pass having loaded its state."""
    real = Manager.run_forever

    def late(self, stop, interval_seconds=0.2):
        if not stop.wait(4.0):
            real(self, stop, interval_seconds)

    monkeypatch.setattr(Manager, "run_forever", late)


@pytest.fixture
def own_etcd():
    """An etcd of this test alone (it is stopped, paused or killed)."""
    server = EtcdServer().start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.resume()
    server.cleanup()


# ---- a new leader loads its state before it answers -------------------------------------


def test_op_started_before_the_first_reconcile_pass_is_not_failed_by_load(etcd, late_reconcile):
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        assert [c.op_id for c in agent.commands("move")] == [op.op_id]
        time.sleep(4.5)  # the late first pass has run
        agent.report(op.op_id, "SUCCEEDED", 5, 5)
        got = cp.manager.get_op(op.op_id)
        assert (got.state, got.error) == ("SUCCEEDED", "")
        wait_for(lambda: stored_op(etcd, op.op_id).get("state") == "SUCCEEDED", 5, 0.05, "stored SUCCEEDED")
    finally:
        cp.stop()


def test_set_policy_on_a_new_leader_keeps_the_stored_policy(etcd, late_reconcile):
    a = start_cp(etcd)
    b = None
    try:
        a.manager.set_policy({"quota.legal-kb": "1GiB"})
        b = ControlPlane(
            ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3, policy_enabled=False)
        ).start()
        a.stop()
        a = None
        wait_for(lambda: b.election.is_leader, 10, 0.01, "B leads")
        with ControlPlaneClient(b.address) as client:
            assert client.get_policy().get("quota.legal-kb") == "1GiB"
            values = client.set_policy({"quota.chat": "2GiB"})
        assert values["quota.legal-kb"] == "1GiB" and values["quota.chat"] == "2GiB"
        stored, revision = b.durable.load_policy()
        assert stored["quota.legal-kb"] == "1GiB" and stored["quota.chat"] == "2GiB"
        assert b.manager.get_policy()[1] == revision  # SetPolicy answers the new revision
    finally:
        for cp in (a, b):
            if cp is not None:
                cp.stop()


def test_leader_that_wins_again_keeps_the_operations_it_runs(etcd):
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "loaded")
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        agent.report(op.op_id, "RUNNING", 1, 5)
        epoch = cp.election.epoch
        # its lease lapses (a long pause) and it wins again: a new epoch, the same replica
        client = etcd_keys.connect(etcd)
        _, meta = client.get(etcd_keys.LEADER_KEY)
        client.revoke_lease(meta.lease_id)
        client.close()
        wait_for(lambda: cp.election.is_leader and cp.election.epoch != epoch, 10, 0.01, "won again")
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "reloaded")
        agent.report(op.op_id, "SUCCEEDED", 5, 5)
        assert cp.manager.get_op(op.op_id).state == "SUCCEEDED"
    finally:
        cp.stop()


def _record_of_an_earlier_release(op_id: str, kind: str, state: str, counts: tuple[int, int, int, int]) -> str:
    """An operation as releases before 2026-12-06 stored it: a part's block counts under
    "done", "total", "failed" and "skipped_pinned"."""
    done, total, failed, skipped_pinned = counts
    now = time.time()
    return json.dumps(
        {
            "op_id": op_id,
            "kind": kind,
            "params": {"namespace": "ns1"},
            "state": state,
            "error": "",
            "dry_run": False,
            "waiting_for_lock": False,
            "commands_sent": True,
            "cancel_requested": False,
            "created_unix_seconds": now,
            "updated_unix_seconds": now,
            "parts": [
                {
                    "agent_id": "a1",
                    "state": state,
                    "done": done,
                    "total": total,
                    "failed": failed,
                    "skipped_pinned": skipped_pinned,
                    "moved_bytes": done << 20,
                    "error": "",
                    "freed": {str(int(Tier.CPU)): [done, done << 20]} if kind == "cleanup" else {},
                    "given_up": False,
                    "incarnation": "",
                    "result": "",
                }
            ],
        }
    )


def test_an_operation_an_earlier_release_stored_loads_and_is_stored_again_under_the_new_names(etcd, late_reconcile):
    """An upgrade: the operations in etcd were written with the old names of the block
    counts. A new leader reads them (none is skipped as malformed), answers their counts,
    and a report on one still running stores it again under the new names only."""
    client = etcd_keys.connect(etcd)
    client.put(
        etcd_keys.OPS_PREFIX + "cleanup-old",
        _record_of_an_earlier_release("cleanup-old", "cleanup", "SUCCEEDED", (3, 4, 0, 1)),
    )
    client.put(
        etcd_keys.OPS_PREFIX + "move-old", _record_of_an_earlier_release("move-old", "move", "RUNNING", (2, 5, 1, 0))
    )
    client.close()
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        with ControlPlaneClient(cp.address) as c:
            done = c.get_operation("cleanup-old")
            counts = (
                done.num_done_blocks,
                done.num_total_blocks,
                done.num_failed_blocks,
                done.num_skipped_pinned_blocks,
            )
            assert (done.state, counts, done.progress) == ("SUCCEEDED", (3, 4, 0, 1), 1.0)
            assert [(t.num_blocks, t.used_bytes) for t in done.freed] == [(3, 3 << 20)]
            running = c.get_operation("move-old")
            counts = (running.num_done_blocks, running.num_total_blocks, running.num_failed_blocks)
            assert (running.state, counts, running.progress) == ("RUNNING", (2, 5, 1), pytest.approx(0.6))
        agent.report("move-old", "SUCCEEDED", 5, 5)
        wait_for(lambda: stored_op(etcd, "move-old").get("state") == "SUCCEEDED", 5, 0.05, "stored SUCCEEDED")
        (part,) = stored_op(etcd, "move-old")["parts"]
        counts = (part["num_done_blocks"], part["num_total_blocks"], part["num_failed_blocks"])
        assert counts == (5, 5, 0) and part["num_skipped_pinned_blocks"] == 0
        assert (part["done"], part["total"], part["failed"], part["skipped_pinned"]) == (5, 5, 0, 0)  # earlier names
    finally:
        cp.stop()


# ---- cancels ------------------------------------------------------------------------------


def test_cancel_in_the_window_before_fan_out_sends_nothing(etcd):
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        m = cp.manager
        real = m._register_op

        def register_then_cancel(op, commands=None):
            unknown = real(op, commands)
            m.cancel_op(op.op_id)  # a CancelOperation that arrives between the two steps
            return unknown

        m._register_op = register_then_cancel
        op = m.move(Scope(namespace="ns1"), Tier.DISK)
        assert op.state == "CANCELLED"
        assert agent.commands("move") == []
        raw = etcd_keys.connect(etcd)  # its commands, stored before its record, went with its end
        assert raw.get(etcd_keys.op_command_key(op.op_id, agent.agent_id))[0] is None
        raw.close()
    finally:
        cp.stop()


def test_running_cleanup_is_not_cancellable_and_reports_what_it_did(etcd):
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.cleanup(0, namespace="ns1")
        wait_for(lambda: agent.commands("cleanup", op.op_id), 5, 0.02, "cleanup sent")
        agent.report(op.op_id, "RUNNING", 0, 5)
        with ControlPlaneClient(cp.address) as client, pytest.raises(ClientError) as refused:
            client.cancel_operation(op.op_id)
        assert refused.value.code == "FAILED_PRECONDITION" and "cannot be cancelled" in str(refused.value)
        agent.report(op.op_id, "SUCCEEDED", 5, 5, {int(Tier.CPU): (5, 5 << 20)})
        got = cp.manager.get_op(op.op_id)
        assert got.state == "SUCCEEDED" and got.freed() == {Tier.CPU: (5, 5 << 20)}
    finally:
        cp.stop()


def test_queued_cleanup_cancelled_never_runs(etcd):
    cp = start_cp(etcd, op_timeout_seconds=10)
    try:
        agent = StandInAgent(cp)
        first = cp.manager.cleanup(0, namespace="ns1")
        wait_for(lambda: agent.commands("cleanup", first.op_id), 5, 0.02, "first sent")
        second = cp.manager.cleanup(0, namespace="ns1")
        assert cp.manager.cancel_op(second.op_id).state == "CANCELLED"
        assert stored_op(etcd, second.op_id)["state"] == "CANCELLED"
        agent.report(first.op_id, "SUCCEEDED", 1, 1)
        time.sleep(0.5)
        assert agent.commands("cleanup", second.op_id) == []
    finally:
        cp.stop()


# ---- etcd failing under a leader ----------------------------------------------------------


def test_cancel_etcd_refuses_changes_nothing(own_etcd):
    cp = start_cp(own_etcd.endpoint, op_timeout_seconds=30)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        agent.report(op.op_id, "RUNNING", 1, 5)
        own_etcd.proc.kill()
        own_etcd.proc.wait()
        # answered CANCELLED but never stored, a next leader would not know of it. The
        # answer is "refused" (the call never reached etcd: nothing changes) or, where the
        # channel had not yet seen its connection go or the call timed out on a loaded
        # machine, "may or may not have been applied" (memory follows the cancel and
        # writes it to etcd once it is back): never a cancel said done
        with pytest.raises((errors.Unavailable, errors.OutcomeUnknown)) as said:
            cp.manager.cancel_op(op.op_id)
        got = cp.manager.get_op(op.op_id)
        assert got.state == "RUNNING"
        if said.type is errors.OutcomeUnknown:
            assert got.cancel_requested and op.op_id in cp.manager._dirty
        else:
            assert not got.cancel_requested and agent.commands("cancel") == []
    finally:
        cp.stop(grace_seconds=0.2)


def test_result_that_etcd_missed_is_written_when_it_returns(own_etcd):
    cp = start_cp(own_etcd.endpoint, op_timeout_seconds=30)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        agent.report(op.op_id, "RUNNING", 0, 5)
        own_etcd.proc.kill()
        own_etcd.proc.wait()
        agent.report(op.op_id, "SUCCEEDED", 5, 5)  # etcd cannot take it now
        assert cp.manager.get_op(op.op_id).state == "SUCCEEDED"
        own_etcd.start()
        wait_for(lambda: stored_op(own_etcd.endpoint, op.op_id).get("state") == "SUCCEEDED", 15, 0.1, "written")
        assert cp.manager.get_op(op.op_id).state == "SUCCEEDED"
    finally:
        cp.stop(grace_seconds=0.2)


def test_write_that_timed_out_is_reported_as_maybe_applied(own_etcd):
    cp = start_cp(own_etcd.endpoint)
    try:
        StandInAgent(cp)
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "loaded")
        own_etcd.pause()
        with ControlPlaneClient(cp.address) as client, pytest.raises(ClientError) as unknown:
            client.pin(namespace="ns1", ttl_seconds=60, retries=0)
        assert unknown.value.code == "UNKNOWN", unknown.value
        assert "may or may not have been applied" in str(unknown.value)
    finally:
        own_etcd.resume()
        cp.stop(grace_seconds=0.2)


def test_a_pin_whose_answer_was_lost_is_retried_without_a_second_pin(own_etcd):
    cp = start_cp(own_etcd.endpoint)
    try:
        StandInAgent(cp)
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "loaded")
        own_etcd.pause()
        with ControlPlaneClient(cp.address) as client:
            # the client retries a pin whose answer was lost, through the control plane's
            # refusals while etcd is away, and then says the pin may exist under its id
            with pytest.raises(ClientError) as lost:
                client.pin(namespace="ns1", ttl_seconds=60, pin_id="ns1-keep", retries=2)
            assert lost.value.code in ("UNKNOWN", "UNAVAILABLE"), lost.value
            assert "--pin-id ns1-keep to retry it safely" in str(lost.value)
            own_etcd.resume()
            again = wait_for(lambda: client.pin(namespace="ns1", ttl_seconds=60, pin_id="ns1-keep"), 15, 0.2, "pin")
            assert again.pin_id == "ns1-keep"
            assert [p.pin_id for p in client.list_pins()] == ["ns1-keep"]

            # a write etcd took while its answer was lost (the leader never learnt of it) is
            # found by the retry and adopted, not doubled or overwritten
            landed = new_pin("ns2", "", b"", Tier.DISK, 60.0, "", 0, "", 0, time.time() - 5, "ns2-keep")
            etcd = etcd_keys.connect(own_etcd.endpoint)
            try:
                etcd.put(pin_key(landed), pin_to_json(landed))
            finally:
                etcd.close()
            assert "ns2-keep" not in cp.manager.pins
            retried = client.pin(namespace="ns2", min_tier="disk", ttl_seconds=60, pin_id="ns2-keep")
            assert retried.expires_unix_seconds == pytest.approx(landed.expires_unix_seconds)
            assert sorted(p.pin_id for p in client.list_pins()) == ["ns1-keep", "ns2-keep"]
            with pytest.raises(ClientError) as clash:
                client.pin(namespace="ns2", min_tier="cpu", ttl_seconds=60, pin_id="ns2-keep")
            assert clash.value.code == "ALREADY_EXISTS" and "'ns2-keep'" in str(clash.value)
    finally:
        own_etcd.resume()
        cp.stop(grace_seconds=0.2)


def test_one_failed_etcd_call_elsewhere_does_not_make_the_leader_read_only(etcd):
    cp = start_cp(etcd)
    try:
        flips = []
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                if cp.election.serving_from_memory or not cp.election.is_leader:
                    flips.append(time.monotonic())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        endpoint = next(iter(cp.etcd.raw.endpoints.values()))
        for _ in range(3):  # what pyetcd does after one call on another thread timed out
            endpoint.fail()
            cp.etcd.raw._clear_old_stubs()
            time.sleep(0.8)
        stop.set()
        watcher.join()
        assert flips == []
    finally:
        cp.stop()


# ---- agents' reports --------------------------------------------------------------------


def test_a_listing_keeps_an_unfinished_operation_behind_newer_finished_ones(etcd):
    """Listings are the newest first, 50 on the dashboard: a long move behind a stream of
    newer operations that ended dropped off the list while it still ran."""
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        running = cp.manager.move(Scope(namespace="long"), Tier.DISK)
        ended = []
        for k in range(5):
            op = cp.manager.move(Scope(namespace=f"ns{k}"), Tier.DISK)
            agent.report(op.op_id, "SUCCEEDED", 1, 1)
            ended.append(op.op_id)
        with ControlPlaneClient(cp.address) as client:
            listed = [o.op_id for o in client.list_operations(max_operations=3)]
            assert listed == [ended[4], ended[3], running.op_id]  # newest first, the running one kept
            assert [o.op_id for o in client.list_operations()] == [*reversed(ended), running.op_id]
    finally:
        cp.stop()


def test_bad_op_update_does_not_break_listing(etcd):
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.move(Scope(namespace="ns2"), Tier.DISK)
        agent.report(op.op_id, "EXPLODED", 1, 1)  # an unknown state: ignored
        assert cp.manager.get_op(op.op_id).state == "PENDING"
        agent.report(op.op_id, "SUCCEEDED", 1, 1, {99: (1, 1), int(Tier.DISK): (1, 2)})
        with ControlPlaneClient(cp.address) as client:
            assert [o.op_id for o in client.list_operations()] == [op.op_id]
            assert client.get_operation(op.op_id).state == "SUCCEEDED"
    finally:
        cp.stop()


# ---- cleanup scopes ----------------------------------------------------------------------


def test_cleanup_of_all_namespaces_waits_for_a_namespace_cleanup(etcd):
    cp = start_cp(etcd, op_timeout_seconds=10)
    try:
        agent = StandInAgent(cp)
        ns = cp.manager.cleanup(0, namespace="ns1")
        wait_for(lambda: agent.commands("cleanup", ns.op_id), 5, 0.02, "namespace cleanup sent")
        everything = cp.manager.cleanup(0)
        time.sleep(0.6)
        assert agent.commands("cleanup", everything.op_id) == [] and everything.waiting_for_lock
        agent.report(ns.op_id, "SUCCEEDED", 1, 1)
        wait_for(lambda: agent.commands("cleanup", everything.op_id), 5, 0.02, "all-namespace cleanup sent")
        later = cp.manager.cleanup(0, namespace="ns2")
        time.sleep(0.6)
        assert agent.commands("cleanup", later.op_id) == [] and later.waiting_for_lock
        agent.report(everything.op_id, "SUCCEEDED", 1, 1)
        wait_for(lambda: agent.commands("cleanup", later.op_id), 5, 0.02, "namespace cleanup sent after")
    finally:
        cp.stop()


def test_a_part_whose_agent_restarted_fails_at_once_and_a_reconnect_is_no_restart(etcd):
    """The agent process the command went to is gone (a Hello under another incarnation):
    its part fails at the next pass, not after the operation timeout. A new stream of the
    same process (a reconnect) is no restart."""
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        cp.cluster.hello("a1", "s1", incarnation="proc-1")
        cp.cluster.attach_outbox("a1", "s1", agent.outbox)
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        assert op.parts["a1"].incarnation == "proc-1"
        cp.cluster.hello("a1", "s2", incarnation="proc-1")  # a reconnect
        cp.manager.run_once()
        assert not cp.manager.get_op(op.op_id).finished
        cp.cluster.hello("a1", "s3", incarnation="proc-2")  # a restart
        cp.manager.run_once()
        got = cp.manager.get_op(op.op_id)
        assert got.state == "FAILED" and "restarted" in got.error
        assert stored_op(etcd, op.op_id)["parts"][0]["incarnation"] == "proc-1"
    finally:
        cp.stop()


def test_a_cancel_is_asked_again_until_the_agent_answers_and_survives_a_reload(etcd):
    """The cancel's command may never reach the agent (a stream down at that moment, a
    leader that died after storing it): every pass asks again while the part runs, and
    the cancel is kept in etcd, so a next leader goes on asking."""
    cp = start_cp(etcd)
    try:
        agent = StandInAgent(cp)
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        agent.report(op.op_id, "RUNNING", 1, 10)
        cp.manager.cancel_op(op.op_id)
        asked = len(agent.commands("cancel", op.op_id))
        assert asked >= 1  # the reconcile loop runs beside the test: it may have asked again
        later = cp.manager.clock() + CANCEL_RESEND_SECONDS
        cp.manager.run_once(now=later)
        asked_again = len(agent.commands("cancel", op.op_id))
        assert asked_again > asked
        cp.manager.run_once(now=later + CANCEL_RESEND_SECONDS / 2)  # within the second: not again
        assert len(agent.commands("cancel", op.op_id)) == asked_again
        assert stored_op(etcd, op.op_id)["cancel_requested"] is True
        agent.report(op.op_id, "CANCELLED", 4, 10)
        cp.manager.run_once(now=later + 2 * CANCEL_RESEND_SECONDS)
        asked = len(agent.commands("cancel", op.op_id))
        cp.manager.run_once(now=later + 4 * CANCEL_RESEND_SECONDS)
        assert len(agent.commands("cancel", op.op_id)) == asked  # answered: no more
        assert cp.manager.get_op(op.op_id).state == "CANCELLED"
    finally:
        cp.stop()


def test_a_result_another_leader_stored_is_not_undone_by_progress_this_one_could_not_store(etcd, monkeypatch):
    """A leader cut off from etcd keeps an agent's progress report unstored (to be written
    later); meanwhile another leader records the operation's end (the agent's final answer
    went to it). When the first wins again, its load kept its own RUNNING copy over the
    stored SUCCEEDED and wrote it back into etcd (then failed the part for silence,
    unless its agent sent its final answer again)."""
    cp = start_cp(etcd, op_timeout_seconds=60)
    try:
        agent = StandInAgent(cp)
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "loaded")
        timed: list[tuple[str, str]] = []
        cp.manager.on_finished = lambda kind, state, seconds: timed.append((kind, state))
        op = cp.manager.move(Scope(namespace="ns1"), Tier.DISK)
        key = etcd_keys.OPS_PREFIX + op.op_id
        real_put = cp.manager.durable.put

        def refused(k, *args, **kwargs):
            if k == key:
                raise errors.Unavailable("etcd is unreachable (test)")
            return real_put(k, *args, **kwargs)

        monkeypatch.setattr(cp.manager.durable, "put", refused)
        agent.report(op.op_id, "RUNNING", 1, 5)  # not stored: kept to be written later
        assert op.op_id in cp.manager._dirty
        # another leader got the agent's final answer and stored it
        client = etcd_keys.connect(etcd)
        done = stored_op(etcd, op.op_id)
        done["state"] = "SUCCEEDED"
        for part in done["parts"]:
            part.update(state="SUCCEEDED", num_done_blocks=5, num_total_blocks=5)
        client.put(key, json.dumps(done))
        # this replica's lease lapses and it wins again: a new epoch, state loaded again
        epoch = cp.election.epoch
        _, meta = client.get(etcd_keys.LEADER_KEY)
        client.revoke_lease(meta.lease_id)
        wait_for(lambda: cp.election.is_leader and cp.election.epoch != epoch, 10, 0.01, "won again")
        wait_for(lambda: cp.manager._loaded_epoch == cp.election.epoch, 5, 0.02, "reloaded")
        monkeypatch.setattr(cp.manager.durable, "put", real_put)
        time.sleep(0.6)  # the reconcile passes that write what was not stored
        assert cp.manager.get_op(op.op_id).state == "SUCCEEDED"
        assert cp.manager._op_done[op.op_id].is_set() and timed == [("move", "SUCCEEDED")]  # its waiters woken
        assert stored_op(etcd, op.op_id)["state"] == "SUCCEEDED"
        client.close()
    finally:
        cp.stop()


def cleanup_queued_behind_another(cp: ControlPlane):
    """(agent, first, second): a cleanup of ns1 sent to the stand-in agent, and a second
    one queued behind its scope lock."""
    agent = StandInAgent(cp)
    first = cp.manager.cleanup(0, namespace="ns1")
    wait_for(lambda: agent.commands("cleanup", first.op_id), 5, 0.02, "first sent")
    return agent, first, cp.manager.cleanup(0, namespace="ns1")


def test_a_cancel_being_recorded_keeps_a_queued_cleanup_from_starting(etcd):
    """A cancel of a cleanup queued behind its scope lock is written to etcd before it is
    answered; if the lock comes free meanwhile, the cleanup must not go out: etcd would
    say CANCELLED while its agents clean (a leader dying then leaves a next one that
    neither holds its lock nor knows it runs)."""
    cp = start_cp(etcd, op_timeout_seconds=10)
    try:
        agent, first, second = cleanup_queued_behind_another(cp)
        m = cp.manager
        real = m._persist_op
        seen = []

        def persist(op):
            if op.op_id == second.op_id and op.cancel_requested and not seen:
                agent.report(first.op_id, "SUCCEEDED", 1, 1)  # the lock comes free as the cancel is stored
                sent = False
                with contextlib.suppress(AssertionError):
                    sent = bool(wait_for(lambda: agent.commands("cleanup", second.op_id), 2, 0.02, "second sent"))
                real(op)
                seen.append((stored_op(etcd, second.op_id)["state"], sent))
                return
            real(op)

        m._persist_op = persist
        try:
            got = m.cancel_op(second.op_id).state
        except errors.FailedPrecondition:
            got = "refused"
        assert seen and not (seen[0][0] == "CANCELLED" and seen[0][1]), seen
        assert got == "CANCELLED" and agent.commands("cleanup", second.op_id) == []
    finally:
        cp.stop()


def test_a_cancel_that_fails_beside_another_still_being_recorded_keeps_the_cleanup_queued(etcd):
    """Two cancels of one queued cleanup at once (a retry while the first still waits on
    etcd): the one etcd refused ended its guard for both, so the cleanup went out while
    the other was storing CANCELLED (etcd then said CANCELLED while its agents cleaned)."""
    cp = start_cp(etcd, op_timeout_seconds=10)
    try:
        agent, first, second = cleanup_queued_behind_another(cp)
        m = cp.manager
        real = m._persist_op
        calls, seen = [], []
        storing, refused_done = threading.Event(), threading.Event()

        def persist(op):
            if op.op_id != second.op_id or not op.cancel_requested or len(calls) >= 2:
                return real(op)
            calls.append(op)
            if len(calls) == 2:  # the other cancel: etcd refuses it
                storing.wait(5)
                raise errors.Unavailable("etcd: refused (a test)")
            storing.set()  # this one is being stored ...
            refused_done.wait(5)  # ... as the other ends, refused
            agent.report(first.op_id, "SUCCEEDED", 1, 1)  # and the lock comes free
            sent = False
            with contextlib.suppress(AssertionError):
                sent = bool(wait_for(lambda: agent.commands("cleanup", second.op_id), 2, 0.02, "second sent"))
            real(op)
            seen.append((stored_op(etcd, second.op_id)["state"], sent))

        m._persist_op = persist
        outcomes: list = []

        def cancel():
            try:
                outcomes.append(m.cancel_op(second.op_id).state)
            except errors.KvcpError as exc:
                outcomes.append(type(exc).__name__)
                refused_done.set()

        threads = [threading.Thread(target=cancel) for _ in range(2)]
        for t in threads:
            t.start()
            storing.wait(5)  # the second cancel comes while the first is being stored
        for t in threads:
            t.join(15)
        assert sorted(outcomes) == ["CANCELLED", "Unavailable"], outcomes
        assert seen and not (seen[0][0] == "CANCELLED" and seen[0][1]), seen
        assert agent.commands("cleanup", second.op_id) == []
    finally:
        cp.stop()
