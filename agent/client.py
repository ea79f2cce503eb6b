"""EngineClient: how an inference engine (or the demo workload) talks to an agent's
EngineService over gRPC: store computed KV, ask how much is cached, load it back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent.core.engine_api import ENGINE_MESSAGE_BYTES, StoreResult
from protos import security
from protos.block_hash import check_extra_keys, token_array
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc, types_pb2
from protos.security import TLSConfig

MAX_DEFAULT_HANDOFF_DEADLINE_SECONDS = 600.0  # the most an agent's --handoff-deadline-seconds may be


@dataclass(frozen=True)
class Loaded:
    num_cached_tokens: int
    kv: bytes
    truncated: bool = False  # more cached blocks follow: load again from the next block


@dataclass(frozen=True)
class Handoff:
    """The definite answer to a handoff: transferred | present | recompute (reason says why)."""

    outcome: str
    path: str
    num_blocks: int
    num_sent_blocks: int
    sent_bytes: int
    elapsed_seconds: float
    attempts: int
    reason: str
    num_cached_tokens: int


_OUTCOMES = {1: "transferred", 2: "present", 3: "recompute"}


class EngineClient:
    def __init__(self, address: str, timeout_seconds: float = 10.0, tls: TLSConfig | None = None, token: str = ""):
        """`tls`: the CA of an agent that serves TLS (`kvcp-agent --tls-cert`), and this
        engine's certificate where the agent wants one. `token`: the agent's engine token
        (`kvcp-agent --engine-token-file`), where it has one."""
        self.address = address
        self.timeout_seconds = timeout_seconds
        self._channel = security.channel(
            address,
            tls,
            options=[
                ("grpc.max_receive_message_length", ENGINE_MESSAGE_BYTES),
                ("grpc.max_send_message_length", ENGINE_MESSAGE_BYTES),
            ],
            token=token,
        )
        self._stub = agent_pb2_grpc.EngineServiceStub(self._channel)
        self._dataplane = agent_pb2_grpc.DataPlaneStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def store(
        self,
        model_id: str,
        token_ids,
        kv: bytes,
        first_block: int = 0,
        extra_keys=(),
        namespace: str = "",
        spec: types_pb2.ModelSpec | None = None,
    ) -> StoreResult:
        """Store blocks [first_block, ...) of `token_ids`; `spec`, when given, is checked
        against the agent's layout of the model. The same result as the in-process API's."""
        r = self._stub.Store(
            agent_pb2.StoreRequest(
                model_id=model_id,
                token_ids=np.asarray(token_ids).tolist(),
                kv=kv,
                first_block=first_block,
                extra_keys=list(extra_keys),
                namespace=namespace,
                spec=spec,
            ),
            timeout=self.timeout_seconds,
        )
        return StoreResult(r.num_stored_blocks, r.num_present_blocks)

    def lookup(self, model_id: str, token_ids, extra_keys=(), spec=None) -> int:
        """`spec`: the caller's KV layout (a types_pb2.ModelSpec), refused by an agent that
        holds the model in another (as a load refuses it)."""
        r = self._stub.Lookup(
            agent_pb2.EngineLookupRequest(
                model_id=model_id,
                token_ids=token_array(token_ids).tolist(),
                extra_keys=list(check_extra_keys(extra_keys)),
                spec=spec,
            ),
            timeout=self.timeout_seconds,
        )
        return r.num_cached_tokens

    def load(
        self,
        model_id: str,
        token_ids,
        extra_keys=(),
        first_block: int = 0,
        max_blocks: int = 0,
        spec: types_pb2.ModelSpec | None = None,
    ) -> Loaded:
        """Blocks [first_block, ...) of the cached prefix, as many as one message holds
        (or `max_blocks`); `truncated` says more follow."""
        r = self._stub.Load(
            agent_pb2.LoadRequest(
                model_id=model_id,
                token_ids=list(token_ids),
                extra_keys=list(extra_keys),
                first_block=first_block,
                max_blocks=max_blocks,
                spec=spec,
            ),
            timeout=self.timeout_seconds,
        )
        return Loaded(r.num_cached_tokens, r.kv, r.truncated)

    def handoff(
        self,
        model_id: str,
        destination_agent_id: str,
        token_ids=None,
        block_hashes: bytes = b"",
        extra_keys=(),
        deadline_seconds: float = 0.0,
        namespace: str = "",
        paths=(),
    ) -> Handoff:
        """Ask this agent to hand a prefix to another agent (prefill -> decode). The answer
        comes within the deadline (plus one RPC), whatever happens to the peer; with none
        (0), within the agent's own default (`--handoff-deadline-seconds`, at most 600 s),
        which this side does not know: it waits that long before calling the agent hung."""
        timeout = (deadline_seconds or MAX_DEFAULT_HANDOFF_DEADLINE_SECONDS) + 5.0
        r = self._dataplane.Handoff(
            agent_pb2.HandoffRequest(
                model_id=model_id,
                token_ids=np.asarray(token_ids).tolist() if token_ids is not None else [],
                block_hashes=block_hashes,
                extra_keys=list(extra_keys),
                destination_agent_id=destination_agent_id,
                deadline_seconds=deadline_seconds,
                namespace=namespace,
                paths=list(paths),
            ),
            timeout=timeout,
        )
        return Handoff(
            _OUTCOMES.get(r.outcome, "unknown"),
            r.path,
            r.num_blocks,
            r.num_sent_blocks,
            r.sent_bytes,
            r.elapsed_seconds,
            r.attempts,
            r.reason,
            r.num_cached_tokens,
        )
