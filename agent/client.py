"""EngineClient: how an inference engine (or the demo workload) talks to an agent's
EngineService over gRPC: store computed KV, ask how much is cached, load it back."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc


@dataclass(frozen=True)
class Loaded:
    num_cached_tokens: int
    kv: bytes


class EngineClient:
    def __init__(self, address: str, timeout_seconds: float = 10.0):
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = grpc.insecure_channel(
            address,
            options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
        )
        self._stub = agent_pb2_grpc.EngineServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def store(
        self, model_id: str, token_ids, kv: bytes, first_block: int = 0, extra_keys=(), namespace: str = ""
    ) -> tuple[int, int]:
        r = self._stub.Store(
            agent_pb2.StoreRequest(
                model_id=model_id,
                token_ids=np.asarray(token_ids).tolist(),
                kv=kv,
                first_block=first_block,
                extra_keys=list(extra_keys),
                namespace=namespace,
            ),
            timeout=self.timeout_seconds,
        )
        return r.num_stored_blocks, r.num_present_blocks

    def lookup(self, model_id: str, token_ids, extra_keys=()) -> int:
        r = self._stub.Lookup(
            agent_pb2.EngineLookupRequest(model_id=model_id, token_ids=list(token_ids), extra_keys=list(extra_keys)),
            timeout=self.timeout_seconds,
        )
        return r.num_cached_tokens

    def load(self, model_id: str, token_ids, extra_keys=()) -> Loaded:
        r = self._stub.Load(
            agent_pb2.LoadRequest(model_id=model_id, token_ids=list(token_ids), extra_keys=list(extra_keys)),
            timeout=self.timeout_seconds,
        )
        return Loaded(r.num_cached_tokens, r.kv)
