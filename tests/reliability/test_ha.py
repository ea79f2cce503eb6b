"""High availability and failures with real processes: two control-plane replicas
against one etcd, a leader SIGKILLed or paused (SIGSTOP/SIGCONT), fenced writes, and an
etcd outage during which lookups are still answered from memory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import grpc
import pytest
import torch

from agent.client import EngineClient
from agent.server import DEMO_MODEL
from cli.client import ClientError, ControlPlaneClient
from protos import errors, etcd_keys
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc
from tests.e2e.test_console_scripts import kvctl
from tests.helpers import EtcdServer, free_port, script, wait_for

M = DEMO_MODEL
TTL = 2


class Replicas:
    def __init__(self, etcd: str, tmp):
        self.etcd, self.tmp = etcd, tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {"cp-a": free_port(), "cp-b": free_port()}

    def spawn(self, name, argv):
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def start_cp(self, name):
        port = self.ports[name]
        self.spawn(
            name,
            [
                script("kvcp-controlplane"),
                "--listen",
                f"127.0.0.1:{port}",
                "--etcd",
                self.etcd,
                "--election-ttl-seconds",
                str(TTL),
                "--metrics-listen",
                "",
            ],
        )

    def start_pair(self):
        """cp-a leading, cp-b following."""
        self.start_cp("cp-a")
        wait_for(lambda: self.leader() == self.endpoint("cp-a"), 20, 0.2, "cp-a leads")
        self.start_cp("cp-b")
        wait_for(
            lambda: status_code(self.endpoint("cp-b")) == grpc.StatusCode.FAILED_PRECONDITION, 20, 0.2, "cp-b follows"
        )

    def endpoint(self, name):
        return f"127.0.0.1:{self.ports[name]}"

    def leader(self) -> str:
        client = etcd_keys.connect(self.etcd)
        try:
            value, _ = client.get(etcd_keys.LEADER_KEY)
            return value.decode() if value else ""
        finally:
            client.close()

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def replicas(etcd, tmp_path):
    r = Replicas(etcd, tmp_path)
    yield r
    r.stop()


def status_code(endpoint: str) -> grpc.StatusCode | None:
    with grpc.insecure_channel(endpoint) as ch:
        try:
            admin_pb2_grpc.AdminServiceStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=3)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_failover_fencing_and_survival(replicas):
    r = replicas
    r.start_pair()
    agent_port = free_port()
    r.spawn(
        "agent",
        [
            script("kvcp-agent"),
            "--agent-id",
            "ha-agent",
            "--listen",
            f"127.0.0.1:{agent_port}",
            "--etcd",
            r.etcd,
            "--lease-ttl-seconds",
            "5",
            "--metrics-listen",
            "",
        ],
    )
    # kvctl pointed at the follower is taken to the leader transparently
    wait_for(
        lambda: any(
            a["agent_id"] == "ha-agent" for a in json.loads(kvctl(r.endpoint("cp-b"), "-o", "json", "agents").stdout)
        ),
        30,
        0.3,
        "agent registered",
    )
    engine = EngineClient(f"127.0.0.1:{agent_port}")
    prompt = list(range(5 * M.block_size))
    engine.store(M.model_id, prompt, bytes(5 * M.block_bytes))
    pin_id = kvctl(
        r.endpoint("cp-b"), "pin", "--model", M.model_id, "--tokens", ",".join(map(str, prompt)), "--ttl", "10m"
    ).stdout.strip()
    kvctl(r.endpoint("cp-a"), "policy", "set", "quota.default=64MiB")

    # SIGKILL the leader: cp-b takes over within the election TTL + 2 s
    t0 = time.monotonic()
    r.procs["cp-a"].send_signal(signal.SIGKILL)
    wait_for(lambda: r.leader() == r.endpoint("cp-b"), TTL + 2, 0.05, "cp-b elected")
    took = time.monotonic() - t0
    assert took <= TTL + 2
    with ControlPlaneClient(r.endpoint("cp-b")) as c:
        # the agent reconnects and resyncs; pins and policy survive
        wait_for(
            lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("ha-agent") == 5,
            15,
            0.2,
            "agent resynced to the new leader",
        )
        assert [p.pin_id for p in c.list_pins()] == [pin_id]
        assert c.get_policy()["quota.default"] == "64MiB"
        assert c.lookup(M.model_id, prompt).best_agent_id == "ha-agent"
        epoch_b = c.stats().epoch

    # restart cp-a as a follower, then pause cp-b (SIGSTOP): cp-a takes over
    r.start_cp("cp-a")
    wait_for(lambda: status_code(r.endpoint("cp-a")) == grpc.StatusCode.FAILED_PRECONDITION, 20, 0.2, "cp-a follows")
    r.procs["cp-b"].send_signal(signal.SIGSTOP)
    wait_for(lambda: r.leader() == r.endpoint("cp-a"), TTL + 4, 0.1, "cp-a elected while cp-b is paused")
    with ControlPlaneClient(r.endpoint("cp-a")) as c:
        wait_for(
            lambda: {a.agent_id: a.state for a in c.list_agents()}.get("ha-agent") == "ready",
            20,
            0.2,
            "agent moved to cp-a",
        )
        assert c.stats().epoch > epoch_b
    # resume the old leader: it finds its lease gone and follows; it can write nothing
    r.procs["cp-b"].send_signal(signal.SIGCONT)
    wait_for(
        lambda: status_code(r.endpoint("cp-b")) == grpc.StatusCode.FAILED_PRECONDITION,
        10,
        0.1,
        "resumed old leader is a follower",
    )
    with ControlPlaneClient(r.endpoint("cp-a")) as c:
        assert [p.pin_id for p in c.list_pins()] == [pin_id]
        assert c.lookup(M.model_id, prompt).best_agent_id == "ha-agent"
    engine.close()


def test_deposed_leader_writes_nothing(etcd):
    """Fencing without processes: a replica that still believes it leads (it was paused)
    cannot write, because every durable write compares the leader key's revision."""
    from controlplane.store.durable import DurableStore
    from controlplane.store.election import LeaderElection

    ca, cb = etcd_keys.connect(etcd), etcd_keys.connect(etcd)
    a = LeaderElection(ca, "a:1", ttl_seconds=2)
    assert a.run_once() and a.is_leader
    ca.delete(etcd_keys.LEADER_KEY)  # a's lease "expired" while it was paused
    b = LeaderElection(cb, "b:1", ttl_seconds=2)
    assert b.run_once() and b.epoch > a.epoch
    assert a.is_leader  # a has not noticed yet
    with pytest.raises(errors.NotLeader):
        DurableStore(ca, a).put(etcd_keys.POLICY_KEY, '{"evil": "1"}')
    assert ca.get(etcd_keys.POLICY_KEY)[0] is None
    DurableStore(cb, b).put(etcd_keys.POLICY_KEY, "{}")
    assert cb.get(etcd_keys.POLICY_KEY)[0] == b"{}"
    assert not a.run_once()  # and at its next pass it steps down
    assert a.leader_address == "b:1"  # naming the leader at once, so clients follow (not itself)
    ca.close()
    cb.close()


class _OtherWinsFirst:
    """The real etcd client, with another replica's campaign run just before this one's
    transaction: the interleaving where a replica back from an outage reads no leader key
    and then loses the race for it."""

    def __init__(self, client, other):
        self._client, self._other = client, other

    def __getattr__(self, name):
        return getattr(self._client, name)

    def transaction(self, **kwargs):
        if self._other is not None:
            other, self._other = self._other, None
            assert other.run_once()
        return self._client.transaction(**kwargs)


def test_a_replica_that_loses_the_race_for_the_leader_key_names_the_winner(etcd):
    """It went on naming itself (its address from when it led) until its next step, so
    clients it answered 'not the leader' were sent back to it."""
    from controlplane.store.election import LeaderElection

    ca, cb = etcd_keys.connect(etcd), etcd_keys.connect(etcd)
    b = LeaderElection(cb, "b:1", ttl_seconds=2)
    a = LeaderElection(_OtherWinsFirst(ca, b), "a:1", ttl_seconds=2)
    a.leader_address = "a:1"  # as a replica that led before an etcd outage
    assert not a.run_once()
    assert b.is_leader and a.leader_address == "b:1" and a.epoch == b.epoch
    b.resign()
    ca.close()
    cb.close()


def test_a_client_moves_on_from_a_replica_that_is_not_the_leader_and_names_no_other(etcd):
    """A follower that names no leader (none yet, or, stale, itself) refused the call
    without applying it: kvctl given several replicas asks the next one."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    a = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=TTL)).start()
    b = None
    try:
        wait_for(lambda: a.election.is_leader, 10, 0.1, "a leads")
        b = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=TTL)).start()
        wait_for(lambda: b.election.leader_address == a.address, 10, 0.1, "b names a")
        b.election.run_once = lambda: False  # b's election stands still ...
        for named in (b.address, ""):  # ... naming itself, stale, as after a lost race, or none
            b.election.leader_address = named
            with ControlPlaneClient(f"{b.address},{a.address}", timeout_seconds=5) as c:
                assert c.stats().leader_address == a.address
    finally:
        for cp in (b, a):
            if cp is not None:
                cp.stop()


def test_a_replica_restarted_at_its_address_before_its_lease_ended_names_no_leader(etcd):
    """Restarted where it ran (a supervisor's restart), a replica found the leader key
    still naming its own address under the dead predecessor's lease: it named itself as
    the leader, and kvctl was sent back to it (FAILED_PRECONDITION, exit 1) until the lease
    ended. It names none: UNAVAILABLE, 'no control-plane leader at the moment'; then it leads."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    port = free_port()
    client = etcd_keys.connect(etcd)
    predecessor = client.lease(5)
    client.put(etcd_keys.LEADER_KEY, f"127.0.0.1:{port}", predecessor)  # as the one killed left it
    cp = ControlPlane(ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd, election_ttl_seconds=TTL)).start()
    try:
        wait_for(lambda: cp.election.epoch, 10, 0.05, "the key read")
        assert not cp.election.is_leader and cp.election.leader_address == ""
        with ControlPlaneClient(cp.address, timeout_seconds=5) as c, pytest.raises(ClientError) as info:
            c.stats()
        assert info.value.code == "UNAVAILABLE" and "no control-plane leader at the moment" in str(info.value)
        said = kvctl(cp.address, "stats", check=False)
        assert said.returncode != 0 and "no control-plane leader at the moment" in said.stderr, said.stderr
        wait_for(lambda: cp.election.is_leader, 20, 0.1, "it leads once the predecessor's lease ends")
    finally:
        cp.stop()
        client.close()


def _own_etcd_cluster(agent_id: str, election_ttl_seconds: int, history: int = 0, **agent_kwargs):
    """A private etcd (`history` keys written first: the first leader's epoch is above it),
    a control plane and an agent holding a 3-block prompt, indexed. -> (server, cp, agent,
    prompt, kv); the caller stops them (agent, cp, then server.cleanup())."""
    from agent.server import Agent, AgentConfig
    from controlplane.server import ControlPlane, ControlPlaneConfig

    server = EtcdServer().start()
    client = etcd_keys.connect(server.endpoint)
    for i in range(history):
        client.put(f"/other/{i}", "x")
    client.close()
    cp = ControlPlane(
        ControlPlaneConfig(
            listen="127.0.0.1:0", etcd=server.endpoint, election_ttl_seconds=election_ttl_seconds, metrics_listen=""
        )
    ).start()
    agent = Agent(
        AgentConfig(
            agent_id,
            listen="127.0.0.1:0",
            etcd=server.endpoint,
            stats_interval_seconds=0.2,
            metrics_listen="",
            **agent_kwargs,
        )
    ).start()
    kv = torch.zeros((3, *M.block_shape), dtype=torch.float16)
    prompt = list(range(3 * M.block_size))
    agent.engine.store(M.model_id, prompt, kv)
    with ControlPlaneClient(cp.address, timeout_seconds=10) as c:
        wait_for(lambda: c.lookup(M.model_id, prompt).agents, 10, 0.1, "indexed")
    return server, cp, agent, prompt, kv


def test_a_follower_naming_a_leader_that_is_gone_is_said_so(etcd):
    """kvctl said "cannot reach the kvcp control plane at <dead leader>; start one with
    make demo" though a replica had answered: it says which replica named which leader."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    b = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=TTL)).start()
    try:
        wait_for(lambda: b.election.is_leader, 10, 0.1, "b leads")
        b.election.run_once = lambda: False  # b stands still as a follower ...
        b.election.is_leader = False
        gone = f"127.0.0.1:{free_port()}"
        b.election.leader_address = gone  # ... naming a leader that has just died
        with ControlPlaneClient(b.address, timeout_seconds=5) as c, pytest.raises(ClientError) as info:
            c.stats()
        assert f"at {b.address} names {gone} as its leader, which cannot be reached" in str(info.value)
        assert "make demo" not in str(info.value)
    finally:
        b.stop()


def test_etcd_outage_reads_from_memory_rejects_writes_and_recovers():
    server, cp, agent, prompt, kv = _own_etcd_cluster("outage-agent", 3, lease_ttl_seconds=10)
    try:
        with ControlPlaneClient(cp.address, timeout_seconds=10) as c:
            server.proc.send_signal(signal.SIGSTOP)  # etcd stops answering
            # before the leader notices, a durable change waits on etcd for at most its call
            # timeout (2 s): kvctl's 5 s deadline sees the reason, not a timeout; the write
            # was sent, and a paused etcd may apply it when it resumes: "may have been applied"
            t0 = time.monotonic()
            with ControlPlaneClient(cp.address) as fresh, pytest.raises(ClientError) as early:
                fresh.pin(model_id=M.model_id, token_ids=prompt, ttl_seconds=60)
            assert (early.value.code == "UNKNOWN" and "may or may not have been applied" in str(early.value)) or (
                early.value.code == "UNAVAILABLE" and "etcd is unreachable" in str(early.value)
            ), early.value
            assert time.monotonic() - t0 < 5.0
            wait_for(lambda: cp.election.serving_from_memory, 15, 0.1, "control plane notices")
            res = c.lookup(M.model_id, prompt)
            assert res.best_agent_id == "outage-agent" and res.possibly_stale
            # blocks stored meanwhile reach the index as before: the agent reads etcd (for a
            # leader change) off its stream's loop, which waited out each read's 5 s timeout
            # (lags of 2.2 and 4.9 s in 8 stores before; 0-0.02 s after)
            for i in range(8):
                later = list(range(50_000 * (i + 1), 50_000 * (i + 1) + 2 * M.block_size))
                agent.engine.store(M.model_id, later, kv[:2])
                wait_for(lambda p=later: c.lookup(M.model_id, p).best_agent_id, 2.0, 0.02, "stored during the outage")
                time.sleep(0.4)
            routed = c.route(M.model_id, prompt, role="prefill")  # a read, as lookup, and flagged as lookup
            assert routed.prefill_agent_id == "outage-agent" and routed.possibly_stale
            # kvctl stats says it too (it printed a plain leader line)
            said = kvctl(cp.address, "stats").stdout
            assert "answering from memory: etcd unreachable, possibly stale" in said, said
            # and its pins: a leader elected meanwhile may hold pins this one does not
            assert c.list_pins().possibly_stale
            assert "possibly stale" in kvctl(cp.address, "pins").stdout
            as_json = kvctl(cp.address, "-o", "json", "pins")  # a list on stdout; the flag on stderr
            assert isinstance(json.loads(as_json.stdout), list) and "possibly stale" in as_json.stderr
            with pytest.raises(ClientError) as info:
                c.pin(model_id=M.model_id, token_ids=prompt, ttl_seconds=60)
            assert info.value.code == "UNAVAILABLE" and "etcd is unreachable" in str(info.value)
            assert info.value.kind == "EtcdUnreachable"  # what clients decide on, not the sentence
            # the agent keeps serving its engine throughout
            assert agent.engine.load(M.model_id, prompt).num_cached_tokens == len(prompt)
            server.proc.send_signal(signal.SIGCONT)
            wait_for(lambda: cp.election.is_leader, 20, 0.2, "recovered leadership")
            pin = wait_for(lambda: c.pin(model_id=M.model_id, token_ids=prompt, ttl_seconds=60), 10, 0.3, "pin works")
            assert pin.num_blocks == 3
            wait_for(lambda: not c.lookup(M.model_id, prompt).possibly_stale, 10, 0.2, "lookups fresh again")
            assert not c.list_pins().possibly_stale
            assert not c.route(M.model_id, prompt, role="prefill").possibly_stale
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)
        agent.stop()
        cp.stop()
        server.cleanup()


def test_a_client_given_every_replica_finds_the_new_leader_when_the_old_one_is_gone(etcd):
    """kvctl --endpoint A,B (and the dashboard, the same facade): the leader A dies; calls
    that cannot connect to A go on to B, which leads once A's election lease is gone."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    a = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=TTL)).start()
    b = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=TTL)).start()
    try:
        wait_for(lambda: a.election.is_leader, 10, 0.1, "a leads")
        with ControlPlaneClient(f"{a.address},{b.address}") as c:
            assert c.stats().leader_address == a.address
            a.stop(grace_seconds=0)
            stats = wait_for(lambda: _stats_or_none(c), TTL + 10, 0.2, "answered by the new leader")
            assert stats.leader_address == b.address and c.endpoint == b.address
            with pytest.raises(ClientError) as err:  # a replica that was never listed is not guessed
                ControlPlaneClient(a.address, timeout_seconds=1).stats()
            assert err.value.code == "UNAVAILABLE"
    finally:
        a.stop()
        b.stop()


def _stats_or_none(client):
    try:
        return client.stats() if client.stats().is_leader else None
    except ClientError:
        return None


def test_an_operation_right_after_a_failover_waits_for_the_agents_etcd_lists(replicas):
    """The new leader has no stream from an agent yet (here: paused through the
    failover). A move of its namespace must not succeed having done nothing: it is
    UNAVAILABLE naming the agent, and once the agent is back the same move does the work."""
    r = replicas
    r.start_pair()
    agent_port = free_port()
    agent = r.spawn(
        "agent",
        [
            script("kvcp-agent"),
            "--agent-id",
            "paused-agent",
            "--listen",
            f"127.0.0.1:{agent_port}",
            "--etcd",
            r.etcd,
            "--lease-ttl-seconds",
            "20",
            "--metrics-listen",
            "",
            "--transfer-engine",
            "none",
        ],
    )
    engine = EngineClient(f"127.0.0.1:{agent_port}")
    prompt = list(range(5 * M.block_size))
    with ControlPlaneClient(r.endpoint("cp-a")) as c:
        wait_for(lambda: engine.lookup(M.model_id, prompt) is not None, 30, 0.3, "agent serving")
        engine.store(M.model_id, prompt, bytes(5 * M.block_bytes), namespace="chat")
        wait_for(
            lambda: {a.agent_id: a.num_blocks for a in c.list_agents()}.get("paused-agent") == 5, 20, 0.2, "indexed"
        )
    engine.close()
    agent.send_signal(signal.SIGSTOP)
    try:
        r.procs["cp-a"].send_signal(signal.SIGKILL)
        wait_for(lambda: r.leader() == r.endpoint("cp-b"), TTL + 4, 0.05, "cp-b elected")
        refused = kvctl(r.endpoint("cp-b"), "move", "--namespace", "chat", "--to", "disk", check=False)
        assert refused.returncode != 0, refused.stdout
        assert "paused-agent" in refused.stderr and "not back" in refused.stderr
        # a prefix: the new leader does not know the model yet either (not "unknown model")
        tokens = ",".join(map(str, prompt))
        refused = kvctl(
            r.endpoint("cp-b"), "move", "--model", M.model_id, "--tokens", tokens, "--to", "disk", check=False
        )
        assert refused.returncode != 0 and "not back" in refused.stderr, refused.stderr
    finally:
        agent.send_signal(signal.SIGCONT)
    with ControlPlaneClient(r.endpoint("cp-b")) as c:
        wait_for(lambda: {a.agent_id: a.state for a in c.list_agents()}.get("paused-agent") == "ready", 20, 0.2, "back")
    done = kvctl(r.endpoint("cp-b"), "-o", "json", "move", "--namespace", "chat", "--to", "cpu", "--wait")
    op = json.loads(done.stdout)
    assert op["state"] == "SUCCEEDED" and op["num_total_blocks"] == 5, op


def test_kvctl_op_wait_rides_out_a_paused_leader(replicas):
    """`kvctl --endpoint A,B op ID --wait` while the leader A is paused (SIGSTOP): its
    polls time out, are asked of B, which leads once A's lease lapses, and the answer
    comes from there (before: the first timed-out poll ended kvctl with an error)."""
    r = replicas
    r.start_pair()
    with ControlPlaneClient(r.endpoint("cp-a")) as c:
        op = c.cleanup(older_than_seconds=3600, dry_run=True)
        op = c.wait_operation(op.op_id, 20)
        assert op.finished
    both = f"{r.endpoint('cp-a')},{r.endpoint('cp-b')}"
    r.procs["cp-a"].send_signal(signal.SIGSTOP)
    try:
        out = kvctl(both, "--timeout", "1", "-o", "json", "op", op.op_id, "--wait", "--wait-timeout", "30s")
        assert json.loads(out.stdout)["op_id"] == op.op_id
        assert r.leader() == r.endpoint("cp-b")
    finally:
        r.procs["cp-a"].send_signal(signal.SIGCONT)


def test_agents_follow_a_leader_of_an_etcd_that_lost_its_data(tmp_path):
    """etcd comes back empty (a new member, a restore from an old snapshot): its
    revisions start again, so the new leader's epoch is below the one agents saw. It is
    not a deposed leader (etcd names it, with that epoch): agents register with it and
    the index is rebuilt from them. Before, they refused it as deposed for good."""
    server, cp, agent, prompt, kv = _own_etcd_cluster(
        "reset-agent", 2, history=300, disk_dir=str(tmp_path / "disk"), disk_capacity_bytes=1 << 24, lease_ttl_seconds=3
    )
    try:
        with ControlPlaneClient(cp.address, timeout_seconds=10) as c:
            first = agent.link.highest_epoch
            assert first > 300
            pin = c.pin(model_id=M.model_id, token_ids=prompt, min_tier="disk", ttl_seconds=600)
            owner = etcd_keys.connect(server.endpoint)
            lease = owner.lease(600)
            tied = c.pin(namespace="kb", ttl_seconds=600, owner_lease_id=lease.id)
            c.set_policy({"cpu.high_watermark": "0.8", "cpu.low_watermark": "0.7", "quota.kb": "1GiB"})
            wait_for(lambda: set(agent.pool.pins.pins) == {pin.pin_id, tied.pin_id}, 10, 0.1, "pins applied")
            owner.close()
            server.stop()
            shutil.rmtree(os.path.join(server.data_dir, "data"))
            server.start()  # same address, no data
            wait_for(
                lambda: cp.election.is_leader and 0 < cp.election.epoch < first, 30, 0.2, "a leader in the new etcd"
            )
            wait_for(
                lambda: c.lookup(M.model_id, prompt).best_agent_id == "reset-agent",
                30,
                0.3,
                "index rebuilt from the agent",
            )

            def moved():  # a command of the new epoch is carried out, not refused as stale
                try:
                    op = c.move("disk", model_id=M.model_id, token_ids=prompt)
                except ClientError:  # e.g. agents not back yet after the takeover
                    return None
                op = c.wait_operation(op.op_id, 20)
                return op if op.state == "SUCCEEDED" else None  # e.g. the agent was reconnecting

            assert wait_for(moved, 40, 0.5, "a move after the reset").num_done_blocks == 3
            assert agent.link.highest_epoch == cp.election.epoch and agent.link.etcd_resets_total >= 1
            # the leader had served from memory through it: its pins and policy went back
            # into etcd (before, `kvctl pins` said "no pins" and agents lifted theirs)
            assert [p.pin_id for p in c.list_pins()] == [pin.pin_id]
            assert set(agent.pool.pins.pins) == {pin.pin_id}  # the lease-tied one went with its lease
            restored = etcd_keys.connect(server.endpoint)
            assert pin.pin_id.encode() in b"".join(k.key for _, k in restored.get_prefix(etcd_keys.PINS_PREFIX))
            restored.close()
            policy = c.get_policy()
            assert policy["cpu.high_watermark"] == "0.8" and policy["quota.kb"] == "1GiB"
            assert cp.manager.etcd_resets_total == 1
            assert cp.metrics.registry.get_sample_value("kvcp_etcd_data_lost_total") == 1
            said = [e.message for e in cp.manager.cluster.events.recent() if e.kind == "etcd_reset"]
            assert said and "restored 1 pin(s)" in said[0] and tied.pin_id in said[0]
    finally:
        if agent:
            agent.stop()
        if cp:
            cp.stop()
        server.cleanup()


def test_a_replica_back_after_another_loaded_in_the_emptied_etcd_restores_nothing():
    """The restore is for an etcd no leader has loaded since it lost its data. A replica
    that led before (paused, cut off) and wins after another leader loaded there (its
    mark, election/loaded) loads what etcd holds: it wrote its stale pins back over the
    newer ones before the mark."""
    from controlplane.server import ControlPlane, ControlPlaneConfig

    server = EtcdServer().start()
    cp = None
    try:
        client = etcd_keys.connect(server.endpoint)
        for i in range(300):  # the first leader's epoch is over 300
            client.put(f"/other/{i}", "x")
        client.close()
        cp = ControlPlane(
            ControlPlaneConfig(listen="127.0.0.1:0", etcd=server.endpoint, election_ttl_seconds=2, metrics_listen="")
        ).start()
        with ControlPlaneClient(cp.address, timeout_seconds=10) as c:
            wait_for(lambda: cp.manager.ready, 10, 0.1, "loaded")
            c.pin(namespace="old", ttl_seconds=600, pin_id="stale")
            c.set_policy({"cpu.high_watermark": "0.8", "cpu.low_watermark": "0.7"})
            server.stop()
            shutil.rmtree(os.path.join(server.data_dir, "data"))
            server.start()
            other = etcd_keys.connect(server.endpoint)  # another leader loaded here meanwhile
            other.put(etcd_keys.LOADED_KEY, json.dumps({"address": "b:1", "epoch": 1}))
            other.put(etcd_keys.PINS_PREFIX + "new/newer", "not a pin this test reads")
            wait_for(lambda: cp.manager.ready and cp.election.epoch < 300, 30, 0.2, "leading in the emptied etcd")
            assert c.list_pins() == [] and cp.manager.etcd_resets_total == 0
            assert other.get(etcd_keys.POLICY_KEY)[0] is None
            assert json.loads(other.get(etcd_keys.LOADED_KEY)[0])["epoch"] == cp.election.epoch  # its own mark now
            other.close()
    finally:
        if cp:
            cp.stop()
        server.cleanup()


def test_an_etcd_outage_longer_than_the_agents_lease_costs_no_resync():
    """Every agent lease ends during it: the agents, streaming all along, were dropped
    with their blocks when etcd came back, and each sent its whole inventory again (a
    resync storm at scale). They keep their blocks and register a new lease."""
    server, cp, agent, prompt, _ = _own_etcd_cluster("long-outage", 3, lease_ttl_seconds=2)
    try:
        with ControlPlaneClient(cp.address, timeout_seconds=10) as c:
            connections = agent.link.connections_total
            server.pause()
            time.sleep(5.0)  # > the lease's 2 s
            server.resume()
            deadline, answers = time.monotonic() + 8.0, 0
            while time.monotonic() < deadline:  # never forgotten meanwhile
                try:
                    found = c.lookup(M.model_id, prompt).best_agent_id
                except ClientError as exc:  # the leader's own lease ended too: it stands again
                    assert exc.code in ("FAILED_PRECONDITION", "UNAVAILABLE"), exc
                else:
                    assert found == "long-outage"
                    answers += 1
                time.sleep(0.1)
            assert answers > 20
            assert agent.link.connections_total == connections  # no new stream, no inventory
            live = etcd_keys.connect(server.endpoint)
            assert live.get(etcd_keys.agent_key("long-outage"))[0] is not None  # a new lease
            live.close()
    finally:
        agent.stop()
        cp.stop()
        server.cleanup()
