"""Review of kvctl cordon: the policy keys cordon.<agent_id> share the policy with the
tier policy's settings and must not break it or mean something else elsewhere."""

from __future__ import annotations

from controlplane.core.cluster import Cluster
from controlplane.manager import Manager
from controlplane.manager_policy import validate_policy
from protos.tier import Tier
from tests.policy.test_policy_pass import chain
from tests.policy.test_policy_review import Clock, add_agent, drained


def test_the_tier_policy_pass_runs_while_an_agent_is_cordoned():
    """tier_policy() left out quota.* keys only: with a cordon.<agent_id> key in the policy,
    Policy.from_mapping refused it (unknown policy key), so every reconcile pass failed
    and no agent of the cluster was demoted or evicted while any agent was cordoned."""
    clock = Clock()
    cluster = Cluster(clock=clock)
    manager = Manager(cluster, durable=None, election=None, clock=clock, policy_validator=validate_policy)
    outbox = add_agent(cluster, "a", {Tier.CPU: (16, [chain(1, 8), chain(2, 8)])})
    add_agent(cluster, "b", {Tier.CPU: (16, [])})
    manager.policy = validate_policy({"cordon.b": "kernel upgrade"})
    assert manager.tier_policy().cpu.high_watermark < 1.0  # run_once asks it each pass (_urgent)
    assert manager.policy_pass(clock()) >= 1  # a is over its high watermark: the pass acts
    assert any(c.kind in ("evict", "move") for c in drained(outbox))


def test_a_stored_cordon_with_no_reason_cordons_nothing_anywhere():
    """A cordon.<agent_id> key with an empty value (written by hand in etcd; SetPolicy drops
    it) is no cordon by cordon_reason (Route, kvctl agents, the metric) and must not be
    one to Lookup either."""
    import numpy as np

    from controlplane.core.cluster import AgentRecord, BlockGroup, ModelInfo
    from protos.block_hash import ROOT_PARENT_HASH

    cluster = Cluster()
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")
    c = [np.random.default_rng(5).bytes(16) for _ in range(3)]
    cluster.register(AgentRecord("a", "a:1", [model], []))
    cluster.hello("a", "s")
    cluster.apply_inventory_chunk(
        "a", 0, 0, True, [BlockGroup("m", Tier.CPU, b"".join(c), ROOT_PARENT_HASH + b"".join(c[:-1]))]
    )
    manager = Manager(cluster, durable=None, election=None, policy_validator=validate_policy)
    manager.policy = validate_policy({"cordon.a": ""})
    assert cluster.cordon_reason("a") == ""
    assert [m.agent_id for m in cluster.lookup("m", block_hashes=b"".join(c)).matches] == ["a"]


def test_kvctl_cordon_refuses_a_reason_that_would_uncordon(monkeypatch):
    """`--reason ""` (or `none`) is the value SetPolicy takes as removing the key: kvctl
    cordon then uncordoned the agent and printed 'cordoned X (): no new work goes to it'."""
    from click.testing import CliRunner

    from cli import main as cli_main

    asked = []

    class FakeClient:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def cordon(self, agent_id, reason):
            asked.append(reason)
            return "" if reason in ("", "none") else reason  # as SetPolicy: the key dropped

    monkeypatch.setattr(cli_main.Context, "client", lambda self: FakeClient())
    for reason in ("", "none"):
        result = CliRunner().invoke(cli_main.main, ["cordon", "a1", "--reason", reason])
        assert result.exit_code == 2 and "--reason" in result.output, result.output
    assert asked == []


def test_kvctl_uncordon_that_took_says_so_when_the_drain_listing_fails(monkeypatch):
    """uncordon then lists operations to name a drain of the agent still running: a
    listing that failed (a failover, a timeout) exited 1 with the listing's error and no
    word of the uncordon, which had taken (a second try then says 'was not cordoned')."""
    from click.testing import CliRunner

    from cli import main as cli_main
    from cli.client import ClientError

    class FakeClient:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def uncordon(self, agent_id):
            return True

        def list_operations(self, *args, **kw):
            raise ClientError("UNAVAILABLE", "no leader: the control plane is electing one")

    monkeypatch.setattr(cli_main.Context, "client", lambda self: FakeClient())
    result = CliRunner().invoke(cli_main.main, ["uncordon", "a1"])
    assert result.exit_code == 0, result.output
    assert "uncordoned a1" in result.output and "no leader" in result.output, result.output
    result = CliRunner().invoke(cli_main.main, ["-o", "json", "uncordon", "a1"])
    assert result.exit_code == 0, result.output
    assert '"was_cordoned": true' in result.output and '"running_drains": null' in result.output, result.output
