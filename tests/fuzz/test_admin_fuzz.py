"""Every AdminService call with hostile field values, against a live control plane (real
etcd, two real agents): empty, huge and wrongly sized fields, unknown enums, NaN and
infinite numbers, unicode garbage, repeated (duplicate) requests. The server keeps
answering, every error has an expected status code, and afterwards the index still
agrees with what the agents hold."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.api.admin_service import AdminServicer
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc
from tests.fuzz.support import (
    ENUM,
    FLOATS,
    FUZZ,
    TIERS,
    UINT32,
    UINT64,
    M,
    check_alive,
    check_code,
    check_consistent_with_agents,
    check_index,
    code_of,
    fields,
    kv,
    prefix_message,
    scopes,
    start_cluster,
    texts,
    tokens,
)
from tests.helpers import wait_for

CODECS = st.one_of(st.sampled_from(["", "none", "int8", "int4", "fp8", "zstd", "gzip", "INT8"]), texts())


def _implemented(method: str) -> bool:
    """Transfer and Route are in the contract before every build serves them."""
    return getattr(AdminServicer, method, None) is not getattr(admin_pb2_grpc.AdminServiceServicer, method)


def message(cls, valid: dict, hostile: dict) -> st.SearchStrategy:
    return fields(valid, hostile).map(lambda values: cls(**values))


def requests(live, policy: dict[str, str]):
    """(method name, request) for every unary AdminService call."""
    real_agent = st.sampled_from(live.agent_ids)
    any_agent = st.one_of(st.just(""), real_agent)
    policy_values = st.one_of(
        st.sampled_from(["0.5", "1", "0", "-1", "nan", "NaN", "inf", "-inf", "1e400", "true", "false", "zstd", ""]),
        texts(),
    )
    policy_keys = st.one_of(
        st.sampled_from(sorted(policy)),
        st.sampled_from(["quota.default", "quota.chat", "quota.", "quota.../x", "gpu.", "unknown"]),
        texts(),
    )
    by_method = {
        "ListAgents": st.just(admin_pb2.ListAgentsRequest()),
        "GetStats": st.just(admin_pb2.GetStatsRequest()),
        "GetPolicy": st.just(admin_pb2.GetPolicyRequest()),
        "Lookup": prefix_message(live, admin_pb2.LookupRequest),
        "Pin": message(
            admin_pb2.PinRequest,
            {"scope": scopes(live), "min_tier": st.sampled_from([0, 1, 2, 3]), "ttl_seconds": st.just(3600.0)},
            {"min_tier": ENUM, "ttl_seconds": FLOATS, "owner": texts("fuzzer"), "owner_lease_id": UINT64},
        ),
        "Unpin": st.builds(admin_pb2.UnpinRequest, pin_id=texts()),
        "ListPins": st.builds(admin_pb2.ListPinsRequest, namespace=texts("default", "chat")),
        "Move": message(
            admin_pb2.MoveRequest,
            {"scope": scopes(live), "to_tier": TIERS, "codec": st.sampled_from(["", "int8", "zstd"])},
            {"to_tier": ENUM, "codec": CODECS},
        ),
        "Cleanup": message(
            admin_pb2.CleanupRequest,
            {
                "older_than_seconds": st.sampled_from([0.0, 1.0, 3600.0]),
                "namespace": st.sampled_from(["", "chat", "legal-kb"]),
                "agent_id": any_agent,
                "model_id": st.sampled_from(["", M.model_id]),
                "dry_run": st.booleans(),
            },
            {
                "older_than_seconds": FLOATS,
                "namespace": texts(),
                "agent_id": texts("no-such-agent"),
                "model_id": texts("other-model"),
            },
        ),
        "Compress": message(
            admin_pb2.CompressRequest,
            {"scope": scopes(live), "codec": st.sampled_from(["int8", "zstd", "none"]), "tier": st.integers(0, 3)},
            {"codec": CODECS, "tier": ENUM},
        ),
        "GetOperation": st.builds(admin_pb2.GetOperationRequest, op_id=texts()),
        "ListOperations": st.builds(admin_pb2.ListOperationsRequest, max_operations=UINT32),
        "CancelOperation": st.builds(admin_pb2.CancelOperationRequest, op_id=texts()),
        "SetPolicy": st.builds(
            admin_pb2.SetPolicyRequest,
            values=st.one_of(
                st.dictionaries(policy_keys, policy_values, max_size=3),
                st.sampled_from(sorted(policy.items())).map(lambda kv: dict([kv])),  # valid: the current value
                st.sampled_from(["1KiB", "64MiB", "1e30", "-5MiB"]).map(lambda v: {"quota.fuzz": v}),
            ),
        ),
    }
    by_method["Drain"] = message(  # a drain that goes through cordons its agent: lifted at the end
        admin_pb2.DrainRequest,
        {"agent_id": real_agent, "model_id": st.sampled_from(["", M.model_id]), "reason": st.just("fuzz")},
        {
            "agent_id": texts("no-such-agent"),
            "to_agent_ids": st.lists(st.one_of(real_agent, texts()), max_size=3),
            "model_id": texts("other-model"),
            "deadline_seconds": FLOATS,
            "reason": texts("none"),
        },
    )
    if _implemented("Transfer"):
        by_method["Transfer"] = message(
            admin_pb2.TransferRequest,
            {"scope": scopes(live), "from_agent_id": real_agent, "to_agent_id": real_agent},
            {"from_agent_id": texts(), "to_agent_id": texts(), "deadline_seconds": FLOATS},
        )
    if _implemented("Route"):
        by_method["Route"] = prefix_message(
            live,
            admin_pb2.RouteRequest,
            {"role": st.sampled_from(["", "prefill", "decode", "pair"]), "prefill_agent_id": any_agent},
            {"role": texts("PAIR"), "prefill_agent_id": texts("no-such-agent")},
        )
    return st.sampled_from(sorted(by_method)).flatmap(lambda m: st.tuples(st.just(m), by_method[m]))


def test_every_admin_call_survives_hostile_input(controlplane, make_agent):
    live = start_cluster(controlplane, make_agent)
    policy = dict(live.admin.GetPolicy(admin_pb2.GetPolicyRequest(), timeout=10).values)
    seen_ops: list[str] = []
    seen_pins: list[str] = []
    codes: dict[str, set[str]] = {}

    @FUZZ
    @given(data=st.data())
    def run(data):
        method, request = data.draw(requests(live, policy), label="call")
        repeats = data.draw(st.integers(1, 2), label="repeats")  # a duplicate right behind
        # ids the server handed out earlier (drawn unconditionally: the draws never depend on state)
        use_known, pick = data.draw(st.booleans(), label="known id"), data.draw(st.integers(0, 1 << 20))
        known = {"Unpin": seen_pins, "GetOperation": seen_ops, "CancelOperation": seen_ops}.get(method)
        if use_known and known:
            setattr(request, "pin_id" if method == "Unpin" else "op_id", known[pick % len(known)])
        for _ in range(repeats):
            try:
                response = getattr(live.admin, method)(request, timeout=15)
            except grpc.RpcError as exc:
                check_code(method, exc.code(), exc.details())
                codes.setdefault(method, set()).add(exc.code().name)
                continue
            codes.setdefault(method, set()).add("OK")
            if method in ("Move", "Cleanup", "Compress", "Transfer", "Drain") and response.op_id not in seen_ops:
                seen_ops.append(response.op_id)
            if method == "Pin" and response.pin_id not in seen_pins:
                seen_pins.append(response.pin_id)
        check_alive(live)

    run()
    check_index(live)
    # the fuzzing got past validation: calls of several kinds that change or read state went through
    through = [m for m in ("Lookup", "Pin", "Move", "Cleanup", "Compress", "SetPolicy") if "OK" in codes.get(m, ())]
    assert len(through) >= 3, codes
    # a drain that went through cordoned its agent, which lookups then leave out
    uncordoned = {f"cordon.{agent_id}": "none" for agent_id in live.agent_ids}
    live.admin.SetPolicy(admin_pb2.SetPolicyRequest(values=uncordoned), timeout=10)
    check_consistent_with_agents(live)
    # and it still works for real traffic: a fresh prefix is found where it was stored, once
    # the policy is back to what it was (a fuzzed one may rightly evict never-read blocks,
    # and commands of its last pass may still be on their way: store again until they are)
    live.admin.SetPolicy(admin_pb2.SetPolicyRequest(values=policy), timeout=10)
    a1 = live.agents[0]
    fresh = tokens(3, start=700_000)
    live.prompts.append(fresh)

    def found_where_stored() -> bool:
        a1.engine.store(M.model_id, fresh, kv(3, seed=9))
        check_consistent_with_agents(live)
        best = live.admin.Lookup(admin_pb2.LookupRequest(model_id=M.model_id, token_ids=fresh), timeout=10)
        return best.best_agent_id == a1.agent_id and best.agents[0].num_hit_blocks == 3

    wait_for(found_where_stored, 15, 0.5, "a fresh prefix found on the agent that stored it")


@pytest.mark.parametrize(
    "method,request_",
    [
        ("Pin", admin_pb2.PinRequest(scope=admin_pb2.Scope(namespace="chat"), ttl_seconds=math.nan)),
        ("Pin", admin_pb2.PinRequest(scope=admin_pb2.Scope(namespace="chat"), ttl_seconds=math.inf)),
        ("Pin", admin_pb2.PinRequest(scope=admin_pb2.Scope(namespace="chat"), ttl_seconds=-math.inf)),
        ("Cleanup", admin_pb2.CleanupRequest(older_than_seconds=math.nan)),
        ("Cleanup", admin_pb2.CleanupRequest(older_than_seconds=math.inf)),
        ("Cleanup", admin_pb2.CleanupRequest(older_than_seconds=-math.inf)),
        ("Pin", admin_pb2.PinRequest(scope=admin_pb2.Scope(namespace="chat"), ttl_seconds=60, owner_lease_id=2**63)),
    ],
    ids=["ttl-nan", "ttl-inf", "ttl-neg-inf", "older-nan", "older-inf", "older-neg-inf", "lease-id-beyond-int64"],
)
def test_non_finite_and_out_of_range_numbers_are_invalid(controlplane, method, request_):
    with grpc.insecure_channel(controlplane.address) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        assert code_of(getattr(stub, method), request_) == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.ListPins(admin_pb2.ListPinsRequest(), timeout=10).pins == []
        assert stub.ListOperations(admin_pb2.ListOperationsRequest(), timeout=10).operations == []


@pytest.mark.skipif(not _implemented("Transfer"), reason="no handoff in this build")
@pytest.mark.parametrize("deadline", [math.nan, math.inf, -1.0])
def test_transfer_deadline_must_be_finite(controlplane, make_agent, deadline):
    a1, _ = make_agent("t-a1"), make_agent("t-a2")
    a1.engine.store(M.model_id, tokens(2), kv(2))
    with grpc.insecure_channel(controlplane.address) as ch:
        stub = admin_pb2_grpc.AdminServiceStub(ch)
        request = admin_pb2.TransferRequest(
            scope=admin_pb2.Scope(model_id=M.model_id, token_ids=tokens(2)),
            from_agent_id="t-a1",
            to_agent_id="t-a2",
            deadline_seconds=deadline,
        )
        assert code_of(stub.Transfer, request) == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.ListOperations(admin_pb2.ListOperationsRequest(), timeout=10).operations == []
