"""The shared plumbing against real components: etcd requests timed and failures
counted against a real etcd (and a dead port), RPC status codes counted by a real
in-process control plane, the /metrics HTTP endpoint, and the console scripts' flag."""

from __future__ import annotations

import re
import socket
import subprocess
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from cli.client import ClientError, ControlPlaneClient
from controlplane.server import ControlPlane, ControlPlaneConfig
from protos.etcd_keys import ROOT, connect
from protos.metrics import EtcdMetrics, InstrumentedEtcd, parse_listen, serve_metrics
from tests.helpers import free_port, script, wait_for
from tests.metrics.prom import promtool


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return r.read().decode()


def test_etcd_requests_are_timed_and_failures_counted(etcd):
    registry = CollectorRegistry()
    metrics = EtcdMetrics(registry)
    client = InstrumentedEtcd(connect(etcd), metrics)
    try:
        lease = client.lease(5)
        client.put(ROOT + "m/a", "1", lease=lease)
        client.put(ROOT + "m/b", "2")
        assert client.get(ROOT + "m/a")[0] == b"1"
        assert len(list(client.get_prefix(ROOT + "m/"))) == 2
        lease.refresh()
        lease.refresh()
        won, _ = client.transaction(
            compare=[client.transactions.create(ROOT + "m/c") == 0],
            success=[client.transactions.put(ROOT + "m/c", "3")],
            failure=[],
        )
        assert won
        lease.revoke()
        client.delete_prefix(ROOT + "m/")
    finally:
        client.close()
    v = registry.get_sample_value
    counts = {
        op: v("kvcp_etcd_request_duration_seconds_count", {"op": op})
        for op in ("lease_grant", "put", "get", "get_prefix", "lease_refresh", "transaction", "lease_revoke")
    }
    assert counts == {
        "lease_grant": 1,
        "put": 2,
        "get": 1,
        "get_prefix": 1,
        "lease_refresh": 2,
        "transaction": 1,
        "lease_revoke": 1,
    }
    assert v("kvcp_etcd_request_duration_seconds_count", {"op": "delete_prefix"}) == 1
    assert v("kvcp_etcd_request_duration_seconds_count", {"op": "watch"}) == 0
    assert sum(v("kvcp_etcd_request_errors_total", {"op": op}) for op in counts) == 0

    # nothing listens on this port: the request fails and is counted as an error
    import pyetcd

    dead = InstrumentedEtcd(pyetcd.client(host="127.0.0.1", port=free_port(), timeout=1), metrics)
    with pytest.raises(Exception):  # noqa: B017 - pyetcd raises its own connection errors
        dead.get(ROOT + "x")
    dead.close()
    assert v("kvcp_etcd_request_errors_total", {"op": "get"}) == 1
    assert v("kvcp_etcd_request_duration_seconds_count", {"op": "get"}) == 2


def test_rpc_codes_are_counted_and_served_on_metrics_port(etcd):
    registry = CollectorRegistry()
    cp = ControlPlane(
        ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd, election_ttl_seconds=3, metrics_listen="127.0.0.1:0"),
        registry=registry,
    ).start()
    try:
        assert cp.metrics_address.startswith("127.0.0.1:") and cp.metrics_server.port > 0
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: c.stats().is_leader, what="leadership")
            with pytest.raises(ClientError):
                c.lookup("no-such-model", [1, 2, 3])
            with pytest.raises(ClientError):
                c.lookup("", [1])
        v = registry.get_sample_value
        admin = {"service": "kvcp.v1.AdminService"}
        assert v("kvcp_grpc_requests_total", {**admin, "method": "Lookup", "code": "NOT_FOUND"}) == 1
        assert v("kvcp_grpc_requests_total", {**admin, "method": "Lookup", "code": "INVALID_ARGUMENT"}) == 1
        assert v("kvcp_grpc_requests_total", {**admin, "method": "GetStats", "code": "OK"}) >= 1
        assert v("kvcp_lookup_duration_seconds_count") == 0  # failed lookups are not latencies
        assert v("kvcp_controlplane_is_leader") == 1
        assert v("kvcp_etcd_request_duration_seconds_count", {"op": "transaction"}) >= 1  # the election
        text = scrape(cp.metrics_address)
        assert 'kvcp_grpc_requests_total{code="NOT_FOUND",method="Lookup",service="kvcp.v1.AdminService"} 1.0' in text
        assert "process_cpu_seconds_total" in text and "_created" not in text
        check = promtool("check", "metrics", stdin=text)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        cp.stop()


def test_metrics_server_port_zero_busy_port_and_disabled():
    registry = CollectorRegistry()
    assert serve_metrics("", registry) is None
    first = serve_metrics("127.0.0.1:0", registry)
    try:
        assert first.port > 0 and first.url == f"http://127.0.0.1:{first.port}/metrics"
        said = []
        second = serve_metrics(first.address, registry, said.append)  # taken: falls back to a free port
        try:
            assert second.port not in (0, first.port)
            assert said and str(first.port) in said[0] and str(second.port) in said[0]
            scrape(second.address)
        finally:
            second.stop()
    finally:
        first.stop()
    with socket.socket() as s:  # stopped servers release their port
        s.bind(("127.0.0.1", first.port))
    for bad in ("9400", "host:port", "127.0.0.1:99999"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)


def test_controlplane_console_script_serves_metrics(etcd):
    port = free_port()
    proc = subprocess.Popen(
        [
            script("kvcp-controlplane"),
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            etcd,
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        text = wait_for(lambda: scrape(f"127.0.0.1:{port}"), 30, 0.2, "kvcp-controlplane /metrics")
        assert re.search(r"^kvcp_controlplane_is_leader 1\.0$", text, re.M)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert f"metrics on http://127.0.0.1:{port}/metrics" in err
    bad = subprocess.run(
        [script("kvcp-controlplane"), "--metrics-listen", "nowhere"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr
