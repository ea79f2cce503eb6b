"""EngineService servicer: the engine-facing API of an agent over gRPC (translation only)."""

from __future__ import annotations

import torch

from agent.core.engine_api import KVEngineAPI, blocks_per_message
from agent.core.model_spec import TORCH_DTYPES, ModelSpec
from protos import errors
from protos.kvcp.v1 import agent_pb2, agent_pb2_grpc


class EngineServicer(agent_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: KVEngineAPI):
        self._engine = engine

    def _tokens(self, request) -> list[int]:
        if not request.model_id:
            raise errors.InvalidArgument("model_id", "must not be empty")
        if not request.token_ids:
            raise errors.InvalidArgument("token_ids", "give at least one token id")
        return list(request.token_ids)

    def _model(self, request):
        """The agent's spec of the request's model; a caller that says its layout and says
        another one is refused (its bytes would be read in the wrong shape)."""
        model = self._engine.model(request.model_id)
        if request.HasField("spec"):
            s = request.spec
            if s.model_id and s.model_id != model.model_id:  # a spec of another model: its layout says nothing
                raise errors.InvalidArgument(
                    "spec.model_id", f"{s.model_id!r} is not the request's model_id {model.model_id!r}"
                )
            try:
                theirs = ModelSpec(model.model_id, s.block_size, s.num_layers, s.num_kv_heads, s.head_dim, s.dtype)
            except ValueError as exc:
                raise errors.InvalidArgument("spec", str(exc)) from None
            diff = model.differences(theirs)
            if diff:
                raise errors.FailedPrecondition(
                    f"spec: the caller's KV layout of {model.model_id} is not this agent's ({'; '.join(diff)})"
                )
        return model

    def Store(self, request, context):
        tokens = self._tokens(request)
        model = self._model(request)
        first = request.first_block
        n_blocks = len(tokens) // model.block_size - first
        if n_blocks < 0:
            raise errors.InvalidArgument("first_block", f"{first} is past the last full block")
        if len(request.kv) != n_blocks * model.block_bytes:
            raise errors.InvalidArgument(
                "kv", f"{len(request.kv)} bytes given, {n_blocks} blocks x {model.block_bytes} B expected"
            )
        raw = (
            torch.frombuffer(bytearray(request.kv), dtype=torch.uint8)
            if request.kv
            else torch.empty(0, dtype=torch.uint8)
        )
        kv = raw.view(TORCH_DTYPES[model.dtype]).reshape(n_blocks, *model.block_shape)
        result = self._engine.store(
            request.model_id,
            tokens,
            kv,
            first_block=first,
            extra_keys=tuple(request.extra_keys),
            namespace=request.namespace,
        )
        return agent_pb2.StoreResponse(
            num_stored_blocks=result.num_stored_blocks, num_present_blocks=result.num_present_blocks
        )

    def Lookup(self, request, context):
        tokens = self._tokens(request)
        self._model(request)  # a caller's other layout: refused, as its load would be
        n = self._engine.lookup(request.model_id, tokens, tuple(request.extra_keys))
        return agent_pb2.EngineLookupResponse(num_cached_tokens=n)

    def Load(self, request, context):
        tokens = self._tokens(request)
        model = self._model(request)
        fit = blocks_per_message(model.block_bytes)
        max_blocks = min(request.max_blocks, fit) if request.max_blocks else fit
        result = self._engine.load(
            request.model_id, tokens, tuple(request.extra_keys), first_block=request.first_block, max_blocks=max_blocks
        )
        raw = result.kv.contiguous().view(torch.uint8).numpy().tobytes() if result.kv.numel() else b""
        return agent_pb2.LoadResponse(num_cached_tokens=result.num_cached_tokens, kv=raw, truncated=result.truncated)
