"""Clients decide on the error's kind (trailing metadata `kvcp-error-kind`), not on its
wording: a control plane without etcd-backed pins and operations answers NotConfigured,
which a waiting client gives up on at once instead of polling until its deadline."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from cli.client import ClientError, ControlPlaneClient
from controlplane.api.admin_service import AdminServicer
from controlplane.core.cluster import Cluster
from protos.grpc_errors import ErrorMappingInterceptor
from protos.kvcp.v1 import admin_pb2_grpc


class Leading:
    is_leader, serving_from_memory, epoch, leader_address = True, False, 1, ""


@pytest.fixture
def bare_controlplane():
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[ErrorMappingInterceptor()])
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(Cluster(), Leading()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_lasting_refusal_is_told_by_its_kind(bare_controlplane):
    with ControlPlaneClient(bare_controlplane, timeout_seconds=2) as c:
        with pytest.raises(ClientError) as info:
            c.list_pins()
        assert info.value.code == "UNAVAILABLE" and info.value.kind == "NotConfigured"
        assert "runs without etcd-backed pins" in str(info.value)  # the sentence is for people
        start = time.monotonic()
        with pytest.raises(ClientError) as info:
            c.wait_operation("op-1", timeout_seconds=20)
        assert info.value.kind == "NotConfigured" and time.monotonic() - start < 2.0  # not polled for 20 s
        assert c.stats().num_agents == 0  # what needs no etcd is answered
