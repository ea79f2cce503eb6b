"""The one place where kvcp error kinds become gRPC status codes (server side).

Servicers raise `protos.errors.KvcpError` subclasses; `ErrorMappingInterceptor` turns
them into the matching status with the error's sentence as details, and turns any other
exception into INTERNAL without leaking a traceback to the caller (it is logged here).
"""

from __future__ import annotations

import logging

import grpc

from protos import errors

log = logging.getLogger(__name__)

LEADER_METADATA_KEY = "kvcp-leader-address"

_CODES: list[tuple[type[errors.KvcpError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_code_of(exc: errors.KvcpError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: Exception):
    if isinstance(exc, errors.KvcpError):
        if isinstance(exc, errors.NotLeader):
            context.set_trailing_metadata(((LEADER_METADATA_KEY, exc.leader_address),))
        context.abort(status_code_of(exc), str(exc))
    log.exception("internal error in RPC")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _wrap_unary(behavior):
    def handler(request, context):
        try:
            return behavior(request, context)
        except errors.KvcpError as exc:
            _abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - last line of defence, logged in _abort
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, exc)

    return handler


def _wrap_stream(behavior):
    def handler(request, context):
        try:
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
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=_wrap_stream(handler.stream_stream))
        return handler
