"""Messages the servicers never see: bytes that do not parse as the request type (random,
truncated, invalid UTF-8 in a string field) sent to every AdminService and AgentService
method with raw stubs, and a message above the server's receive limit; and extra hash
keys past their cap, refused before they are hashed into every block."""

from __future__ import annotations

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.server import MAX_MESSAGE_BYTES
from protos.block_hash import MAX_EXTRA_KEYS_BYTES, MAX_PROMPT_TOKENS
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, agent_pb2, agent_pb2_grpc
from tests.fuzz.support import ALLOWED, FUZZ, M, code_of, tokens
from tests.helpers import wait_for

ADMIN = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
AGENT = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
# field 1 as a string whose bytes are not UTF-8 (where field 1 is a string); a length past the end
NOT_UTF8 = b"\x0a\x02\xff\xfe"
TRUNCATED = b"\x0a\x10ab"


def raw_call(channel: grpc.Channel, service, method, payload: bytes) -> grpc.StatusCode:
    path = f"/{service.full_name}/{method.name}"
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if method.client_streaming:
            call = channel.stream_stream(path, **identity) if method.server_streaming else None
            call = call or channel.stream_unary(path, **identity)
            result = call(iter([payload]), timeout=10)
        elif method.server_streaming:
            result = channel.unary_stream(path, **identity)(payload, timeout=2)
        else:
            result = channel.unary_unary(path, **identity)(payload, timeout=10)
        if method.server_streaming:
            for _ in result:
                break
            result.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_undecodable_requests_are_invalid_argument_everywhere(controlplane):
    with grpc.insecure_channel(controlplane.address) as ch:
        for service in (ADMIN, AGENT):
            for method in service.methods:
                first = method.input_type.fields_by_number.get(1)
                utf8_field = first is not None and first.type == first.TYPE_STRING
                for payload in (NOT_UTF8, TRUNCATED) if utf8_field else (TRUNCATED,):
                    code = raw_call(ch, service, method, payload)
                    if code == grpc.StatusCode.UNIMPLEMENTED:
                        continue  # in the contract, not served by this build yet
                    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{method.name} {payload!r}: {code.name}"


def test_random_bytes_never_get_an_unexpected_code(controlplane):
    methods = [(s, m) for s in (ADMIN, AGENT) for m in s.methods if m.name not in ("Watch",)]
    with grpc.insecure_channel(controlplane.address) as ch:

        @settings(FUZZ, max_examples=100)
        @given(target=st.sampled_from(methods), payload=st.binary(max_size=64))
        def run(target, payload):
            code = raw_call(ch, *target, payload)
            # random bytes often parse (as unknown fields): then it is a normal, maybe empty, request
            assert code in ALLOWED | {grpc.StatusCode.OK, grpc.StatusCode.UNIMPLEMENTED}, f"{target[1].name}: {code}"

        run()
        assert raw_call(ch, ADMIN, ADMIN.methods_by_name["GetStats"], b"") == grpc.StatusCode.OK


def test_a_message_over_the_receive_limit_is_resource_exhausted(controlplane):
    huge = admin_pb2.LookupRequest(model_id=M.model_id, block_hashes=b"\0" * (MAX_MESSAGE_BYTES + 16))
    with grpc.insecure_channel(controlplane.address) as ch:
        lookup = ch.unary_unary("/kvcp.v1.AdminService/Lookup", request_serializer=lambda r: r.SerializeToString())
        try:
            lookup(huge, timeout=30)
            raise AssertionError("a message over the limit was accepted")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        # and the server still answers
        stats = ch.unary_unary("/kvcp.v1.AdminService/GetStats", request_serializer=lambda r: r.SerializeToString())
        stats(admin_pb2.GetStatsRequest(), timeout=10)


def test_an_error_quoting_huge_input_keeps_its_code(controlplane):
    """Error sentences quote the input; a 300 kB id must still come back as NOT_FOUND, not as
    the client's RESOURCE_EXHAUSTED for oversized trailing metadata."""
    with grpc.insecure_channel(controlplane.address) as ch:
        get = ch.unary_unary(
            "/kvcp.v1.AdminService/GetOperation",
            request_serializer=lambda r: r.SerializeToString(),
            response_deserializer=admin_pb2.Operation.FromString,
        )
        for op_id in ("n" * 300_000, "\U0001f600" * 100_000):
            try:
                get(admin_pb2.GetOperationRequest(op_id=op_id), timeout=10)
                raise AssertionError("an unknown operation was found")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()[:200]
                assert len(exc.details().encode()) <= 2000


def test_extra_keys_past_their_cap_are_refused_before_hashing(controlplane, make_agent):
    """Each block's digest hashes the extra keys again: one 70,000-character key made a
    Lookup of 2^20 tokens take 11-14 s, 300,000 characters 46 s, and the server went on
    hashing after the caller's deadline (the admin fuzz drew one: two DEADLINE_EXCEEDED
    in a row on a loaded CI machine). Keys past MAX_EXTRA_KEYS_BYTES (as hashed: each
    key's UTF-8 and 4 bytes) are INVALID_ARGUMENT on every call that hashes tokens, the
    control plane's and an agent's engine API, and a prompt at both caps is answered."""
    agent = make_agent("keys-a1")
    at_cap = ["k" * (MAX_EXTRA_KEYS_BYTES - 4)]
    over = ["k" * (MAX_EXTRA_KEYS_BYTES - 3)]
    small = tokens(1)
    with grpc.insecure_channel(controlplane.address) as ch, grpc.insecure_channel(agent.address) as ach:
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        engine = agent_pb2_grpc.EngineServiceStub(ach)

        def lookup(token_ids, keys, timeout=10.0) -> grpc.StatusCode:
            request = admin_pb2.LookupRequest(model_id=M.model_id, token_ids=token_ids, extra_keys=keys)
            return code_of(admin.Lookup, request, timeout)

        wait_for(lambda: lookup(small, at_cap) == grpc.StatusCode.OK, 20, 0.1, "the agent's model known")
        scope = admin_pb2.Scope(model_id=M.model_id, token_ids=small, extra_keys=over)
        refused = [
            (admin.Lookup, admin_pb2.LookupRequest(model_id=M.model_id, token_ids=small, extra_keys=over)),
            (
                admin.Lookup,
                admin_pb2.LookupRequest(
                    model_id=M.model_id, token_ids=small, extra_keys=[""] * (MAX_EXTRA_KEYS_BYTES // 4 + 1)
                ),
            ),
            (admin.Route, admin_pb2.RouteRequest(model_id=M.model_id, token_ids=small, extra_keys=over)),
            (admin.Pin, admin_pb2.PinRequest(scope=scope, ttl_seconds=60)),
            (admin.Move, admin_pb2.MoveRequest(scope=scope, to_tier=2)),
            (admin.Compress, admin_pb2.CompressRequest(scope=scope, codec="int8")),
            (engine.Lookup, agent_pb2.EngineLookupRequest(model_id=M.model_id, token_ids=small, extra_keys=over)),
            (engine.Load, agent_pb2.LoadRequest(model_id=M.model_id, token_ids=small, extra_keys=over)),
        ]
        for call, request in refused:
            try:
                call(request, timeout=10)
                raise AssertionError(f"{type(request).__name__}: extra keys past the cap were taken")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (type(request).__name__, exc.details())
                assert "extra_keys" in exc.details() and str(MAX_EXTRA_KEYS_BYTES) in exc.details(), exc.details()
        assert admin.ListPins(admin_pb2.ListPinsRequest(), timeout=10).pins == []
        assert admin.ListOperations(admin_pb2.ListOperationsRequest(), timeout=10).operations == []
        # what the fuzz drew, within its deadline: refused, not hashed for most of a minute
        most = [2**32 - 1] * MAX_PROMPT_TOKENS
        assert lookup(most, ["n" * 300_000], timeout=15) == grpc.StatusCode.INVALID_ARGUMENT
        assert lookup(most, at_cap, timeout=15) == grpc.StatusCode.OK  # hashing: 0.77 s (0.24 s without keys)
