"""etcd out of space (its NOSPACE alarm, a real etcd with a 4 MiB quota): writes are
refused with the reason and what to do, not as "etcd is unreachable"; unpin still works;
a control plane that cannot be elected says why; an agent starting meanwhile serves its
engine and registers once etcd takes writes again."""

from __future__ import annotations

import pytest
import torch

from agent.server import DEMO_MODEL, Agent, AgentConfig
from benchmarks.etcd import EtcdServer
from cli.client import ClientError, ControlPlaneClient
from controlplane.server import ControlPlane, ControlPlaneConfig
from protos.etcd_keys import connect
from tests.helpers import wait_for

M = DEMO_MODEL


def _fill_until_nospace(client) -> None:
    blob = b"x" * (512 << 10)
    for i in range(64):
        try:
            client.put(f"/filler/{i}", blob)
        except Exception as exc:  # noqa: BLE001 - the alarm is what we wait for
            assert "database space exceeded" in str(exc), exc
            return
    raise AssertionError("etcd never ran out of space")


def _disarm(client) -> None:
    """What the refusal tells an operator to do: compact, defragment, disarm."""
    revision = client.delete_prefix("/filler/").header.revision
    client.compact(revision, physical=True)
    client.defragment()
    for alarm in list(client.list_alarms()):  # (member id 0 disarms none on etcd 3.5)
        client.disarm_alarm(alarm.member_id)


@pytest.fixture
def small_etcd():
    server = EtcdServer(extra_args=("--quota-backend-bytes", str(4 << 20))).start()
    yield server
    server.stop()
    server.cleanup()  # its data dir is in /dev/shm (memory) where there is one


def test_writes_refused_for_space_say_so_and_unpin_still_works(small_etcd):
    cp = ControlPlane(
        ControlPlaneConfig(listen="127.0.0.1:0", etcd=small_etcd.endpoint, election_ttl_seconds=3, metrics_listen="")
    ).start()
    raw = connect(small_etcd.endpoint)
    agents = []
    try:
        with ControlPlaneClient(cp.address, timeout_seconds=5) as c:
            wait_for(lambda: cp.election.is_leader and cp.manager.ready, 15, 0.1, "leader")
            pin = c.pin(namespace="kb", ttl_seconds=600)
            _fill_until_nospace(raw)
            with pytest.raises(ClientError) as info:
                c.pin(namespace="kb2", ttl_seconds=600)
            assert info.value.code == "RESOURCE_EXHAUSTED", info.value
            assert "out of space" in str(info.value) and "etcdctl alarm disarm" in str(info.value)
            assert "unreachable" not in str(info.value)
            with pytest.raises(ClientError) as info:
                c.set_policy({"cpu.high_watermark": "0.9"})
            assert info.value.code == "RESOURCE_EXHAUSTED"
            c.unpin(pin.pin_id)  # a delete: the way out of the alarm, still taken
            assert c.list_pins() == []
            assert c.stats().num_agents == 0  # reads are answered

        # a second control plane (a restart, a failover) cannot be elected: it says why
        cp.stop()
        cp2 = ControlPlane(
            ControlPlaneConfig(
                listen="127.0.0.1:0", etcd=small_etcd.endpoint, election_ttl_seconds=3, metrics_listen=""
            )
        ).start()
        try:
            with ControlPlaneClient(cp2.address, timeout_seconds=5) as c:
                wait_for(lambda: cp2.election.refusal, 15, 0.1, "the refusal noticed")
                with pytest.raises(ClientError) as info:
                    c.list_pins()
                assert info.value.code == "UNAVAILABLE" and "out of space" in str(info.value), info.value
                # an agent started meanwhile serves its engine, unregistered
                agent = Agent(
                    AgentConfig("nospace-agent", listen="127.0.0.1:0", etcd=small_etcd.endpoint, lease_ttl_seconds=3)
                ).start()
                agents.append(agent)
                assert agent.registration.lease is None
                kv_tokens = list(range(2 * M.block_size))
                agent.engine.store(M.model_id, kv_tokens, torch.zeros((2, *M.block_shape), dtype=torch.float16))
                assert agent.engine.load(M.model_id, kv_tokens).num_cached_tokens == len(kv_tokens)
                # space given back: the replica is elected, the agent registers, pins work again
                _disarm(raw)
                wait_for(lambda: cp2.election.is_leader, 20, 0.2, "elected once etcd takes writes")
                wait_for(lambda: agent.registration.lease is not None, 20, 0.2, "agent registered")
                wait_for(lambda: c.pin(namespace="kb3", ttl_seconds=60), 15, 0.3, "pins again")
        finally:
            cp2.stop()
    finally:
        for a in agents:
            a.stop()
        cp.stop()
        raw.close()
