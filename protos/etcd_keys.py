"""The etcd side of the contract: key layout under the versioned root, and how a
process connects. Everything durable lives here; the block index never does.

    /kvcp/v1/agents/<agent_id>          AgentInfo (JSON), attached to the agent's lease
    /kvcp/v1/pins/<namespace>/<pin_id>  Pin
    /kvcp/v1/config/policy              Policy (tier settings, quota.<ns>, cordon.<agent_id>)
    /kvcp/v1/ops/<op_id>                Operation
    /kvcp/v1/opcommands/<op_id>/<agent_id>  the command an unfinished operation sent one
                                        agent (a next leader sends a lost one again); deleted at its end
    /kvcp/v1/election/leader            leader address, under the leader's lease;
                                        its create_revision is the epoch
    /kvcp/v1/locks/<name>               distributed locks
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

ROOT = "/kvcp/v1/"
AGENTS_PREFIX = ROOT + "agents/"
PINS_PREFIX = ROOT + "pins/"
POLICY_KEY = ROOT + "config/policy"
# keys of the policy's values that are not tier-policy settings: quota.<namespace>=<size>,
# cordon.<agent_id>=<reason> (kvctl cordon: no new work for that agent); either is lifted
# by one of POLICY_ENTRY_REMOVED (`kvctl policy set quota.legal-kb=none`)
QUOTA_POLICY_PREFIX = "quota."
CORDON_POLICY_PREFIX = "cordon."
POLICY_ENTRY_REMOVED = ("", "none")


def cordoned_agents(policy_values: dict[str, str]) -> dict[str, str]:
    """The cordoned agents a stored policy names: agent id -> reason (an empty reason, or
    none, as written in etcd by hand, is no cordon: SetPolicy takes those values as
    uncordoning). Read by the leader and by each agent (a handoff to a cordoned agent is
    refused at its source)."""
    return {
        k.removeprefix(CORDON_POLICY_PREFIX): v
        for k, v in policy_values.items()
        if k.startswith(CORDON_POLICY_PREFIX) and isinstance(v, str) and v not in POLICY_ENTRY_REMOVED
    }


OPS_PREFIX = ROOT + "ops/"
OP_COMMANDS_PREFIX = ROOT + "opcommands/"
LEADER_KEY = ROOT + "election/leader"
# written by each leader once it has loaded its state: an etcd without it holds no
# leader's state (new, or emptied), which is when a leader may restore its own from memory
LOADED_KEY = ROOT + "election/loaded"
LOCKS_PREFIX = ROOT + "locks/"


def agent_key(agent_id: str) -> str:
    return AGENTS_PREFIX + agent_id


def op_command_key(op_id: str, agent_id: str) -> str:
    """One agent's stored command of an operation (one key an agent: each fits an etcd
    request, the largest scope's block hashes included)."""
    return f"{OP_COMMANDS_PREFIX}{op_id}/{agent_id}"


def op_id_of_command_key(key: str) -> str:
    """The operation of a key under OP_COMMANDS_PREFIX: op_command_key's, or the one key an
    operation had before (`<op_id>`, all its agents' commands in one value)."""
    return key.removeprefix(OP_COMMANDS_PREFIX).split("/", 1)[0]


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' -> [(h1, 2379), (h2, 2379)]; ValueError naming the bad part."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {part!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def refresh_within(lease, ttl_seconds: float) -> int:
    """One keep-alive of `lease` (granted for `ttl_seconds`): its TTL left, or TimeoutError
    after that TTL, 2 s at least (the call goes on in its own thread). A keep-alive is a
    stream, and one was seen not to return at all while a TLS etcd with auth restarted,
    its deadline notwithstanding: an election step (and the lock it holds) or an agent's
    registration must not wait for it longer than a lease lives."""
    seconds = max(float(ttl_seconds), 2.0)
    done: list = []

    def run() -> None:
        try:
            done.append((True, lease.refresh()[0].TTL))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.append((False, exc))

    t = threading.Thread(target=run, name="etcd-keepalive", daemon=True)
    t.start()
    t.join(seconds)
    if not done:
        raise TimeoutError(f"etcd keep-alive did not return within {seconds:g} s")
    ok, value = done[0]
    if not ok:
        raise value
    return value


def is_unreachable(exc: BaseException) -> bool:
    """True when an etcd call failed because no endpoint answered (not a logic error)."""
    from pyetcd import exceptions as ex

    if isinstance(exc, ex.ConnectionFailedError | ex.ConnectionTimeoutError | ex.NoServerAvailableError):
        return True
    return isinstance(exc, ValueError) and "failed node" in str(exc)


NOSPACE_ADVICE = (
    "etcd is out of space (NOSPACE alarm: mvcc database space exceeded) and refuses writes until its "
    "history is compacted, its database defragmented and the alarm disarmed (etcdctl compact <revision>; "
    "etcdctl defrag; etcdctl alarm disarm), or its --quota-backend-bytes is raised"
)
TOO_LARGE_ADVICE = "the request is over etcd's size limit (--max-request-bytes, 1.5 MiB by default)"


def refusal_reason(exc: BaseException) -> str:
    """Why an etcd that answered refused the call, as a sentence for an operator ('' when
    the failure is something else: unreachable, a timeout, a bug)."""
    details = getattr(exc, "details", None)
    text = f"{details() if callable(details) else ''} {exc}"
    if "database space exceeded" in text:
        return NOSPACE_ADVICE
    if "request is too large" in text:
        return TOO_LARGE_ADVICE
    return ""


@dataclass(frozen=True)
class EtcdAuth:
    """TLS files and user/password for the etcd connection (all optional)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password: str = ""

    def problem(self) -> str:
        """Why these options cannot be used as given ("" when they can): a client
        certificate without the CA would quietly reach etcd in plain text."""
        if (self.cert_file or self.key_file) and not self.ca_file:
            return "--etcd-cert/--etcd-key need --etcd-ca (TLS to etcd)"
        if (self.user or self.password) and not self.ca_file:
            # gRPC sends no per-call credentials (etcd's auth token) over plain text: every
            # call would fail, and the wait end in "etcd is not reachable"
            return "--etcd-user/--etcd-password-file need --etcd-ca (etcd's auth token goes over TLS only)"
        return ""


ETCD_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _client(targets, timeout_seconds: float, auth: EtcdAuth):
    import grpc
    from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

    creds = None
    if auth.ca_file:
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(auth.ca_file), read(auth.key_file), read(auth.cert_file))
    # a failed endpoint is retried after 1 s (pyetcd's default waits 5 minutes), and the
    # channel reconnects at most 1 s apart: gRPC's own backoff (1 s, x1.6 a try, up to
    # 120 s) grows with an outage, and a control plane cut off for 18 s got etcd back only
    # 6-8 s after it answered again, refusing writes and losing its leadership meanwhile
    eps = [
        Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=1.0, opts=ETCD_CHANNEL_OPTIONS)
        for h, p in targets
    ]
    client = MultiEndpointEtcd3Client(
        endpoints=eps,
        timeout=timeout_seconds,
        user=auth.user or None,
        password=auth.password or None,
        failover=len(eps) > 1,
    )
    if auth.user and client.metadata:
        # pyetcd logs in once and keeps that token; etcd keeps its simple tokens in memory,
        # so after etcd restarts every call is "invalid auth token" for good: the token
        # is ours to replace (reauthenticate), the credentials reading it at each call
        token = _Token(dict(client.metadata)["token"])
        client.call_credentials = grpc.metadata_call_credentials(token)
        client.kvcp_token, client.kvcp_auth = token, auth
    return client


class _Token:
    """etcd's auth token as call credentials, read at each call (grpc.AuthMetadataPlugin)."""

    def __init__(self, value: str):
        self.value = value

    def __call__(self, context, callback) -> None:
        callback((("token", self.value),), None)


def invalid_token(exc: BaseException) -> bool:
    """Did etcd refuse the call's auth token (expired, or etcd restarted since it was given)?"""
    details = getattr(exc, "details", None)
    return "invalid auth token" in f"{details() if callable(details) else ''} {exc}"


def reauthenticate(client) -> bool:
    """Log in again with the client's user and password, and use the new token from the
    next call on; False for a client without them (or when etcd refuses)."""
    from pyetcd.etcdrpc import rpc_pb2

    token, auth = getattr(client, "kvcp_token", None), getattr(client, "kvcp_auth", None)
    if token is None or auth is None:
        return False
    try:
        resp = client.authstub.Authenticate(
            rpc_pb2.AuthenticateRequest(name=auth.user, password=auth.password), client.timeout
        )
    except Exception:  # noqa: BLE001 - etcd away or the user gone: the call's own error stands
        return False
    token.value = resp.token
    client.metadata = (("token", resp.token),)
    watcher = getattr(client, "_stubs", {}).get("watcher")
    if watcher is not None and hasattr(watcher, "_metadata"):  # a watch stream made again sends it
        watcher._metadata = client.metadata
    return True


def connect(
    endpoints: str, timeout_seconds: float = 5.0, wait_seconds: float = 0.0, log=print, auth: EtcdAuth | None = None
):
    """A pyetcd client over every endpoint (failing over between them). Waits up to
    `wait_seconds` for one to answer, saying so through `log`; raises ConnectionError
    with a sentence when none answers."""
    targets = parse_endpoints(endpoints)
    deadline = time.monotonic() + wait_seconds
    said = False
    while True:
        client = None
        try:
            client = _client(targets, timeout_seconds, auth or EtcdAuth())
            client.status()
            return client
        except Exception as exc:  # noqa: BLE001 - any failure means "try again"
            last_error = f"{type(exc).__name__}"
            if client is not None:
                client.close()
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"etcd is not reachable at {endpoints} ({last_error}); start etcd "
                f"(make demo does) or pass --etcd HOST:PORT"
            )
        if not said:
            log(f"waiting for etcd at {endpoints} ({last_error}) ...")
            said = True
        time.sleep(0.5)
