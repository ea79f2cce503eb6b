"""Two data planes in this process, the receiver behind a real gRPC server on a free port
(no engine: the gRPC path): answers that must stay definite and on time, reservations
that must not outlive their handoff, and bad numbers refused with INVALID_ARGUMENT."""

from __future__ import annotations

import math
import time
from concurrent import futures

import grpc
import pytest

from agent.api.dataplane_service import DataPlaneServicer
from agent.core.block_pool import BlockPool
from agent.core.handoff import PRESENT, RECOMPUTE
from agent.dataplane import DataPlane, DataPlaneConfig
from agent.store.memory_tier import MemoryTier
from agent.store.transfer_engine import NoEngine
from protos.grpc_errors import ErrorMappingInterceptor
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2
from protos.tier import Tier
from tests.handoff.support import SMALL, prompt


def _pool() -> BlockPool:
    return BlockPool([MemoryTier(Tier.CPU, 64 * SMALL.block_bytes, SMALL.block_bytes // 4)], [SMALL])


class Pair:
    def __init__(self, sender_config: DataPlaneConfig | None = None):
        infos: dict[str, types_pb2.AgentInfo] = {}
        self.recv = DataPlane("dec", _pool(), NoEngine("none"), DataPlaneConfig(), peer_info=infos.get)
        self.send = DataPlane("pre", _pool(), NoEngine("none"), sender_config or DataPlaneConfig(), peer_info=infos.get)
        self.server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=[ErrorMappingInterceptor()])
        agent_pb2_grpc.add_DataPlaneServicer_to_server(DataPlaneServicer(self.recv, None), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        info = types_pb2.AgentInfo(agent_id="dec", address=f"127.0.0.1:{port}")
        self.recv.fill_info(info)
        infos["dec"] = info
        self.channel = grpc.insecure_channel(info.address)
        self.stub = agent_pb2_grpc.DataPlaneStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.send.close()
        self.recv.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def store(pool: BlockPool, n: int, seed: int = 0) -> list[bytes]:
    _, kv, hashes = prompt(SMALL, n, seed)
    pool.insert_chain(SMALL.model_id, hashes, lambda i: kv[i])
    return hashes


def test_a_prefix_the_destination_holds_leaves_no_reservation_open(pair):
    hashes = store(pair.send.pool, 4)
    store(pair.recv.pool, 4)
    pair.recv.reservations.max_inbound = 2
    for _ in range(4):  # more than max_inbound: none of them is left holding a slot
        r = pair.send.handoff(SMALL.model_id, hashes, "dec", 5.0, paths=("grpc",))
        assert r.outcome == PRESENT
    assert pair.recv.reservations.open_count() == 0
    assert all(pair.recv.pool.blocks[h].ref_count == 0 for h in hashes)


def test_an_unanswering_destination_still_gets_an_answer_by_the_deadline(pair, monkeypatch):
    hashes = store(pair.send.pool, 4)

    def stalled(_request):  # a destination that stops answering after the push (stopped, overloaded)
        time.sleep(3)

    monkeypatch.setattr(pair.recv, "commit", stalled)
    monkeypatch.setattr(pair.recv, "abort", stalled)
    t0 = time.monotonic()
    r = pair.send.handoff(SMALL.model_id, hashes, "dec", 1.0, paths=("grpc",))
    assert r.outcome == RECOMPUTE
    assert time.monotonic() - t0 < 1.3  # the abort it sends is not waited for


def test_a_paced_link_that_runs_out_of_time_says_so(tmp_path):
    p = Pair(DataPlaneConfig(link_bytes_per_second=100, grpc_chunk_bytes=16))
    try:
        hashes = store(p.send.pool, 4)
        r = p.send.handoff(SMALL.model_id, hashes, "dec", 0.6, paths=("grpc",))
        assert r.outcome == RECOMPUTE and "bandwidth limit" in r.reason
        assert r.attempts == 1  # not tried again: a second try would have even less time
        assert "checksum" not in r.reason and p.recv.reservations.checksum_failures_total == 0
    finally:
        p.close()


def reserve_request(hashes: list[bytes], ttl: float) -> agent_pb2.ReserveRequest:
    return agent_pb2.ReserveRequest(
        model_id=SMALL.model_id,
        block_hashes=b"".join(hashes),
        stored_bytes=[SMALL.block_bytes] * len(hashes),
        codecs=["none"] * len(hashes),
        ttl_seconds=ttl,
    )


@pytest.mark.parametrize("ttl", [math.inf, math.nan])
def test_a_reservation_ttl_must_be_finite(pair, ttl):
    hashes = store(pair.send.pool, 2)
    with pytest.raises(grpc.RpcError) as err:
        pair.stub.Reserve(reserve_request(hashes, ttl), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in err.value.details()
    assert pair.recv.reservations.open_count() == 0


def test_a_long_reservation_ttl_is_capped(pair):
    hashes = store(pair.send.pool, 2)
    resp = pair.stub.Reserve(reserve_request(hashes, 1e9), timeout=5)
    assert resp.expires_unix_seconds < time.time() + 601
    assert pair.recv.reservations.run_once(time.monotonic() + 601) == 1  # expired by the sweep
    assert pair.recv.reservations.open_count() == 0


@pytest.mark.parametrize("deadline", [math.inf, math.nan, -1.0])
def test_a_handoff_deadline_must_be_finite_and_not_negative(pair, deadline):
    hashes = store(pair.recv.pool, 2)
    request = agent_pb2.HandoffRequest(
        model_id=SMALL.model_id,
        block_hashes=b"".join(hashes),
        destination_agent_id="pre",
        deadline_seconds=deadline,
    )
    with pytest.raises(grpc.RpcError) as err:
        pair.stub.Handoff(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline_seconds" in err.value.details()
