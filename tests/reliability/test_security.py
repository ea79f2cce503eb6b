"""TLS on the listeners and bearer tokens with roles, against real servers: no token is
UNAUTHENTICATED, a viewer changing state is PERMISSION_DENIED, an operator may; agents
must present the agent token; plain clients cannot talk to a TLS listener."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch

from agent.core.engine_api import StoreResult
from agent.server import DEMO_MODEL as M
from agent.server import Agent, AgentConfig
from cli.client import ClientError, ControlPlaneClient
from controlplane.server import ControlPlane, ControlPlaneConfig
from protos.block_hash import hash_prefix, split_hashes
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
    # the three refusals above are counted (a scan with stolen or stale tokens shows)
    assert cp.metrics.registry.get_sample_value("kvcp_auth_denied_total") >= 3
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


def test_a_peer_handoff_needs_the_agent_token_and_non_ascii_tokens_are_refused(secure_cluster, etcd):
    """An agent's DataPlane (handoffs write into its memory) asks for the agent token:
    a caller without it is UNAUTHENTICATED, a peer agent with it hands off. A token with
    non-ASCII characters is refused, not an exception."""
    import grpc

    from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc
    from protos.security import TokenAuthInterceptor, channel

    cp, agent, ca, _ = secure_cluster
    tls = TLSConfig(ca_file=ca)
    for token in ("", "not-the-agent-token-xxxx"):
        stub = agent_pb2_grpc.DataPlaneStub(channel(agent.address, tls, token=token))
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(agent_pb2.AbortRequest(reservation_id="x"), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub = agent_pb2_grpc.DataPlaneStub(channel(agent.address, tls, token=AGENT))
    stub.Abort(agent_pb2.AbortRequest(reservation_id="x"), timeout=30)  # answered: nothing to abort
    peer = Agent(
        AgentConfig(
            "secure-peer",
            listen="127.0.0.1:0",
            etcd=etcd,
            controlplane_token=AGENT,
            tls=TLSConfig(*(agent.config.tls.cert_file, agent.config.tls.key_file, ca)),
            lease_ttl_seconds=3,
            metrics_listen="",
            transfer_engine="none",
        )
    ).start()
    try:
        toks = list(range(2 * M.block_size))
        peer.engine.store(M.model_id, toks, torch.zeros((2, *M.block_shape), dtype=torch.float16))
        hashes = split_hashes(hash_prefix(M.model_id, toks, M.block_size))
        result = peer.dataplane.handoff(M.model_id, hashes, "secure-agent", 10.0)
        assert result.outcome == "transferred", result.reason
        # the engine on the agent's host: over TLS, no token, it stores, loads and asks its
        # agent to hand a prefix off (an engine's request, not a peer's write)
        from agent.client import EngineClient

        engine = EngineClient(peer.address, tls=tls)
        try:
            more = list(range(5000, 5000 + 2 * M.block_size))
            kv = torch.ones((2, *M.block_shape), dtype=torch.float16)
            assert engine.store(M.model_id, more, kv.view(torch.uint8).numpy().tobytes()) == StoreResult(2, 0)
            assert engine.load(M.model_id, more).num_cached_tokens == 2 * M.block_size
            assert (
                engine.handoff(M.model_id, "secure-agent", token_ids=more, deadline_seconds=10).outcome == "transferred"
            )
        finally:
            engine.close()
    finally:
        peer.stop()
    auth = TokenAuthInterceptor({"é" * 20: "operator"}, "é" * 20)
    assert auth.check("/kvcp.v1.AdminService/GetStats", "e" * 20)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.check("/kvcp.v1.AgentService/Sync", "é" * 19 + "e")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.check("/kvcp.v1.AdminService/GetStats", "é" * 20) is None


def test_agents_and_the_control_plane_reach_an_etcd_that_speaks_only_tls(tmp_path):
    """Securing etcd must not leave agents out: they take the same etcd TLS options."""
    import shutil
    import tempfile

    from protos.etcd_keys import EtcdAuth
    from tests.helpers import free_port

    ca, cert, key = make_certs(tmp_path)
    port, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="kvcp-tls-etcd-")
    proc = subprocess.Popen(
        [
            "etcd", "--name", "t", "--data-dir", f"{data}/d",
            "--listen-client-urls", f"https://127.0.0.1:{port}", "--advertise-client-urls", f"https://127.0.0.1:{port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"t=http://127.0.0.1:{peer}", "--cert-file", str(cert), "--key-file", str(key),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint, auth = f"127.0.0.1:{port}", EtcdAuth(ca_file=str(ca))
    cp = agent = None
    try:
        cp = ControlPlane(
            ControlPlaneConfig(
                listen="127.0.0.1:0", etcd=endpoint, etcd_auth=auth, metrics_listen="", etcd_wait_seconds=15
            )
        ).start()
        agent = Agent(
            AgentConfig(
                "tls-etcd-agent",
                listen="127.0.0.1:0",
                etcd=endpoint,
                etcd_auth=auth,
                etcd_wait_seconds=15,
                lease_ttl_seconds=3,
                metrics_listen="",
            )
        ).start()
        with ControlPlaneClient(cp.address) as c:
            wait_for(lambda: [a.agent_id for a in c.list_agents()] == ["tls-etcd-agent"], 15, 0.2, "registered")
    finally:
        if agent:
            agent.stop()
        if cp:
            cp.stop()
        proc.terminate()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def test_an_agent_that_requires_client_certificates(secure_cluster, etcd):
    """`--tls-client-ca` on an agent: a peer or an engine without a certificate signed by
    that CA cannot reach it; with one, an engine stores and a peer hands off."""
    import grpc

    from agent.client import EngineClient

    cp, agent, ca, _ = secure_cluster
    cert, key = agent.config.tls.cert_file, agent.config.tls.key_file
    guarded = Agent(
        AgentConfig(
            "guarded-agent",
            listen="127.0.0.1:0",
            etcd=etcd,
            controlplane_token=AGENT,
            tls=TLSConfig(cert, key, ca),
            tls_client_ca=ca,
            lease_ttl_seconds=3,
            metrics_listen="",
            transfer_engine="none",
        )
    ).start()
    toks = list(range(2 * M.block_size))
    kv = torch.ones((2, *M.block_shape), dtype=torch.float16)
    try:
        anonymous = EngineClient(guarded.address, tls=TLSConfig(ca_file=ca), timeout_seconds=3)
        with pytest.raises(grpc.RpcError) as err:
            anonymous.store(M.model_id, toks, kv.view(torch.uint8).numpy().tobytes())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        anonymous.close()
        engine = EngineClient(guarded.address, tls=TLSConfig(cert, key, ca))
        assert engine.store(M.model_id, toks, kv.view(torch.uint8).numpy().tobytes()) == StoreResult(2, 0)
        engine.close()
        # a peer agent presents its certificate (its own TLS config) on its handoff
        hashes = split_hashes(hash_prefix(M.model_id, toks, M.block_size))
        result = guarded.dataplane.handoff(M.model_id, hashes, "secure-agent", 10.0)
        assert result.outcome == "transferred", result.reason
        more = list(range(9000, 9000 + 2 * M.block_size))
        agent.engine.store(M.model_id, more, kv)
        back = agent.dataplane.handoff(
            M.model_id, split_hashes(hash_prefix(M.model_id, more, M.block_size)), "guarded-agent", 10.0
        )
        assert back.outcome == "transferred", back.reason
    finally:
        guarded.stop()


ENGINE = "engine-token-0123456789abcdef"


def test_an_agent_with_an_engine_token_asks_it_of_engines_and_only_of_them(make_agent):
    """`--engine-token-file`: store, load, lookup and Handoff without the engine token are
    UNAUTHENTICATED and change nothing; with it they work; peers' DataPlane calls take the
    agent token, not the engine's (an agent with an engine token and no agent token is
    refused: its DataPlane let anyone write KV the engine then loaded), and health checks
    neither."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from agent.client import EngineClient
    from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc
    from protos.security import channel

    with pytest.raises(ValueError, match="without an agent token .* anyone can write blocks"):
        make_agent("open-peers", engine_token=ENGINE, transfer_engine="none")
    guarded = make_agent("guarded", engine_token=ENGINE, controlplane_token=AGENT, transfer_engine="none")
    peer = make_agent("peer", controlplane_token=AGENT, transfer_engine="none")
    toks = list(range(2 * M.block_size))
    kv = torch.ones((2, *M.block_shape), dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    for token in ("", "not-the-engine-token-xxxx", AGENT):
        stranger = EngineClient(guarded.address, timeout_seconds=10, token=token)
        try:
            for call, args in (
                (stranger.store, (M.model_id, toks, kv)),
                (stranger.lookup, (M.model_id, toks)),
                (stranger.load, (M.model_id, toks)),
                (stranger.handoff, (M.model_id, "peer", toks)),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(*args)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "engine token" in err.value.details()
        finally:
            stranger.close()
    assert guarded.engine.lookup(M.model_id, toks) == 0  # nothing was stored
    engine = EngineClient(guarded.address, timeout_seconds=10, token=ENGINE)
    try:
        assert engine.store(M.model_id, toks, kv) == StoreResult(2, 0)
        assert engine.lookup(M.model_id, toks) == 2 * M.block_size
        assert engine.load(M.model_id, toks).num_cached_tokens == 2 * M.block_size
        assert engine.handoff(M.model_id, "peer", token_ids=toks, deadline_seconds=10).outcome == "transferred"
    finally:
        engine.close()
    assert peer.engine.lookup(M.model_id, toks) == 2 * M.block_size
    # a peer's handoff into the guarded agent: the agent token's business, not the engine's
    more = list(range(7000, 7000 + M.block_size))
    peer.engine.store(M.model_id, more, torch.zeros((1, *M.block_shape), dtype=torch.float16))
    hashes = split_hashes(hash_prefix(M.model_id, more, M.block_size))
    assert peer.dataplane.handoff(M.model_id, hashes, "guarded", 10.0).outcome == "transferred"
    with channel(guarded.address) as ch:
        for token in ("", ENGINE):  # a stranger, or the engine, cannot write blocks as a peer
            meta = (("authorization", f"Bearer {token}"),) if token else ()
            with pytest.raises(grpc.RpcError) as err:
                agent_pb2_grpc.DataPlaneStub(ch).Abort(
                    agent_pb2.AbortRequest(reservation_id="x"), timeout=10, metadata=meta
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_kvcp_agent_takes_its_engine_token_from_a_file(tmp_path, etcd):
    """The console script: --engine-token-file guards the engine API of a real kvcp-agent;
    a file that cannot be read is a one-line error, exit 2."""
    import grpc

    from agent.client import EngineClient
    from tests.helpers import free_port, script

    out = subprocess.run(
        [script("kvcp-agent"), "--agent-id", "x", "--etcd", etcd, "--engine-token-file", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "cannot read token file" in out.stderr and "Traceback" not in out.stderr
    # an empty file (or a blank first line) asked for a token and gave none: it left the API open
    (tmp_path / "empty.token").write_text("\nsecret-on-line-two\n")
    (tmp_path / "engine.token").write_text(ENGINE + "\n")
    (tmp_path / "agent.token").write_text(AGENT + "\n")
    for flags, needle in (
        (["--engine-token-file", str(tmp_path / "empty.token")], "is empty (its first line is the token)"),
        (["--engine-token-file", str(tmp_path / "engine.token")], "without an agent token"),
    ):
        out = subprocess.run(
            [script("kvcp-agent"), "--agent-id", "x", "--etcd", etcd, "--transfer-engine", "none", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out
    port = free_port()
    argv = [script("kvcp-agent"), "--agent-id", "tok", "--listen", f"127.0.0.1:{port}", "--etcd", etcd]
    argv += ["--metrics-listen", "", "--transfer-engine", "none", "--engine-token-file", str(tmp_path / "engine.token")]
    argv += ["--token-file", str(tmp_path / "agent.token")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    toks = list(range(M.block_size))
    try:
        stranger = EngineClient(f"127.0.0.1:{port}", timeout_seconds=5)
        engine = EngineClient(f"127.0.0.1:{port}", timeout_seconds=5, token=ENGINE)
        wait_for(lambda: engine.lookup(M.model_id, toks) is not None, 60, what="the agent to serve")
        with pytest.raises(grpc.RpcError) as err:
            stranger.lookup(M.model_id, toks)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stranger.close()
        engine.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_agent_with_a_token_keeps_the_transfer_engines_open_port_off_unless_asked(make_agent, caplog):
    """The Mooncake engine's own port takes no token and reaches the whole CPU slab: a
    process without any token read an agent's KV through it and overwrote it (a review).
    With an agent token the agent starts without it, saying why; asked for it explicitly,
    it warns."""
    from agent.store.transfer_engine import open_engine

    guarded = make_agent("guarded", controlplane_token=AGENT)
    assert not guarded.dataplane.engine.available
    assert "takes none" in guarded.dataplane.engine.status
    probe = open_engine("mooncake")
    probe.close()
    if not probe.available:
        pytest.skip("the Mooncake Transfer Engine does not start here")
    with caplog.at_level("WARNING"):
        asked = make_agent("asked", controlplane_token=AGENT, transfer_engine="mooncake")
    assert asked.dataplane.engine.available
    assert "takes no token" in caplog.text
    assert make_agent("open").dataplane.engine.available  # no token: the engine, as before


def test_a_certificate_without_a_ca_never_sends_the_token_in_plain_text(tmp_path):
    """An agent given --tls-cert/--tls-key and no --tls-ca made plain-text channels: its
    agent token went in clear to whatever listened at the control plane's address (a
    review). With a certificate of its own the channel is TLS (the system's roots verify
    the server), so a plain listener hears no call."""
    from concurrent import futures

    import grpc

    from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc
    from protos.security import TLSConfig, add_port, channel

    ca, cert, key = make_certs(tmp_path)
    seen: list = []

    class Recorder(grpc.GenericRpcHandler):
        def service(self, details):
            seen.append(dict(details.invocation_metadata))
            return None

    plain = grpc.server(futures.ThreadPoolExecutor(1), handlers=[Recorder()])
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        ch = channel(f"127.0.0.1:{port}", TLSConfig(str(cert), str(key), ""), token=AGENT)
        with pytest.raises(grpc.RpcError):
            agent_pb2_grpc.AgentServiceStub(ch).Register(agent_pb2.RegisterRequest(), timeout=3)
        ch.close()
        assert not seen, seen
    finally:
        plain.stop(0)
    # a server asked for client certificates with none of its own: refused, not served plain
    server = grpc.server(futures.ThreadPoolExecutor(1))
    with pytest.raises(ValueError, match="client certificates"):
        add_port(server, "127.0.0.1:0", TLSConfig("", "", str(ca)), require_client_cert=True)
    server.stop(0)


def test_a_secret_file_others_may_read_is_used_with_a_warning(tmp_path, caplog):
    from protos.security import load_tokens, read_secret

    token, tokens = tmp_path / "token", tmp_path / "tokens"
    token.write_text(AGENT + "\n")
    tokens.write_text("operator o-token-0123456789abcdef\n")
    for path in (token, tokens):
        path.chmod(0o600)
    with caplog.at_level("WARNING"):
        assert read_secret(str(token)) == AGENT and load_tokens(str(tokens))
    assert "readable" not in caplog.text
    for path in (token, tokens):
        path.chmod(0o644)
    with caplog.at_level("WARNING"):
        read_secret(str(token))
        load_tokens(str(tokens))
    assert caplog.text.count("chmod 600") == 2


def test_a_lookup_socket_client_with_a_certificate_and_no_ca_never_sends_the_token_in_plain_text(tmp_path):
    """The lookup socket's client went plain when given its own certificate and no CA
    (client_ssl_context returned None), where the gRPC channel of the same facade speaks
    TLS verified by the system's roots: the admin token went in clear to whatever
    listened at the lookup address (a review). It now speaks TLS as the channel does."""
    import socket
    import threading

    from cli.client import LookupSocket
    from protos.kvcp.v1 import admin_pb2

    _, cert, key = make_certs(tmp_path)
    heard = bytearray()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def record():
        conn, _ = listener.accept()
        conn.settimeout(3)
        try:
            while chunk := conn.recv(65536):
                heard.extend(chunk)
        except OSError:
            pass
        finally:
            conn.close()

    t = threading.Thread(target=record, daemon=True)
    t.start()
    client = LookupSocket(f"127.0.0.1:{port}", OPERATOR, 2.0, TLSConfig(str(cert), str(key), ""))
    try:
        with pytest.raises(ClientError):
            client.call(admin_pb2.LookupRequest(model_id="m", token_ids=[1, 2, 3]))
    finally:
        client.close()
        listener.close()
    t.join(5)
    assert OPERATOR.encode() not in heard


def test_a_refused_call_is_not_parsed():
    """A unary call refused for its token had its message parsed all the same (the refusal's
    handler kept the method's deserializer): 64 MiB of empty extra_keys parse into ~1 GiB
    over ~4 s, and 128 server threads took that many at once from callers with no token (a
    review). The refusal now reads no message."""
    import grpc

    from protos.security import TokenAuthInterceptor

    parsed: list[bytes] = []

    def deserializer(raw: bytes):
        parsed.append(raw)
        return raw

    handler = grpc.unary_unary_rpc_method_handler(lambda r, c: r, deserializer, None)
    auth = TokenAuthInterceptor({OPERATOR: "operator"}, AGENT)
    for method in ("/kvcp.v1.AdminService/Lookup", "/kvcp.v1.AgentService/Register"):
        details = type("D", (), {"method": method, "invocation_metadata": ()})()
        denied = auth.intercept_service(lambda d: handler, details)
        assert denied is not handler
        # not None either: gRPC answers a message that parsed to None INTERNAL, not the refusal
        assert denied.request_deserializer(b"\x22\x00" * 1000) is not None
    assert not parsed
