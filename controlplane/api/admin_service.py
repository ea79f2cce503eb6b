"""AdminService servicer: what kvctl and the dashboard call."""

from __future__ import annotations

import time

from controlplane.api import convert
from controlplane.core.cluster import Cluster
from protos import errors
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, cluster: Cluster, leadership, lookup_duration=None):
        self._cluster = cluster
        self._leadership = leadership
        # a prometheus Histogram (controlplane.metrics); None in tests that do not measure
        self._lookup_duration = lookup_duration

    def _require_leader(self) -> None:
        if not self._leadership.is_leader:
            raise errors.NotLeader(self._leadership.leader_address)

    def ListAgents(self, request, context):
        self._require_leader()
        return admin_pb2.ListAgentsResponse(
            agents=[convert.agent_status_to_pb(rec, n) for rec, n in self._cluster.agents()]
        )

    def Lookup(self, request, context):
        self._require_leader()
        start = time.perf_counter()
        result = self._cluster.lookup(
            request.model_id,
            token_ids=list(request.token_ids),
            block_hashes=request.block_hashes,
            extra_keys=tuple(request.extra_keys),
        )
        response = convert.lookup_to_pb(result)
        if self._lookup_duration is not None:
            self._lookup_duration.observe(time.perf_counter() - start)
        return response

    def GetStats(self, request, context):
        self._require_leader()
        resp = convert.stats_to_pb(self._cluster.stats())
        resp.leader_address = self._leadership.leader_address
        resp.epoch = self._leadership.epoch
        resp.is_leader = self._leadership.is_leader
        return resp
