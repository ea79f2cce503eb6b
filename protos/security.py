"""Authentication and transport security, one place for every kvcp server and client.

- Bearer tokens on the admin API, two roles: `viewer` (read calls) and `operator`
  (everything). A tokens file has one `ROLE TOKEN` per line (`#` comments). No token:
  UNAUTHENTICATED; a viewer changing state: PERMISSION_DENIED.
- Agents authenticate to the control plane with a shared agent token (and to each other,
  on the calls that write into a peer's memory); an engine to its agent with the engine
  token, where the agent has one.
- TLS on listeners (server certificate and key; with a client CA, clients must present a
  certificate: mTLS) and on channels (the CA that signed the server).
Tokens are compared in constant time and never logged or exported as metrics.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import threading
from dataclasses import dataclass

import grpc

ROLES = ("viewer", "operator")
ADMIN_SERVICE = "/kvcp.v1.AdminService/"
AGENT_SERVICE = "/kvcp.v1.AgentService/"
# agent to agent: the calls that write into the receiver's memory take the agent token
# (Handoff, an engine asking its agent to send a prefix, is the engine's: not these)
PEER_METHODS = tuple(f"/kvcp.v1.DataPlane/{m}" for m in ("Reserve", "Push", "Commit", "Abort"))
# engine to its agent: store, load, lookup, and asking the agent to hand a prefix off;
# they take the engine token where the agent has one (kvcp-agent --engine-token-file)
ENGINE_METHODS = ("/kvcp.v1.EngineService/", "/kvcp.v1.DataPlane/Handoff")
READ_METHODS = frozenset(
    ADMIN_SERVICE + m
    for m in (
        "ListAgents",
        "Lookup",
        "GetStats",
        "ListPins",
        "GetOperation",
        "ListOperations",
        "GetPolicy",
        "Watch",
        "Route",
    )
)

log = logging.getLogger(__name__)


def _warn_if_readable_by_others(path: str) -> None:
    """A secret file others may read (group or world bits) works, with a warning."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077:
        log.warning("secret file %s is readable or writable by others (mode %o): chmod 600 it", path, mode & 0o777)


def read_secret(path: str = "", env: str = "") -> str:
    """A token from a file (first line) or an environment variable; '' when neither. A
    file given with an empty first line is an error: '' would leave the service open
    though a token was asked for."""
    if path:
        try:
            with open(path) as f:
                token = f.readline().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"token file {path} is empty (its first line is the token)")
        _warn_if_readable_by_others(path)
        return token
    return os.environ.get(env, "").strip() if env else ""


def load_tokens(path: str) -> dict[str, str]:
    """`ROLE TOKEN` lines -> {token: role}; ValueError naming the line when malformed."""
    tokens: dict[str, str] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise ValueError(f"cannot read tokens file {path}: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ROLES or len(parts[1]) < 16:
            raise ValueError(f"{path}:{n}: expected 'viewer|operator TOKEN' with a token of 16+ characters")
        tokens[parts[1]] = parts[0]
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    _warn_if_readable_by_others(path)
    return tokens


def bearer(metadata) -> str:
    for key, value in metadata or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return ""


def _unread(raw: bytes) -> bytes:
    """A refused call's message is not parsed: a caller without a token must not make the
    server spend memory and time on it (64 MiB of repeated fields parse into ~1 GiB).
    Not None: gRPC takes None for a message that failed to parse (INTERNAL)."""
    return b""


def _deny(handler, code: grpc.StatusCode, message: str):
    def abort(request, context):
        context.abort(code, message)

    def abort_stream(request, context):
        context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, _unread, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, _unread, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, _unread, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(abort_stream, _unread, handler.response_serializer)


def _same_secret(a: str, b: str) -> bool:
    """Constant-time comparison of two tokens as bytes (compare_digest refuses str with
    non-ASCII characters: a token of "é" raised instead of being refused)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Checks bearer tokens: admin tokens with roles on AdminService, the agent token on
    AgentService. A `None` table leaves that service open (the demo's default)."""

    def __init__(
        self,
        admin_tokens: dict[str, str] | None = None,
        agent_token: str = "",
        agent_services: tuple[str, ...] = (AGENT_SERVICE,),
        engine_token: str = "",
    ):
        """`agent_services`: the services that take the agent token (the control plane's
        AgentService; on an agent, its DataPlane, which peers call). `engine_token`: on an
        agent, asked of ENGINE_METHODS ('' leaves them open)."""
        self.admin_tokens = admin_tokens
        self.agent_token = agent_token
        self.agent_services = agent_services
        self.engine_token = engine_token
        self.denied_total = 0  # kvcp_auth_denied_total
        self._denied_lock = threading.Lock()

    def count_denial(self) -> None:
        with self._denied_lock:  # refusals come from many server threads at once
            self.denied_total += 1

    def check(self, method: str, token: str) -> tuple[grpc.StatusCode, str] | None:
        if method.startswith(ADMIN_SERVICE) and self.admin_tokens is not None:
            if not token:
                return grpc.StatusCode.UNAUTHENTICATED, (
                    "missing bearer token: pass kvctl --token-file FILE (or KVCTL_TOKEN)"
                )
            # every entry compared (no early exit): the time taken tells nothing of which matched
            matched = [r for t, r in self.admin_tokens.items() if _same_secret(t, token)]
            role = matched[0] if matched else None
            if role is None:
                return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"
            if role == "viewer" and method not in READ_METHODS:
                return grpc.StatusCode.PERMISSION_DENIED, (
                    f"role viewer may only read; {method.rsplit('/', 1)[-1]} needs an operator token"
                )
        elif self.agent_token and method.startswith(self.agent_services):
            if not token or not _same_secret(token, self.agent_token):
                return grpc.StatusCode.UNAUTHENTICATED, "agents must present the agent token (kvcp-agent --token-file)"
        elif self.engine_token and method.startswith(ENGINE_METHODS):
            if not token or not _same_secret(token, self.engine_token):
                return grpc.StatusCode.UNAUTHENTICATED, (
                    "engines must present the agent's engine token (EngineClient(token=...); kvcp-agent --engine-token-file)"
                )
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        denial = self.check(handler_call_details.method, bearer(handler_call_details.invocation_metadata))
        if denial is None:
            return handler
        self.count_denial()
        return _deny(handler, *denial)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class TLSConfig:
    """Files for one process: its certificate and key (a server, or an mTLS client), and
    the CA it trusts (to verify servers, or, on a server, to require client certs)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.ca_file)


def add_port(server: grpc.Server, address: str, tls: TLSConfig | None, require_client_cert: bool = False) -> int:
    """Listen plain, or with TLS when a certificate is configured. Client certificates
    asked for without one of its own are refused: they ride on TLS, and listening plain
    would serve anyone (the command lines refuse it too; this covers embedders)."""
    if require_client_cert and (tls is None or not tls.cert_file):
        raise ValueError("client certificates (a client CA) need this server's own --tls-cert and --tls-key")
    if tls is None or not tls.cert_file:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file) if tls.ca_file and require_client_cert else None,
        require_client_auth=bool(tls.ca_file and require_client_cert),
    )
    return server.add_secure_port(address, creds)


def channel(target: str, tls: TLSConfig | None = None, options=None, token: str = "") -> grpc.Channel:
    """A channel to a kvcp server: TLS when a CA or a certificate of ours is configured
    (with our certificate for mTLS when one is given; no CA: the system's roots verify the
    server), plain otherwise; `token`: sent as the bearer token of every call on it. (A
    certificate without a CA went plain, the agent token in clear: a review.)"""
    if tls is None or not (tls.ca_file or tls.cert_file or tls.key_file):
        ch = grpc.insecure_channel(target, options=options)
    else:
        creds = grpc.ssl_channel_credentials(
            _read(tls.ca_file) if tls.ca_file else None,
            _read(tls.key_file) if tls.key_file else None,
            _read(tls.cert_file) if tls.cert_file else None,
        )
        ch = grpc.secure_channel(target, creds, options=options)
    return grpc.intercept_channel(ch, _BearerToken(token)) if token else ch


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the bearer token to every call's metadata."""

    def __init__(self, token: str):
        self._metadata = token_metadata(token)

    def _with_token(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


def server_ssl_context(tls: TLSConfig | None, require_client_cert: bool = False) -> ssl.SSLContext | None:
    """For a plain-socket listener (the lookup socket): the gRPC listener's certificate and
    client-certificate rule; None without a certificate."""
    if tls is None or not tls.cert_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.ca_file and require_client_cert:
        ctx.load_verify_locations(tls.ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """For a plain-socket client: verify the server against the CA, or the system's roots
    when a certificate of ours comes without one (as channel() does: a certificate without
    a CA went plain, the bearer token in clear), and present our certificate for mTLS;
    None without any TLS file."""
    if tls is None or not (tls.ca_file or tls.cert_file or tls.key_file):
        return None
    try:
        ctx = ssl.create_default_context(cafile=tls.ca_file or None)
        if tls.cert_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file or None)
    except (OSError, ssl.SSLError) as exc:  # ValueError, as _read() raises for gRPC channels
        raise ValueError(f"cannot use {tls.ca_file or 'the system CAs'} / {tls.cert_file or '-'}: {exc}") from None
    return ctx


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()
