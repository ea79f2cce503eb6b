"""The one place where kvcp error kinds become gRPC status codes (server side), and where a
client reads the kind back from an answer (`error_kind_of`).

Servicers raise `protos.errors.KvcpError` subclasses; `ErrorMappingInterceptor` turns
them into the matching status with the error's sentence as details, and turns any other
exception into INTERNAL without leaking a traceback to the caller (it is logged here).
A request whose bytes do not parse is INVALID_ARGUMENT (gRPC alone would say INTERNAL).
"""

from __future__ import annotations

import logging

import grpc

from protos import errors

log = logging.getLogger(__name__)

LEADER_METADATA_KEY = "kvcp-leader-address"
# the error's kind (its class name in protos.errors: EtcdUnreachable, NotConfigured, ...):
# clients decide on it, never on the wording of the sentence
ERROR_KIND_METADATA_KEY = "kvcp-error-kind"
# error sentences may quote the caller's input; details travel percent-encoded in trailing
# metadata, which clients cap (8 KiB soft, 16 KiB hard): a longer one reaches them as
# RESOURCE_EXHAUSTED instead of its own code. 2000 UTF-8 bytes encode to at most 6000.
MAX_DETAILS_BYTES = 2000


def error_kind_of(exc: grpc.RpcError) -> str:
    """The kvcp error kind a server named in its answer's trailing metadata (client side);
    "": none (gRPC's own error, or a server of no kvcp kind)."""
    trailing = getattr(exc, "trailing_metadata", None)
    return dict((trailing() if callable(trailing) else None) or ()).get(ERROR_KIND_METADATA_KEY, "")


_CODES: list[tuple[type[errors.KvcpError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # neither a refusal nor a success: the write may have been applied (kvctl prints the sentence)
    (errors.OutcomeUnknown, grpc.StatusCode.UNKNOWN),
]


def status_code_of(exc: errors.KvcpError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _bounded(details: str) -> str:
    raw = details.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return details
    return raw[: MAX_DETAILS_BYTES - 40].decode(errors="ignore") + f"... ({len(raw)} bytes in all)"


def _abort(context: grpc.ServicerContext, exc: Exception):
    if isinstance(exc, errors.KvcpError):
        metadata = [(ERROR_KIND_METADATA_KEY, type(exc).__name__)]
        if isinstance(exc, errors.NotLeader | errors.NoLeader):  # the leader it knows, maybe none
            metadata.append((LEADER_METADATA_KEY, exc.leader_address))
        context.set_trailing_metadata(tuple(metadata))
        context.abort(status_code_of(exc), _bounded(str(exc)))
    log.exception("internal error in RPC")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


class _Undecodable:
    """Stands in for a request message whose bytes do not parse (truncated, invalid UTF-8
    in a string field): gRPC itself would answer INTERNAL; it is the caller's bad input."""

    def __init__(self, exc: Exception):
        self.reason = f"{type(exc).__name__}: {exc}"


def _lenient(deserializer):
    if deserializer is None:
        return None

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed request
            return _Undecodable(exc)

    return parse


def _checked(request):
    if isinstance(request, _Undecodable):
        raise errors.InvalidArgument("request", f"the message is not valid protobuf ({request.reason})")
    return request


def _checked_stream(requests):
    for request in requests:
        yield _checked(request)


def _wrap_unary(behavior, streaming_request: bool = False):
    def handler(request, context):
        try:
            request = _checked_stream(request) if streaming_request else _checked(request)
            return behavior(request, context)
        except errors.KvcpError as exc:
            _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - last line of defence, logged in _abort
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, exc)

    return handler


def _wrap_stream(behavior, streaming_request: bool = False):
    def handler(request, context):
        try:
            request = _checked_stream(request) if streaming_request else _checked(request)
            yield from behavior(request, context)
        except errors.KvcpError as exc:
            _abort(context, exc)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, exc)

    return handler


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, streaming_request=True))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, streaming_request=True))
        return handler
