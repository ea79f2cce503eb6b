"""DataPlane servicer: agent <-> agent handoff RPCs (translation only; agent.dataplane works)."""

from __future__ import annotations

from agent.core.engine_api import KVEngineAPI
from agent.dataplane import DataPlane, result_to_pb
from protos import errors
from protos.kv_format import MAX_HANDOFF_DEADLINE_SECONDS
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc


class DataPlaneServicer(agent_pb2_grpc.DataPlaneServicer):
    def __init__(self, dataplane: DataPlane, engine: KVEngineAPI):
        self._dp = dataplane
        self._engine = engine

    def Reserve(self, request, context):
        return self._dp.reserve(request)

    def Push(self, request_iterator, context):
        return self._dp.push(request_iterator)

    def Commit(self, request, context):
        if not request.reservation_id:
            raise errors.InvalidArgument("reservation_id", "must not be empty")
        return self._dp.commit(request)

    def Abort(self, request, context):
        self._dp.abort(request)
        return agent_pb2.AbortResponse()

    def Handoff(self, request, context):
        if not request.destination_agent_id:
            raise errors.InvalidArgument("destination_agent_id", "must not be empty")
        if not 0 <= request.deadline_seconds < float("inf"):  # also NaN
            raise errors.InvalidArgument("deadline_seconds", "must be finite and not negative")
        deadline_seconds = request.deadline_seconds
        remaining = context.time_remaining()
        if remaining is not None and deadline_seconds <= MAX_HANDOFF_DEADLINE_SECONDS:
            # no later than the caller's own deadline (less the answer's way back): one that
            # gave up left it holding a worker (waiting for a link, polling a busy peer)
            # until its deadline_seconds
            deadline_seconds = min(deadline_seconds or self._dp.config.deadline_seconds, max(0.001, remaining - 0.1))
        model = self._engine.model(request.model_id)
        if request.token_ids and request.block_hashes:
            raise errors.InvalidArgument("token_ids", "give token_ids or block_hashes, not both")
        if request.token_ids:
            hashes = self._engine.hashes(model, list(request.token_ids), tuple(request.extra_keys))
        else:
            if len(request.block_hashes) % 16:
                raise errors.InvalidArgument("block_hashes", "must be a multiple of 16 bytes")
            hashes = [request.block_hashes[i : i + 16] for i in range(0, len(request.block_hashes), 16)]
        if not hashes:
            raise errors.InvalidArgument("token_ids", f"fewer tokens than one block ({model.block_size})")
        result = self._dp.handoff(
            request.model_id,
            hashes,
            request.destination_agent_id,
            deadline_seconds,
            request.namespace,
            tuple(request.paths),
        )
        return result_to_pb(result)
