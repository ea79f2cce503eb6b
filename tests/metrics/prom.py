"""A real Prometheus for the tests (Debian's `prometheus` binary), `promtool`, and the
PromQL that kvcp ships: every query of the Grafana dashboard and every alert rule."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.helpers import REPO, free_port

GRAFANA_DIR = REPO / "dashboard" / "grafana"
DASHBOARD = GRAFANA_DIR / "kvcp.json"
RULES = GRAFANA_DIR / "alerts.yml"
PROMETHEUS_YML = GRAFANA_DIR / "prometheus.yml"

# Grafana fills these in before a query reaches Prometheus; the tests do the same.
# 1m holds several samples at the tests' 1 s scrape interval (rate() needs two).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$agent": ".*"}


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run scripts/bootstrap.sh (apt-get install -y prometheus)")
    return path


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=300)


def _panels(panels):
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel, rows included."""
    dash = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in _panels(dash["panels"]) for t in p.get("targets", []) if t.get("expr")]


def dashboard_variable_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(variable, query) of the dashboard's query variables: label_values(metric, label)."""
    dash = json.loads(path.read_text())
    out = []
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((v["name"], q))
    return out


def rule_expressions(path: Path = RULES) -> list[tuple[str, str]]:
    """(alert or record name, PromQL) of every rule in the rules file."""
    doc = yaml.safe_load(path.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    if "$" in expr:
        raise AssertionError(f"unknown Grafana variable in {expr!r}: add it to GRAFANA_VARIABLES")
    return expr


def with_bool(expr: str) -> str:
    """The expression with its top-level comparison made a `bool` one.

    An alert's expression returns nothing while all is well; with `bool` it returns 0 or
    1 for every series it compares, which shows the series it watches exist."""
    depth, quote, last = 0, "", None
    i = 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "=!<>":
            two = expr[i : i + 2]
            if two in ("==", "!=", ">=", "<="):
                last = i + 2
                i += 2
                continue
            if ch in "<>":
                last = i + 1
        i += 1
    if last is None or expr[last:].lstrip().startswith("bool"):
        return expr
    return f"{expr[:last]} bool{expr[last:]}"


class Prometheus:
    """A Prometheus server on a free port with its TSDB in `data_dir`, scraping
    `targets` ({job_name: [host:port, ...]}) with the jobs and rules of the shipped
    prometheus.yml, every `scrape_interval`."""

    def __init__(self, data_dir: Path, targets: dict[str, list[str]], scrape_interval: str = "1s"):
        self.data_dir = Path(data_dir)
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict:
        cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
        cfg["global"] = {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval}
        cfg["rule_files"] = [str(GRAFANA_DIR / f) for f in cfg.get("rule_files", [])]
        jobs = {j["job_name"] for j in cfg["scrape_configs"]}
        if jobs != set(self.targets):
            raise AssertionError(f"prometheus.yml has jobs {sorted(jobs)}, the test scrapes {sorted(self.targets)}")
        for job in cfg["scrape_configs"]:
            job["static_configs"] = [{"targets": self.targets[job["job_name"]]}]
        return cfg

    def start(self, timeout_seconds: float = 30) -> Prometheus:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config()))
        self.log = open(self.data_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout_seconds}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.data_dir / "prometheus.log").read_text(errors="replace")[-2000:]

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; Prometheus answers errors (a bad query: 400) as JSON too."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()
