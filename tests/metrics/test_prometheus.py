"""The dashboard and the alerts against a real Prometheus.

A real etcd, an in-process control plane and two agents with /metrics on free ports
carry traffic (stores, lookups that hit and miss, bad requests, evictions), while Debian's
`prometheus` scrapes them every second with the jobs and rule file of the shipped
prometheus.yml. Then every PromQL expression of dashboard/grafana/kvcp.json and
alerts.yml must be valid and return at least one series (an alert's comparison is made
a `bool` one, since a healthy cluster fires nothing), every rule must evaluate, no alert
may fire, and `promtool check metrics` must pass on each process's /metrics."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from agent.metrics import HANDOFF_FAMILIES, VLLM_EVENT_COUNTERS
from agent.server import DEMO_MODEL, Agent, AgentConfig
from cli.client import ClientError, ControlPlaneClient
from controlplane.server import ControlPlane, ControlPlaneConfig
from tests.helpers import wait_for
from tests.metrics import prom

M = DEMO_MODEL
BS = M.block_size


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return r.read().decode()


class Traffic:
    """Requests as the demo workload makes them, until stopped: shared system prompts,
    per-request suffixes, a few unknown models; agents' small tiers keep evicting."""

    def __init__(self, cp: ControlPlane, agents: list[Agent]):
        self.cp, self.agents = cp, agents
        self.stop = threading.Event()
        self.requests = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self.run, name="traffic", daemon=True)

    def one(self, client: ControlPlaneClient, i: int) -> None:
        agent = self.agents[i % len(self.agents)]
        system = list(range(1000 * (i % 3), 1000 * (i % 3) + 3 * BS))  # 3 shared prefixes
        prompt = system + list(range(100_000 + i * 4 * BS, 100_000 + (i + 1) * 4 * BS))
        client.lookup(M.model_id, prompt)
        agent.engine.load(M.model_id, prompt)
        agent.engine.store(M.model_id, prompt, torch.zeros((len(prompt) // BS, *M.block_shape), dtype=torch.float16))
        agent.engine.lookup(M.model_id, prompt)
        if i % 5 == 0:
            try:
                client.lookup("no-such-model", prompt)
            except ClientError:
                pass

    def run(self) -> None:
        with ControlPlaneClient(self.cp.address) as client:
            i = 0
            while not self.stop.is_set():
                try:
                    self.one(client, i)
                    self.requests += 1
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(exc)
                i += 1
                self.stop.wait(0.05)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def cluster(etcd):
    cp = ControlPlane(
        ControlPlaneConfig(
            listen="127.0.0.1:0",
            etcd=etcd,
            election_ttl_seconds=3,
            membership_resync_seconds=0.5,
            metrics_listen="127.0.0.1:0",
        )
    ).start()
    agents = []
    try:
        for n in (1, 2):
            cfg = AgentConfig(
                agent_id=f"agent-{n}",
                listen="127.0.0.1:0",
                etcd=etcd,
                lease_ttl_seconds=3,
                stats_interval_seconds=0.2,
                cpu_capacity_bytes=24 * M.block_bytes,
                metrics_listen="127.0.0.1:0",
            )
            agents.append(Agent(cfg).start())
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: sum(a.state == "ready" for a in c.list_agents()) == 2, 20, 0.1, "two ready agents")
        yield cp, agents
    finally:
        for a in agents:
            a.stop()
        cp.stop()


def series_of(p: prom.Prometheus, expr: str) -> tuple[str, int]:
    """('' or the error, number of series)."""
    r = p.query(expr)
    if r.get("status") != "success":
        return f"{r.get('errorType')}: {r.get('error')}", 0
    return "", len(r["data"]["result"])


def test_every_dashboard_and_alert_expression_returns_series(cluster, tmp_path):
    cp, agents = cluster
    # every agent reports where its metrics are, through etcd and the control plane
    for a in agents:
        assert a.metrics_address and a.info().metrics_address == a.metrics_address
        assert cp.cluster.agent(a.agent_id).metrics_address == a.metrics_address

    # vLLM's event metrics exist only on agents started with --vllm-kv-events (none here):
    # their panel and rules are only checked for validity and for naming metrics the agent
    # exports; alerts_test.yml fires the rules
    queries = [(f"panel {t!r}", prom.substitute(e)) for t, e in prom.dashboard_queries()]
    rules = prom.rule_expressions()
    vllm_only = [(n, e) for n, e in queries + rules if "kvcp_vllm_" in e]
    assert vllm_only
    exported = {name for name, _, _ in VLLM_EVENT_COUNTERS} | {"kvcp_vllm_blocks_indexed_total"}
    unknown = {n: m for n, e in vllm_only for m in re.findall(r"kvcp_vllm_\w+", e) if m not in exported}
    assert not unknown, unknown
    # a sender's link fits exist once it has handed off to a peer (none here): checked
    # for validity and for naming metrics the agent exports
    link_only = [(n, e) for n, e in queries if "kvcp_link_" in e]
    assert link_only
    exported_links = {name for _, name, _, _ in HANDOFF_FAMILIES}
    assert {m for _, e in link_only for m in re.findall(r"kvcp_link_\w+", e)} <= exported_links
    vllm_only += link_only
    # GPU memory exists only on agents with a GPU tier (none here): checked for validity
    # and for naming the metric the agent exports (tests/metrics/test_agent_metrics.py)
    gpu_only = [(n, e) for n, e in queries if "kvcp_gpu_memory" in e]
    assert gpu_only
    assert {m for _, e in gpu_only for m in re.findall(r"kvcp_gpu_memory\w*", e)} == {"kvcp_gpu_memory_bytes"}
    vllm_only += gpu_only
    panels = [(n, e) for n, e in queries if (n, e) not in vllm_only]
    assert len(panels) >= 30 and len(rules) >= 10
    checks = panels + [(f"rule {n}", prom.with_bool(e)) for n, e in rules if (n, e) not in vllm_only]

    p = prom.Prometheus(
        tmp_path / "prometheus",
        {"kvcp-controlplane": [cp.metrics_address], "kvcp-agent": [a.metrics_address for a in agents]},
    )
    with Traffic(cp, agents) as traffic:
        p.start()
        try:
            # all three targets up, then every check has data (rate() needs two scrapes)
            wait_for(lambda: series_of(p, "sum(up) == 3")[1] == 1, 30, 0.5, "three targets up")
            missing = checks
            deadline = time.monotonic() + 30
            while missing and time.monotonic() < deadline:
                missing = [(name, expr) for name, expr in missing if series_of(p, expr)[1] == 0]
                if missing:
                    time.sleep(1)
            report = {name: (expr, *series_of(p, expr)) for name, expr in missing}
            assert not report, f"expressions without series (expr, error, n): {report}"
            for name, expr in checks:  # shown with pytest -rP
                print(f"{series_of(p, expr)[1]:4d} series  {name}: {expr}")

            # the alert expressions as written are valid too (empty while all is well)
            invalid = {n: series_of(p, e)[0] for n, e in rules + vllm_only if series_of(p, e)[0]}
            assert not invalid, invalid

            # the dashboard's variable lists the agents
            for name, query in prom.dashboard_variable_queries():
                metric, label = query.removeprefix("label_values(").removesuffix(")").split(", ")
                values = p.api(f"label/{label}/values", **{"match[]": metric})["data"]
                assert {"agent-1", "agent-2"} <= set(values), (name, values)

            # every rule was evaluated without error, and a healthy cluster fires no alert
            def rules_evaluated():
                groups = p.api("rules")["data"]["groups"]
                got = [r for g in groups for r in g["rules"]]
                return len(got) == len(rules) and all(r["health"] == "ok" for r in got) and got

            wait_for(rules_evaluated, 15, 0.5, "every rule evaluated with health ok")
            firing = p.api("alerts")["data"]["alerts"]
            assert not [a for a in firing if a["state"] == "firing"], firing
        finally:
            p.stop()
    # traffic only feeds the metrics; a rare failed request on a loaded machine is no failure of them
    assert traffic.requests > 10 and len(traffic.errors) <= traffic.requests // 10, traffic.errors[:3]

    # the exposition of each process passes promtool's checks
    for address in (cp.metrics_address, *(a.metrics_address for a in agents)):
        result = prom.promtool("check", "metrics", stdin=scrape(address))
        assert result.returncode == 0, (address, result.stdout, result.stderr)


def test_shipped_rules_and_config_pass_promtool():
    rules = prom.promtool("check", "rules", str(prom.RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    config = prom.promtool("check", "config", str(prom.PROMETHEUS_YML))
    assert config.returncode == 0, config.stdout + config.stderr


def test_alert_rules_fire_on_their_conditions():
    """promtool's rule unit tests: agent down, no leader (also with no replica scraped at
    all), transfer failures, a hit-ratio drop, a full tier and etcd errors fire, not before
    their `for:` and with the labels and sentences an operator reads; an agent out of sync
    fires on the leader's series only, never on a deposed replica's."""
    tests = [str(Path(__file__).with_name(name)) for name in ("alerts_test.yml", "alerts_long_test.yml")]
    result = prom.promtool("test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_with_bool_turns_the_top_level_comparison():
    assert prom.with_bool('up{job="a"} == 0') == 'up{job="a"} == bool 0'
    assert prom.with_bool("(sum(x) or vector(0)) < 1") == "(sum(x) or vector(0)) < bool 1"
    assert prom.with_bool("a / b > 0.95") == "a / b > bool 0.95"
    assert prom.with_bool("(a) < 0.5 * (b)") == "(a) < bool 0.5 * (b)"
    assert prom.with_bool('x{s=~"a|b"} >= 2') == 'x{s=~"a|b"} >= bool 2'
    assert prom.with_bool('max(x{s!="=="}) > bool 1') == 'max(x{s!="=="}) > bool 1'
    assert prom.with_bool("sum(rate(x[5m]))") == "sum(rate(x[5m]))"


def test_every_panel_of_a_control_plane_gauge_reads_the_serving_replica_only():
    """A deposed or follower replica keeps exporting the gauges it last knew (a policy
    pass's duration, agents, pins): a panel that does not filter by
    kvcp_controlplane_serving shows the stale value next to, or instead of, the leader's
    (the policy pass panel took max() over both replicas and showed the deposed one's)."""
    from controlplane.metrics import ClusterCollector

    own = {"kvcp_controlplane_serving", "kvcp_controlplane_is_leader", "kvcp_controlplane_serving_stale"}
    gauges = {
        name for name, family in ClusterCollector._families().items() if family.type == "gauge" and name not in own
    }
    unfiltered = {
        title: sorted(set(re.findall(r"kvcp_\w+", expr)) & gauges)
        for title, expr in prom.dashboard_queries()
        if set(re.findall(r"kvcp_\w+", expr)) & gauges and "kvcp_controlplane_serving == 1" not in expr
    }
    assert not unfiltered


def test_every_kvcp_metric_is_on_a_dashboard_panel(cluster):
    """What the processes export (a scrape of the control plane and both agents, plus the
    families an agent exports only once it indexes a vLLM engine or hands off to a peer)
    is each named by some panel of the Grafana dashboard: no metric only Prometheus shows."""
    cp, agents = cluster
    exported = set()
    for address in (cp.metrics_address, *(a.metrics_address for a in agents)):
        exported |= set(re.findall(r"^# TYPE (kvcp_\w+) ", scrape(address), re.M))
    exported |= {name for name, _, _ in VLLM_EVENT_COUNTERS} | {"kvcp_vllm_blocks_indexed_total"}
    exported |= {name for _, name, _, _ in HANDOFF_FAMILIES}
    exported |= {"kvcp_gpu_memory_bytes"}  # agents with a GPU tier only
    assert len(exported) > 60
    named = " ".join(e for _, e in prom.dashboard_queries())
    # a counter's TYPE line names it without _total; a histogram's without _bucket
    missing = sorted(m for m in exported if not re.search(rf"\b{m}(_total|_bucket|_sum|_count)?\b", named))
    assert not missing, f"metrics on no panel: {missing}"
