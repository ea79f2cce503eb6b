"""Error kinds shared by every kvcp process. Core code raises these; one gRPC
interceptor per server (protos.grpc_errors) maps them to status codes and sends the
kind's class name in trailing metadata (`kvcp-error-kind`), which clients decide on (retry,
wait, give up); the sentence is written for the person who reads it, never parsed."""

from __future__ import annotations


class KvcpError(Exception):
    """Base class. Whether trying again can help is told by the kind (Unavailable and its
    kinds, NotLeader, ResourceExhausted: later or elsewhere; the rest: no)."""


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


class FillLimitReached(FailedPrecondition):
    """A drain's handoff refused by its destination: its blocks would take the tiers they
    land in past the line the drain was given (where the tier policy starts dropping
    blocks), the room taken since by other handoffs. The drain sends it no more."""


class NotLeader(FailedPrecondition):
    """This control-plane replica is not the leader; `leader_address` says who is."""

    def __init__(self, leader_address: str):
        where = leader_address or "unknown (election in progress)"
        super().__init__(f"this control plane is not the leader; leader is at {where}")
        self.leader_address = leader_address


class Unavailable(KvcpError):
    """Refused, nothing changed (etcd unreachable, state still loading): try again later."""


class EtcdUnreachable(Unavailable):
    """etcd did not answer: a durable change (pin, unpin, policy, operation) was refused
    and not applied; reads are answered from memory meanwhile."""


class NotConfigured(Unavailable):
    """This control plane runs without what the call needs (etcd-backed pins and
    operations): a lasting answer, not worth waiting for."""


class NoLeader(Unavailable):
    """No replica leads at the moment (an election in progress, or the leader key still
    names a predecessor at this very address, gone with its lease not yet ended)."""

    def __init__(self, why: str = "") -> None:
        super().__init__(
            f"no control-plane leader at the moment: {why}"
            if why
            else "no control-plane leader at the moment (an election is in progress: it takes up to the "
            "election TTL); try again"
        )
        self.leader_address = ""


def not_leader(leader_address: str, why_no_leader: str = "") -> KvcpError:
    """What a replica that does not lead answers: the leader's address to follow, or, when
    it knows of no reachable leader, UNAVAILABLE (retry later) rather than a leader of '',
    with the reason no replica can be elected when it knows one (etcd out of space)."""
    return NotLeader(leader_address) if leader_address else NoLeader(why_no_leader)


class OutcomeUnknown(KvcpError):
    """A durable change was sent but no answer came back in time (etcd paused or slow):
    it may or may not have been applied. Not retryable blindly: a retry could apply it
    twice; the caller checks by listing first."""


class ResourceExhausted(KvcpError):
    """Over a limit (a quota, a queue): try again later or ask for less."""
