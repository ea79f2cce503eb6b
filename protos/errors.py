"""Error kinds shared by every kvcp process. Core code raises these; one gRPC
interceptor per server (protos.grpc_errors) maps them to status codes, and clients turn
status codes back into a sentence. Messages are written for the person who reads them."""

from __future__ import annotations


class KvcpError(Exception):
    """Base class. `retryable` tells a caller whether trying again can help."""

    retryable = False


class InvalidArgument(KvcpError):
    """Bad input; `field` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(KvcpError):
    pass


class AlreadyExists(KvcpError):
    pass


class FailedPrecondition(KvcpError):
    pass


class NotLeader(FailedPrecondition):
    """This control-plane replica is not the leader; `leader_address` says who is."""

    retryable = True

    def __init__(self, leader_address: str):
        where = leader_address or "unknown (election in progress)"
        super().__init__(f"this control plane is not the leader; leader is at {where}")
        self.leader_address = leader_address


class Unavailable(KvcpError):
    """Refused, nothing changed (etcd unreachable, state still loading): try again later."""

    retryable = True


class OutcomeUnknown(KvcpError):
    """A durable change was sent but no answer came back in time (etcd paused or slow):
    it may or may not have been applied. Not retryable blindly: a retry could apply it
    twice; the caller checks by listing first."""


class ResourceExhausted(KvcpError):
    retryable = True
