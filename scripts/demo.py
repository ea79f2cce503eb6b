"""`make demo`: a local kvcp cluster on this machine, until Ctrl-C.

etcd on loopback (data under .run/etcd), one control plane on 127.0.0.1:50051, two
agents with small CPU tiers, and the demo workload (chat sessions sharing system
prompts, Zipf-popular documents) storing and looking up KV through the agents, so
kvctl shows a living cluster. Every process it starts is stopped on exit; pid files of
a run that was killed are used to clean up before starting, so it can run again.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))

from cli.client import ClientError, ControlPlaneClient  # noqa: E402
from protos.etcd_keys import connect  # noqa: E402


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid, it names one process (a pid alone may be another program's by now)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()[19]


def _exited(pid: int) -> bool:
    """The process is gone, or has ended and only waits for its parent to reap it (a
    zombie: /proc still lists it, and no signal ends it any further)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CRASH_LOOP_EXITS = 3  # a process exiting this often ...
CRASH_LOOP_SECONDS = 60.0  # ... within this long stops the demo instead of restarting


class Demo:
    def __init__(self, args):
        self.args = args
        self.run_dir = Path(args.run_dir).resolve()
        self.logs = self.run_dir / "logs"
        self.pids = self.run_dir / "pids"
        self.procs: dict[str, subprocess.Popen] = {}  # name -> its current process
        self.argv: dict[str, list[str]] = {}
        self.exits: dict[str, list[float]] = {}  # name -> when it exited lately (crash-loop check)

    def say(self, msg: str) -> None:
        print(msg, flush=True)

    def clean_stale(self) -> None:
        """Stop what a previous, killed demo left running (pid files in .run/pids). A pid
        file names the process and its start time: a pid the kernel has since given to
        another program (pids wrap) is left alone."""
        if not self.pids.exists():
            return
        for pid_file in self.pids.glob("*.pid"):
            try:
                pid_text, _, started = pid_file.read_text().strip().partition(" ")
                pid = int(pid_text)
                alive_since = _start_time(pid)
            except (ValueError, OSError):
                pid_file.unlink(missing_ok=True)
                continue
            if not started or alive_since != started:
                pid_file.unlink(missing_ok=True)  # another process has that pid now (or a file of an old demo)
                continue
            self.say(f"demo: stopping {pid_file.stem} (pid {pid}) left by an earlier run")
            with contextlib.suppress(OSError):  # gone meanwhile
                os.killpg(pid, signal.SIGTERM)
            for _ in range(50):
                if _exited(pid):
                    break
                time.sleep(0.1)
            else:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            pid_file.unlink(missing_ok=True)

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child has its own copy of it
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
                preexec_fn=_die_with_parent,
            )
        try:
            started = _start_time(proc.pid)
        except OSError:  # it died already: nothing to clean up later
            started = ""
        (self.pids / f"{name}.pid").write_text(f"{proc.pid} {started}")
        self.procs[name] = proc
        self.argv[name] = argv
        return proc

    def wait_port(self, name: str, proc: subprocess.Popen, port: int, timeout_seconds: float = 30) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n  " + "\n  ".join(tail))
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not listen on port {port} within {timeout_seconds:.0f}s")

    def check_ports(self) -> None:
        a = self.args
        wanted = {"control plane": a.controlplane_port, "agent-1": a.agent_ports[0], "agent-2": a.agent_ports[1]}
        busy = [f"{name} port {p}" for name, p in wanted.items() if not port_free(p)]
        if busy:
            raise RuntimeError(
                f"{', '.join(busy)} in use by another program (another demo still running?); "
                "stop it or choose ports with --controlplane-port / --agent-ports"
            )
        if not port_free(a.etcd_port):  # (etcd's peer port is a free one, below)
            taken, a.etcd_port = a.etcd_port, free_port()
            self.say(f"demo: port {taken} is taken, using {a.etcd_port} for the demo's etcd")
        # /metrics ports: dashboard/grafana/prometheus.yml scrapes 9400-9402; others only if taken
        names = ["control plane", *(f"agent-{i}" for i in range(1, len(a.agent_metrics_ports) + 1))]
        ports = [a.controlplane_metrics_port, *a.agent_metrics_ports]
        for i, (name, port) in enumerate(zip(names, ports, strict=True)):
            if not port_free(port) or port in ports[:i]:
                ports[i] = free_port()
                self.say(f"demo: metrics port {port} is taken, {name} serves /metrics on {ports[i]}")
        a.controlplane_metrics_port, a.agent_metrics_ports = ports[0], ports[1:]

    def start(self) -> None:
        a = self.args
        if shutil.which("etcd") is None:
            raise RuntimeError(
                "etcd is not installed; run `make demo` (it installs etcd-server) or apt-get install -y etcd-server"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.pids.mkdir(exist_ok=True)
        self.clean_stale()
        self.check_ports()
        shutil.rmtree(self.run_dir / "etcd", ignore_errors=True)  # a fresh cluster each run
        for d in self.run_dir.glob("disk-agent-*"):  # and fresh disk tiers (they would be recovered otherwise)
            shutil.rmtree(d, ignore_errors=True)
        peer_port = free_port()
        client_url = f"http://127.0.0.1:{a.etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        etcd = self.spawn(
            "etcd",
            [
                "etcd",
                "--name",
                "kvcp-demo",
                "--data-dir",
                str(self.run_dir / "etcd"),
                "--listen-client-urls",
                client_url,
                "--advertise-client-urls",
                client_url,
                "--listen-peer-urls",
                peer_url,
                "--initial-advertise-peer-urls",
                peer_url,
                "--initial-cluster",
                f"kvcp-demo={peer_url}",
                # etcd keeps every revision until compacted: without this a busy cluster's
                # history fills the backend quota (NOSPACE) in time
                "--auto-compaction-mode",
                "periodic",
                "--auto-compaction-retention",
                "1h",
            ],
        )
        self.wait_port("etcd", etcd, a.etcd_port)
        etcd_ep = f"127.0.0.1:{a.etcd_port}"
        connect(etcd_ep, wait_seconds=45, log=self.say).close()
        cp_addr = f"127.0.0.1:{a.controlplane_port}"
        lookup_ep = f"unix:{self.run_dir / 'lookup.sock'}"  # the lookup socket, for routers
        cp = self.spawn(
            "controlplane",
            [
                str(BIN / "kvcp-controlplane"),
                "--listen",
                cp_addr,
                "--etcd",
                etcd_ep,
                "--metrics-listen",
                f"127.0.0.1:{a.controlplane_metrics_port}",
                "--lookup-listen",
                lookup_ep,
            ],
        )
        self.wait_port("controlplane", cp, a.controlplane_port)
        agents = []  # started together: each spends most of its start importing torch
        for i, port in enumerate(a.agent_ports, start=1):
            name = f"agent-{i}"
            proc = self.spawn(
                name,
                [
                    str(BIN / "kvcp-agent"),
                    "--agent-id",
                    name,
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--etcd",
                    etcd_ep,
                    "--cpu-capacity",
                    a.agent_capacity,
                    "--disk-dir",
                    str(self.run_dir / f"disk-{name}"),
                    "--disk-capacity",
                    a.agent_disk_capacity,
                    "--metrics-listen",
                    f"127.0.0.1:{a.agent_metrics_ports[i - 1]}",
                    "--role",  # a prefill agent and one that does both: kvctl route has a choice to show
                    "prefill" if i == 1 else "both",
                ],
            )
            agents.append((name, proc, port))
        for name, proc, port in agents:
            self.wait_port(name, proc, port)
        with ControlPlaneClient(cp_addr) as c:
            deadline = time.monotonic() + 20
            while len([x for x in c.list_agents() if x.state == "ready"]) < len(a.agent_ports):
                if time.monotonic() > deadline:
                    raise RuntimeError("agents did not become ready within 20s (see .run/logs/)")
                time.sleep(0.2)
        if a.rate > 0:
            self.spawn(
                "workload", [str(BIN / "kvcp-bench"), "workload", "--controlplane", cp_addr, "--rate", str(a.rate)]
            )
        kvctl = os.path.relpath(BIN / "kvctl", Path.cwd())
        ep = "" if a.controlplane_port == 50051 else f" --endpoint {cp_addr}"
        self.say(
            "\nkvcp demo cluster is up:\n"
            f"  etcd           {etcd_ep:<18} data {self.run_dir / 'etcd'}\n"
            f"  control plane  {cp_addr:<18} (leader), lookups also on {lookup_ep}\n"
            + "".join(
                f"  agent-{i}        127.0.0.1:{p:<8} cpu {a.agent_capacity}, disk {a.agent_disk_capacity}\n"
                for i, p in enumerate(a.agent_ports, 1)
            )
            + f"  workload       {a.rate:g} requests/s (chat sessions + Zipf documents)\n"
            f"  metrics        http://127.0.0.1:{{{a.controlplane_metrics_port},"
            + ",".join(str(p) for p in a.agent_metrics_ports)
            + "}/metrics (control plane, agents)\n"
            f"  logs           {self.logs}/\n\n"
            "Try, in another terminal:\n"
            f"  {kvctl}{ep} agents\n"
            f"  {kvctl}{ep} stats\n"
            f"  {kvctl}{ep} lookup --model demo-model --tokens $(seq -s, 1 64)\n"
            f"  {kvctl}{ep} --lookup-endpoint {lookup_ep} lookup --model demo-model --tokens $(seq -s, 1 64)\n"
            f"  {kvctl}{ep} -o json agents\n"
            f"  {kvctl}{ep} pin --namespace legal-kb --tier cpu --ttl 30m\n"
            f"  {kvctl}{ep} move --namespace chat --to disk --wait\n"
            f"  {kvctl}{ep} cleanup --older-than 1m --dry-run\n"
            f"  {kvctl}{ep} dashboard\n"
            f"  prometheus --config.file={self.prometheus_config()} --storage.tsdb.path={self.run_dir / 'prometheus'} "
            "--web.listen-address=127.0.0.1:9090\n"
            "  (Grafana: dashboard/grafana/kvcp.json; see README, Metrics and dashboards)\n\n"
            "A process that exits (try kill -9 on an agent) is started again; "
            "Ctrl-C stops every process this demo started.\n"
        )

    def prometheus_config(self) -> Path:
        """dashboard/grafana/prometheus.yml with this demo's metrics ports (they differ from
        the shipped file's when a port was taken or given), written into the run dir."""
        a = self.args
        shipped = Path(__file__).resolve().parent.parent / "dashboard" / "grafana"
        text = (shipped / "prometheus.yml").read_text()
        text = text.replace('"127.0.0.1:9400"', f'"127.0.0.1:{a.controlplane_metrics_port}"')
        text = text.replace(
            '"127.0.0.1:9401", "127.0.0.1:9402"', ", ".join(f'"127.0.0.1:{p}"' for p in a.agent_metrics_ports)
        )
        text = text.replace("  - alerts.yml  # relative to this file", f"  - {shipped / 'alerts.yml'}")
        out = self.run_dir / "prometheus.yml"
        out.write_text(text)
        return out

    def status_line(self) -> str:
        cp_addr = f"127.0.0.1:{self.args.controlplane_port}"
        try:
            with ControlPlaneClient(cp_addr, timeout_seconds=2) as c:
                s = c.stats()
            return (
                f"demo: {s.num_agents} agents, {s.num_blocks} blocks ({s.num_block_replicas} replicas), "
                f"{s.lookups_total} lookups, hit ratio {s.hit_ratio:.1%}"
            )
        except ClientError as exc:
            return f"demo: control plane not answering: {exc}"

    def watch(self) -> None:
        deadline = time.monotonic() + self.args.duration if self.args.duration else None
        next_status = time.monotonic() + 10
        while deadline is None or time.monotonic() < deadline:
            for name, proc in list(self.procs.items()):
                if proc.poll() is not None:
                    self.restart(name, proc.returncode)
            if time.monotonic() >= next_status:
                self.say(self.status_line())
                next_status += 10
            time.sleep(0.2)

    def restart(self, name: str, code: int) -> None:
        """A process that exited (killed to try a failure, crashed) is started again as
        a supervisor would, the rest serving meanwhile: an agent comes back with its disk
        tier, etcd with its data. One that exits 3 times within a minute stops the demo."""
        now = time.monotonic()
        recent = [t for t in self.exits.get(name, []) if now - t < CRASH_LOOP_SECONDS] + [now]
        self.exits[name] = recent
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        log = self.logs / f"{name}.log"
        if len(recent) >= CRASH_LOOP_EXITS:
            raise RuntimeError(f"{name} {how}, {len(recent)} times within {CRASH_LOOP_SECONDS:.0f}s (see {log})")
        self.say(f"demo: {name} {how}; the rest keep serving; starting it again (log {log})")
        try:
            self.spawn(name, self.argv[name])
        except OSError as exc:
            raise RuntimeError(f"{name} could not be started again: {exc}") from None

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except OSError:
                    pass
        for name, proc in reversed(self.procs.items()):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            (self.pids / f"{name}.pid").unlink(missing_ok=True)
        if self.procs:
            self.say(f"demo: stopped {len(self.procs)} processes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=str(REPO / ".run"))
    p.add_argument("--etcd-port", type=int, default=2379)
    p.add_argument("--controlplane-port", type=int, default=50051)
    p.add_argument("--agent-ports", type=int, nargs=2, default=[50061, 50062])
    p.add_argument("--agent-capacity", default="32MiB")
    p.add_argument("--agent-disk-capacity", default="256MiB")
    p.add_argument("--controlplane-metrics-port", type=int, default=9400)
    p.add_argument("--agent-metrics-ports", type=int, nargs=2, default=[9401, 9402])
    p.add_argument("--rate", type=float, default=10.0, help="workload requests per second (0: no workload)")
    p.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until Ctrl-C)")
    args = p.parse_args(argv)
    demo = Demo(args)
    stopping = {"flag": False}

    def on_signal(*_):
        if not stopping["flag"]:
            stopping["flag"] = True
            raise KeyboardInterrupt

    # Ctrl-C, kill, a closed terminal: all stop what the demo started (SIGINT set here too:
    # a demo started in the background inherits it ignored)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    code = 0
    try:
        demo.start()
        demo.watch()
    except KeyboardInterrupt:
        print("\ndemo: stopping ...", flush=True)
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        demo.stop()
    return code


def _die_with_parent() -> None:
    """In each child, before it runs: SIGTERM when the demo itself dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG), so no process of a demo outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the demo's own stop() is all there is


if __name__ == "__main__":
    sys.exit(main())
