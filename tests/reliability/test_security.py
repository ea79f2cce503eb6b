"""TLS on the listeners and bearer tokens with roles, against real servers: no token is
UNAUTHENTICATED, a viewer changing state is PERMISSION_DENIED, an operator may; agents
must present the agent token; plain clients cannot talk to a TLS listener."""

from __future__ import annotations

import subprocess
import time

import pytest

from agent.server import Agent, AgentConfig
from cli.client import ClientError, ControlPlaneClient
from controlplane.server import ControlPlane, ControlPlaneConfig
from protos.security import TLSConfig
from tests.e2e.test_console_scripts import kvctl
from tests.helpers import wait_for

VIEWER = "viewer-token-0123456789abcdef"
OPERATOR = "operator-token-0123456789abcdef"
AGENT = "agent-token-0123456789abcdef"


def make_certs(d):
    """A local CA and a certificate for 127.0.0.1/localhost signed by it (openssl)."""
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, cwd=d)  # noqa: E731
    run(
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=kvcp-test-ca",
    )
    run(
        "openssl",
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "openssl",
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return d / "ca.crt", d / "server.crt", d / "server.key"


@pytest.fixture
def secure_cluster(etcd, tmp_path):
    ca, cert, key = make_certs(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# role token\nviewer {VIEWER}\noperator {OPERATOR}\n")
    server_tls = TLSConfig(str(cert), str(key), str(ca))
    cp = ControlPlane(
        ControlPlaneConfig(
            listen="127.0.0.1:0",
            etcd=etcd,
            admin_tokens_file=str(tokens),
            agent_token=AGENT,
            tls=server_tls,
            metrics_listen="",
        )
    ).start()
    agent = Agent(
        AgentConfig(
            "secure-agent",
            listen="127.0.0.1:0",
            etcd=etcd,
            controlplane_token=AGENT,
            tls=server_tls,
            lease_ttl_seconds=3,
            stats_interval_seconds=0.2,
            metrics_listen="",
        )
    ).start()
    yield cp, agent, str(ca), tmp_path
    agent.stop()
    cp.stop()


def client(cp, ca, token=""):
    return ControlPlaneClient(cp.address, timeout_seconds=5, token=token, tls=TLSConfig(ca_file=ca))


def test_roles_and_tls(secure_cluster):
    cp, agent, ca, _ = secure_cluster
    with client(cp, ca, VIEWER) as c:
        wait_for(lambda: [a.agent_id for a in c.list_agents()] == ["secure-agent"], 15, 0.2, "agent over TLS + token")
        assert c.stats().num_agents == 1
        with pytest.raises(ClientError) as info:
            c.pin(namespace="kb", ttl_seconds=60)
        assert info.value.code == "PERMISSION_DENIED" and "operator" in str(info.value)
    with client(cp, ca) as c, pytest.raises(ClientError) as info:
        c.stats()
    assert info.value.code == "UNAUTHENTICATED"
    with client(cp, ca, "not-a-valid-token-at-all") as c, pytest.raises(ClientError) as info:
        c.stats()
    assert info.value.code == "UNAUTHENTICATED"
    with client(cp, ca, OPERATOR) as c:
        pin = c.pin(namespace="kb", ttl_seconds=60)
        assert [p.pin_id for p in c.list_pins()] == [pin.pin_id]
    # a plain-text client cannot talk to the TLS listener
    with ControlPlaneClient(cp.address, timeout_seconds=2, token=OPERATOR) as c, pytest.raises(ClientError):
        c.stats()


def test_agent_without_the_token_is_refused(secure_cluster, etcd):
    cp, _, ca, _ = secure_cluster
    stranger = Agent(
        AgentConfig(
            "stranger",
            listen="127.0.0.1:0",
            etcd=etcd,
            controlplane_token="wrong-token-xxxxxxxxxx",
            tls=TLSConfig(ca_file=ca),
            lease_ttl_seconds=3,
            metrics_listen="",
        )
    ).start()
    try:
        time.sleep(2.5)  # several connection attempts, each refused
        assert stranger.link.connections_total == 0
        with client(cp, ca, VIEWER) as c:
            assert "stranger" not in [a.agent_id for a in c.list_agents()]
    finally:
        stranger.stop()


def test_kvctl_with_token_file_and_ca(secure_cluster):
    cp, _, ca, tmp = secure_cluster
    tf = tmp / "viewer.token"
    tf.write_text(VIEWER + "\n")
    out = kvctl(cp.address, "--token-file", str(tf), "--tls-ca", ca, "-o", "json", "stats")
    assert '"num_agents"' in out.stdout
    denied = kvctl(
        cp.address, "--token-file", str(tf), "--tls-ca", ca, "pin", "--namespace", "kb", "--ttl", "1m", check=False
    )
    assert denied.returncode == 1 and "needs an operator token" in denied.stderr
    assert VIEWER not in denied.stderr + denied.stdout  # tokens are never echoed
