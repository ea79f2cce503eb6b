"""etcd with user and password (--etcd-user/--etcd-password-file): etcd keeps its simple
auth tokens in memory, so after it restarts every call with the token given before is
refused; the client logs in again (a review found the control plane never led again)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import grpc

from protos import etcd_keys
from protos.etcd_keys import EtcdAuth
from tests.helpers import free_port, wait_for
from tests.reliability.test_security import make_certs

PASSWORD = "pw-123456"


def _enable_auth(channel) -> None:
    from pyetcd.etcdrpc import rpc_pb2 as pb
    from pyetcd.etcdrpc import rpc_pb2_grpc as rpc

    auth = rpc.AuthStub(channel)
    auth.RoleAdd(pb.AuthRoleAddRequest(name="root"), timeout=5)
    auth.UserAdd(pb.AuthUserAddRequest(name="root", password=PASSWORD), timeout=5)
    auth.UserGrantRole(pb.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(pb.AuthEnableRequest(), timeout=5)


class TlsEtcd:
    """An etcd on TLS that can be stopped and started again on its data."""

    def __init__(self, tmp_path):
        self.ca, self.cert, self.key = make_certs(tmp_path)
        self.port, self.peer = free_port(), free_port()
        self.data = tempfile.mkdtemp(prefix="kvcp-auth-etcd-")
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"127.0.0.1:{self.port}"

    def start(self) -> TlsEtcd:
        client, peer = f"https://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", f"{self.data}/d",
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
             "--cert-file", str(self.cert), "--key-file", str(self.key)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return self

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(self.endpoint, grpc.ssl_channel_credentials(open(self.ca, "rb").read()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


def test_a_control_plane_with_an_etcd_user_leads_again_after_etcd_restarts(tmp_path):
    from controlplane.server import ControlPlane, ControlPlaneConfig

    server = TlsEtcd(tmp_path).start()
    cp = None
    try:

        def enabled() -> bool:
            with server.channel() as ch:
                _enable_auth(ch)
            return True

        wait_for(enabled, 15, 0.3, "auth enabled")
        auth = EtcdAuth(ca_file=str(server.ca), user="root", password=PASSWORD)
        cp = ControlPlane(
            ControlPlaneConfig(
                listen="127.0.0.1:0", etcd=server.endpoint, election_ttl_seconds=2, etcd_auth=auth, etcd_wait_seconds=15
            )
        ).start()
        wait_for(lambda: cp.election.is_leader, 10, 0.1, "the control plane leads")
        server.stop()  # an etcd outage: it restarts on its data, at its address
        wait_for(lambda: not cp.election.is_leader, 15, 0.1, "the outage noticed")
        server.start()
        wait_for(lambda: cp.election.is_leader, 20, 0.2, "leading again once etcd is back")
        cp.etcd.get(etcd_keys.LEADER_KEY)  # the data client too
    finally:
        if cp is not None:
            cp.stop()
        server.cleanup()
