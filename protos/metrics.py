"""Prometheus plumbing shared by every kvcp process: the /metrics HTTP endpoint, etcd
request instrumentation and gRPC request counting.

Metric names are a contract with the Grafana dashboard and the alert rules in
`dashboard/grafana/`, like the wire format is with clients: they are defined here and in
`controlplane/metrics.py` and `agent/metrics.py`, nowhere else. Every process injects its
own `CollectorRegistry`, so tests read exact values and two in-process servers never
share counters. Conventions: prefix `kvcp_`, base units (`_seconds`, `_bytes`), `_total`
on counters, labels from small fixed sets (tier, agent_id, op, kind, state, code)."""

from __future__ import annotations

import errno
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily

from protos import errors, etcd_keys
from protos.grpc_errors import status_code_of

log = logging.getLogger(__name__)

# no `*_created` series: they double the series count and nothing here reads them
disable_created_metrics()

try:
    VERSION = importlib.metadata.version("kvcp")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    VERSION = "0+unknown"

# request latencies of a local service (etcd, an index lookup): 50 us .. 10 s
LATENCY_BUCKETS_SECONDS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
# long-running work (operations, transfers of many MiB): 1 ms .. 1 h
DURATION_BUCKETS_SECONDS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

ETCD_OPS = (
    "get",
    "get_prefix",
    "put",
    "delete",
    "delete_prefix",
    "transaction",
    "lease_grant",
    "lease_refresh",
    "lease_revoke",
    "watch",
    "status",
)
# pyetcd client method -> the `op` label it is counted under
_ETCD_METHOD_OPS = {
    "get": "get",
    "get_prefix": "get_prefix",
    "put": "put",
    "delete": "delete",
    "delete_prefix": "delete_prefix",
    "transaction": "transaction",
    "lease": "lease_grant",
    "refresh_lease": "lease_refresh",
    "revoke_lease": "lease_revoke",
    "add_watch_callback": "watch",
    "add_watch_prefix_callback": "watch",
    "status": "status",
}
# methods that return a lazy iterator: drained inside the timing so the request is measured
_ETCD_LAZY = {"get_prefix", "refresh_lease"}


class BuildInfoCollector:
    """`kvcp_build_info{component, version} 1`: which build each target runs."""

    def __init__(self, component: str, const_labels: Mapping[str, str] | None = None):
        self._labels = {**(const_labels or {}), "component": component, "version": VERSION}

    def collect(self):
        g = GaugeMetricFamily("kvcp_build_info", "kvcp build this process runs (always 1).", labels=list(self._labels))
        g.add_metric(list(self._labels.values()), 1)
        yield g

    def describe(self):
        yield GaugeMetricFamily(
            "kvcp_build_info", "kvcp build this process runs (always 1).", labels=list(self._labels)
        )


class EtcdMetrics:
    """Latency and failures of etcd requests by op, the same families in every process."""

    def __init__(self, registry: CollectorRegistry, const_labels: Mapping[str, str] | None = None):
        self._const = dict(const_labels or {})
        names = (*self._const, "op")
        self.duration = Histogram(
            "kvcp_etcd_request_duration_seconds",
            "Latency of etcd requests made by this process, by op (failed ones included).",
            names,
            registry=registry,
            buckets=LATENCY_BUCKETS_SECONDS,
        )
        self.errors = Counter(
            "kvcp_etcd_request_errors_total",
            "etcd requests that failed (unreachable, timeout, rejected) and watch streams that broke, by op.",
            names,
            registry=registry,
        )
        for op in ETCD_OPS:  # every op is a series from the start, so rate() and alerts see zeros
            self.duration.labels(**self._const, op=op)
            self.errors.labels(**self._const, op=op)

    def observe(self, op: str, seconds: float | None, ok: bool) -> None:
        if seconds is not None:
            self.duration.labels(**self._const, op=op).observe(seconds)
        if not ok:
            self.errors.labels(**self._const, op=op).inc()


class InstrumentedEtcd:
    """A pyetcd client whose requests are timed and whose failures are counted.

    Same interface as the client it wraps (attributes it does not time pass through).
    Leases it grants call back through it, so `lease.refresh()` is measured too."""

    def __init__(self, client, metrics: EtcdMetrics):
        self._client = client
        self._metrics = metrics

    @property
    def raw(self):
        return self._client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        op = _ETCD_METHOD_OPS.get(name)
        if op is None or not callable(attr):
            return attr
        metrics = self._metrics

        def call(*args, **kwargs):
            if op == "watch":
                args, kwargs = self._wrap_watch_callback(args, kwargs)
            start = time.perf_counter()
            try:
                try:
                    result = attr(*args, **kwargs)
                except Exception as exc:
                    # etcd restarted and forgot our login: log in again and try once more
                    if not (etcd_keys.invalid_token(exc) and etcd_keys.reauthenticate(self._client)):
                        raise
                    result = attr(*args, **kwargs)
                if name in _ETCD_LAZY:
                    result = list(result)
            except Exception:
                metrics.observe(op, time.perf_counter() - start, ok=False)
                raise
            metrics.observe(op, time.perf_counter() - start, ok=True)
            if name == "lease":
                result.etcd_client = self  # refresh/revoke of this lease go through us
            return result

        return call

    def _wrap_watch_callback(self, args, kwargs):
        """A watch reports a broken stream by calling back with an exception: count it."""

        def counted(callback):
            def on_event(response):
                if isinstance(response, Exception):
                    self._metrics.observe("watch", None, ok=False)
                return callback(response)

            return on_event

        if "callback" in kwargs:
            kwargs = {**kwargs, "callback": counted(kwargs["callback"])}
        elif len(args) >= 2:
            args = (args[0], counted(args[1]), *args[2:])
        return args, kwargs


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every served RPC by service, method and status code.

    Install it after `ErrorMappingInterceptor` (inner), so it sees kvcp error kinds
    before they become aborts. Methods the server does not implement are not counted,
    which keeps the `method` label to the fixed set of the protos."""

    def __init__(self, registry: CollectorRegistry, const_labels: Mapping[str, str] | None = None):
        self._const = dict(const_labels or {})
        self.requests = Counter(
            "kvcp_grpc_requests_total",
            "gRPC requests served, by service, method and status code (streams count when they end).",
            (*self._const, "service", "method", "code"),
            registry=registry,
        )

    def _count(self, service: str, method: str, code: str) -> None:
        self.requests.labels(**self._const, service=service, method=method, code=code).inc()

    @staticmethod
    def _code_of(exc: BaseException, context) -> str:
        if isinstance(exc, errors.KvcpError):
            return status_code_of(exc).name
        if isinstance(exc, GeneratorExit):
            return grpc.StatusCode.CANCELLED.name
        code = context.code() if hasattr(context, "code") else None
        return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode.INTERNAL.name

    @staticmethod
    def _ok_code(context) -> str:
        code = context.code() if hasattr(context, "code") else None
        return code.name if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK.name

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        count = self._count

        def unary(behavior):
            def wrapped(request, context):
                try:
                    response = behavior(request, context)
                except BaseException as exc:
                    count(service, method, self._code_of(exc, context))
                    raise
                count(service, method, self._ok_code(context))
                return response

            return wrapped

        def streaming(behavior):
            def wrapped(request, context):
                try:
                    yield from behavior(request, context)
                except BaseException as exc:
                    count(service, method, self._code_of(exc, context))
                    raise
                count(service, method, self._ok_code(context))

            return wrapped

        if handler.unary_unary:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=streaming(handler.stream_stream))
        return handler


class MetricsServer:
    """/metrics over HTTP for one registry, on a daemon thread."""

    def __init__(self, httpd, thread: threading.Thread, host: str):
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port = httpd.server_port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)


def parse_listen(listen: str) -> tuple[str, int]:
    """'127.0.0.1:9400' -> ('127.0.0.1', 9400); ValueError with a sentence otherwise."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics address {listen!r} is not HOST:PORT (example: 127.0.0.1:9400; port 0 picks one)")
    return host or "0.0.0.0", int(port)


def serve_metrics(
    listen: str, registry: CollectorRegistry, log_fn: Callable[[str], None] | None = None
) -> MetricsServer | None:
    """Serve `registry` at http://listen/metrics; '' serves nothing (returns None).

    Metrics must never keep a process from doing its job: when the port is taken
    (a second agent on the same host left at the default), it serves on a free port
    instead and says so; the bound address is reported in AgentInfo.metrics_address."""
    if not listen:
        return None
    host, port = parse_listen(listen)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if port == 0 or exc.errno != errno.EADDRINUSE:
            raise OSError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
        httpd, thread = start_http_server(0, addr=host, registry=registry)
        (log_fn or log.warning)(
            f"metrics port {listen} is in use; serving metrics on {host}:{httpd.server_port} instead "
            "(choose one with --metrics-listen)"
        )
    return MetricsServer(httpd, thread, host)
