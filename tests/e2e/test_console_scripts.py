"""End to end: the real console scripts as subprocesses, as a user runs them:
kvcp-controlplane, two kvcp-agent, the kvcp-bench workload, and kvctl against them.
Also the demo launcher, twice in a row, and an agent killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.client import EngineClient
from agent.server import DEMO_MODEL
from tests.helpers import REPO, free_port, script, wait_for

M = DEMO_MODEL


def kvctl(endpoint: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([script("kvctl"), "--endpoint", endpoint, *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvctl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


class Cluster:
    def __init__(self, etcd: str, tmp_path):
        self.etcd = etcd
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}
        self.cp_port = free_port()
        self.endpoint = f"127.0.0.1:{self.cp_port}"
        self.agent_ports: dict[str, int] = {}
        self.lookup_endpoint = f"unix:{tmp_path}/lookup.sock"
        self.log_offsets: dict[str, int] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        path = self.tmp / f"{name}.log"
        self.log_offsets[name] = path.stat().st_size if path.exists() else 0  # a restart appends to its log
        log = open(path, "ab")  # noqa: SIM115
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_controlplane(self):
        self.spawn(
            "cp",
            [
                script("kvcp-controlplane"),
                "--listen",
                self.endpoint,
                "--etcd",
                self.etcd,
                "--election-ttl-seconds",
                "3",
                "--lookup-listen",
                self.lookup_endpoint,
            ],
        )
        wait_for(lambda: kvctl(self.endpoint, "stats", check=False).returncode == 0, 20, 0.2, "control plane up")

    def start_agent(self, agent_id: str, port: int | None = None, lease_ttl_seconds: int = 3, *extra: str):
        port = port or self.agent_ports.get(agent_id) or free_port()
        self.agent_ports[agent_id] = port
        return self.spawn(
            agent_id,
            [
                script("kvcp-agent"),
                "--agent-id",
                agent_id,
                "--listen",
                f"127.0.0.1:{port}",
                "--etcd",
                self.etcd,
                "--cpu-capacity",
                "8MiB",
                "--lease-ttl-seconds",
                str(lease_ttl_seconds),
                *extra,
            ],
        )

    def wait_serving(self, *agent_ids: str) -> None:
        """Until each agent process (the last one started under its id) says it serves (once
        started, registered in etcd). Its start is mostly importing torch, 3.5 s of CPU: 25 s
        on a 2-core machine far over its cores (two agents at once took 31 s to show in
        kvctl agents, failing a 30 s wait), so the start gets its own bound and the waits
        after it measure the cluster, not the import."""
        for agent_id in agent_ids:
            path, proc = self.tmp / f"{agent_id}.log", self.procs[agent_id]

            def serving(agent_id=agent_id, path=path, proc=proc) -> bool:
                said = path.read_bytes()[self.log_offsets[agent_id] :].decode(errors="replace")
                if proc.poll() is not None:
                    raise AssertionError(f"kvcp-agent {agent_id} exited with {proc.returncode}: {said}")
                return f"kvcp-agent {agent_id} serving on" in said

            wait_for(serving, 120, 0.2, f"kvcp-agent {agent_id} serving")

    def agents(self) -> dict[str, dict]:
        return {a["agent_id"]: a for a in json.loads(kvctl(self.endpoint, "-o", "json", "agents").stdout)}

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def cluster(etcd, tmp_path):
    c = Cluster(etcd, tmp_path)
    yield c
    c.stop()


def test_cluster_from_console_scripts(cluster, tmp_path):
    cluster.start_controlplane()
    cluster.start_agent("agent-a")
    cluster.start_agent("agent-b", None, 3, "--transfer-engine", "none")
    cluster.wait_serving("agent-a", "agent-b")
    wait_for(lambda: set(cluster.agents()) == {"agent-a", "agent-b"}, 30, 0.3, "two agents")
    # an agent without its transfer engine says so, and which ways its handoffs go
    table = kvctl(cluster.endpoint, "agents").stdout
    assert (
        "agent-b: no transfer engine (disabled by configuration (--transfer-engine none)); its handoffs go by shm then grpc"
        in table
    ), table
    assert "agent-a: no transfer engine" not in table
    assert cluster.agents()["agent-b"]["shm_handoff"] and not cluster.agents()["agent-b"]["transfer_engine"]
    # the workload stores and looks up KV through the agents; every loaded block is verified
    wl = subprocess.run(
        [
            script("kvcp-bench"),
            "workload",
            "--controlplane",
            cluster.endpoint,
            "--rate",
            "0",
            "--duration",
            "4",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wl.returncode == 0, wl.stderr
    result = json.loads(wl.stdout)
    assert result["requests"] > 10 and result["errors"] == 0 and result["corrupt_blocks"] == 0
    assert result["hit_ratio"] > 0.2  # shared system prompts and multi-turn sessions hit

    agents = cluster.agents()
    for a in agents.values():
        assert a["state"] == "ready" and a["address"].startswith("127.0.0.1:")
        assert a["tiers"][0]["tier"] == "cpu" and a["tiers"][0]["capacity_bytes"] == 8 << 20
        assert set(a["tiers"][0]) >= {"tier", "capacity_bytes", "used_bytes", "num_blocks"}
    stats = json.loads(kvctl(cluster.endpoint, "-o", "json", "stats").stdout)
    assert stats["num_agents"] == 2 and stats["num_blocks"] > 0
    assert stats["lookups_total"] >= result["requests"]
    assert stats["lookup_hit_tokens_total"] > 0

    # a prompt stored on agent-b only: lookup names agent-b as best, with all its blocks.
    # As a router does, it is looked up (a miss) before it is stored: agent-b's tier is full
    # after the workload, and the lookup's reuse evidence keeps the prompt ahead of the
    # workload's blocks that were stored as recently but never asked for again
    tokens = list(range(5_000_000, 5_000_000 + 6 * M.block_size))
    tf = tmp_path / "prompt.txt"
    tf.write_text(",".join(map(str, tokens + [1, 2])))
    miss = kvctl(cluster.endpoint, "-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(tf))
    assert json.loads(miss.stdout)["best_agent_id"] == ""
    engine = EngineClient(f"127.0.0.1:{cluster.agent_ports['agent-b']}")
    engine.store(M.model_id, tokens, bytes(6 * M.block_bytes))
    engine.close()

    def best():
        out = json.loads(
            kvctl(cluster.endpoint, "-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(tf)).stdout
        )
        return out if out["best_agent_id"] == "agent-b" else None

    out = wait_for(best, 30, 0.2, "lookup to find agent-b")
    assert out["num_tokens"] == len(tokens) + 2 and out["model_id"] == M.model_id
    match = out["agents"][0]
    assert match == {
        "agent_id": "agent-b",
        "num_hit_blocks": 6,
        "num_hit_tokens": 6 * M.block_size,
        "tiers": ["cpu"] * 6,
    }
    table = kvctl(cluster.endpoint, "lookup", "--model", M.model_id, "--tokens-file", str(tf)).stdout
    assert "best agent: agent-b" in table and "cpu×6" in table
    # the same answer through the lookup socket (kvcp-controlplane --lookup-listen)
    lookup_args = ("-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(tf))
    via_socket = kvctl(cluster.endpoint, "--lookup-endpoint", cluster.lookup_endpoint, *lookup_args)
    assert json.loads(via_socket.stdout) == out
    nobody = kvctl(cluster.endpoint, "--lookup-endpoint", f"unix:{tmp_path}/none.sock", *lookup_args, check=False)
    assert nobody.returncode == 1 and "cannot reach the lookup socket" in nobody.stderr
    bad = kvctl(cluster.endpoint, "--lookup-endpoint", "nonsense", *lookup_args, check=False)
    assert bad.returncode == 2 and "HOST:PORT or unix:PATH" in bad.stderr

    # SIGKILL an agent: it leaves ListAgents and the index within TTL (3 s) + 2 s
    cluster.procs["agent-b"].send_signal(signal.SIGKILL)
    wait_for(lambda: "agent-b" not in cluster.agents(), 3 + 2 + 1, 0.2, "killed agent gone")
    out = json.loads(
        kvctl(cluster.endpoint, "-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(tf)).stdout
    )
    assert all(m["agent_id"] != "agent-b" for m in out["agents"])

    # restarted with the same id, it registers again and resyncs (its memory tier is empty)
    cluster.start_agent("agent-b")
    cluster.wait_serving("agent-b")
    wait_for(lambda: cluster.agents().get("agent-b", {}).get("state") == "ready", 20, 0.2, "agent-b back")
    assert cluster.agents()["agent-b"]["num_blocks"] == 0


def test_restart_before_lease_expiry_replaces_stale_blocks(cluster):
    # a lease that outlives the new process's start (over 10 s on a loaded 2-core machine: a
    # 3 s one lapsed first and the agent was simply gone) and the wait below: only the new
    # registration and inventory can replace the stale blocks in time
    lease = 60
    cluster.start_controlplane()
    cluster.start_agent("agent-r", lease_ttl_seconds=lease)
    cluster.wait_serving("agent-r")
    wait_for(lambda: "agent-r" in cluster.agents(), 30, 0.2, "agent up")
    engine = EngineClient(f"127.0.0.1:{cluster.agent_ports['agent-r']}")
    engine.store(M.model_id, list(range(4 * M.block_size)), bytes(4 * M.block_bytes))
    engine.close()
    wait_for(lambda: cluster.agents()["agent-r"]["num_blocks"] == 4, 30, 0.2, "indexed")
    cluster.procs["agent-r"].send_signal(signal.SIGKILL)
    cluster.procs["agent-r"].wait()
    killed = time.monotonic()
    cluster.start_agent("agent-r", lease_ttl_seconds=lease)  # same id, new process, old lease still alive
    cluster.wait_serving("agent-r")
    wait_for(
        lambda: cluster.agents()["agent-r"]["num_blocks"] == 0, 40, 0.2, "stale blocks replaced by the new inventory"
    )
    assert time.monotonic() - killed < lease  # not the old lease lapsing


@pytest.mark.parametrize(
    "args, needle",
    [
        (["lookup", "--model", "demo-model"], "--tokens"),
        (["lookup", "--model", "demo-model", "--tokens", "1,x,3"], "integers"),
        (["lookup", "--model", "demo-model", "--tokens", ""], "no tokens"),
        (["lookup", "--model", "demo-model", "--tokens-file", "/nonexistent/prompt.txt"], "does not exist"),
        (["lookup", "--model", "demo-model", "--hashes", "abcd"], "16 bytes"),
        (["lookup", "--model", "demo-model", "--hashes", "zz"], "hexadecimal"),
        (["lookup", "--model", "demo-model", "--tokens", "-1"], "out of range"),
        (["lookup", "--model", "demo-model", "--tokens", "1,,2"], "got an empty field"),
        (["lookup", "--model", "demo-model", "--tokens", "1_000,2"], "got '1_000'"),
        (["lookup", "--model", "demo-model", "--tokens", "\u0663,1"], "got '\u0663'"),  # an Arabic-Indic 3
        (["lookup", "--model", "demo-model", "--tokens", "[Infinity]"], "--tokens: token ids must be integers"),
        (["lookup", "--model", "demo-model", "--tokens", "[1.9, true, 3.5]"], "--tokens: token ids must be integers"),
        (["lookup", "--model", "demo-model", "--tokens", "[1, true]"], "--tokens: token ids must be integers"),
        (["lookup", "--model", "demo-model", "--tokens", "[[[[[[1]]]]]]"], "--tokens: token ids must be integers"),
        (["--tls-ca", "/nonexistent/ca.pem", "agents"], "--tls-ca"),
        (
            [
                "--tls-ca",
                "/nonexistent/ca.pem",
                "--lookup-endpoint",
                "127.0.0.1:1",
                "lookup",
                "--model",
                "m",
                "--tokens",
                "1",
            ],
            "--tls-ca",
        ),
        (["--tls-ca", "/nonexistent/ca.pem", "dashboard"], "--tls-ca"),
        (["--timeout", "0", "agents"], "--timeout"),
        (["--timeout", "-1", "agents"], "--timeout"),
    ],
)
def test_kvctl_bad_input_one_line_nonzero(args, needle):
    proc = kvctl("127.0.0.1:1", *args, check=False)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_kvctl_bad_files_one_line_nonzero(tmp_path):
    """A tokens file that is not UTF-8, a CA file that is not PEM: one line naming the option."""
    tokens = tmp_path / "prompt.bin"
    tokens.write_bytes(b"\xff\xfe1,2,3")
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    for args, needle in [
        (["lookup", "--model", "demo-model", "--tokens-file", str(tokens)], "--tokens-file"),
        (["--tls-ca", str(ca), "agents"], "--tls-ca"),
    ]:
        proc = kvctl("127.0.0.1:1", *args, check=False)
        assert proc.returncode != 0, args
        assert needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_kvctl_unknown_model_is_not_found(cluster):
    cluster.start_controlplane()
    cluster.start_agent("agent-m")
    cluster.wait_serving("agent-m")
    wait_for(lambda: "agent-m" in cluster.agents(), 20, 0.2, "agent up")
    proc = kvctl(cluster.endpoint, "lookup", "--model", "no-such-model", "--tokens", "1,2,3", check=False)
    assert proc.returncode == 1
    assert "unknown model 'no-such-model'" in proc.stderr and "Traceback" not in proc.stderr


def test_kvctl_without_controlplane_names_endpoint():
    endpoint = f"127.0.0.1:{free_port()}"
    proc = kvctl(endpoint, "agents", check=False)
    assert proc.returncode == 1
    assert endpoint in proc.stderr and "make demo" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_controlplane_without_etcd_exits_with_message():
    port = free_port()
    proc = subprocess.run(
        [
            script("kvcp-controlplane"),
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            f"127.0.0.1:{port}",
            "--etcd-wait-seconds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr and "etcd is not reachable" in proc.stderr


def test_demo_runs_twice_in_a_row(tmp_path):
    run_dir = tmp_path / "run"
    metrics_ports = [str(free_port()) for _ in range(3)]
    argv = [
        sys.executable,
        str(REPO / "scripts" / "demo.py"),
        "--run-dir",
        str(run_dir),
        "--etcd-port",
        str(free_port()),
        "--controlplane-port",
        str(free_port()),
        "--agent-ports",
        str(free_port()),
        str(free_port()),
        "--controlplane-metrics-port",
        metrics_ports[0],
        "--agent-metrics-ports",
        *metrics_ports[1:],
        "--duration",
        "3",
        "--rate",
        "20",
    ]
    for _ in range(2):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "kvcp demo cluster is up" in proc.stdout and "stopped 5 processes" in proc.stdout
        assert not list((run_dir / "pids").glob("*.pid"))
    # the Prometheus line it prints scrapes this demo's ports, not the shipped file's defaults
    config = run_dir / "prometheus.yml"
    assert f"--config.file={config}" in proc.stdout and "--web.listen-address=127.0.0.1:9090" in proc.stdout
    text = config.read_text()
    assert all(f"127.0.0.1:{port}" in text for port in metrics_ports) and "127.0.0.1:9400" not in text
    import shutil

    if shutil.which("promtool"):
        checked = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_kvctl_output_that_cannot_be_written_is_one_line_not_a_traceback():
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [script("kvctl"), "--endpoint", "127.0.0.1:1", "--help"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "kvctl: cannot write the output: No space left on device"


@pytest.mark.parametrize(
    "argv", [["pins", "-o", "json"], ["policy", "get", "--output", "json"], ["ops", "--timeout", "3"]]
)
def test_a_kvctl_option_given_after_the_command_is_named_as_kvctls_own(argv):
    """`kvctl pins -o json` got click's bare "No such option '-o'": it now says the option
    goes before the command (exit 2, nothing called)."""
    proc = kvctl("127.0.0.1:1", *argv, check=False)
    assert proc.returncode == 2, proc
    assert f"{argv[-2]} is an option of kvctl itself: put it before the command" in proc.stderr
    unknown = kvctl("127.0.0.1:1", "pins", "--bogus", check=False)
    assert unknown.returncode == 2 and "No such option" in unknown.stderr


def test_kvctl_timeout_takes_a_duration_as_the_other_options_do():
    """`--timeout 5s` was refused ("'5s' is not a valid float") where --ttl, --older-than
    and --wait-timeout take 90s/30m: now one parser for all; a bare number is seconds."""
    for value in ("300ms", "0.3", ".3", "1s"):
        proc = kvctl("127.0.0.1:1", "--timeout", value, "agents", check=False)
        assert proc.returncode == 1 and "cannot reach the kvcp control plane" in proc.stderr, (value, proc.stderr)
