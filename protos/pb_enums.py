"""Enum values for generated protobuf fields, for the gRPC layers and the client facade.

An enum field takes its value's number (protobuf checks it). The generated stubs (.pyi)
type it as the enum, a subclass of int there only, or a value's name: these tell the type
checker that the number is one, and return it unchanged. `protos.tier.Tier` equals
kvcp.v1.Tier value for value (tests/unit/test_tier.py).
"""

from __future__ import annotations

from typing import cast

from protos.kvcp.v1 import types_pb2


def tier_pb(value: int) -> types_pb2.Tier:
    return cast(types_pb2.Tier, int(value))


def agent_state_pb(value: int) -> types_pb2.AgentState:
    return cast(types_pb2.AgentState, int(value))
