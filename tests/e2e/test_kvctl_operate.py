"""End to end: kvctl pin/unpin/pins/move/cleanup/compress/ops/policy as a user runs them,
against real console-script processes (control plane, agent with a disk tier) and a
real etcd; bad input gives one line and a non-zero exit and changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.client import EngineClient
from agent.server import DEMO_MODEL
from cli.client import ControlPlaneClient
from tests.e2e.test_console_scripts import Cluster, kvctl
from tests.helpers import free_port, script, wait_for

M = DEMO_MODEL
STORE_PROMPT = Path(__file__).resolve().parents[2] / "scripts" / "store_prompt.py"


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    """One cluster for the module (processes are slow to start on 2 cores)."""
    from protos.etcd_keys import ROOT, connect

    client = connect(etcd_server.endpoint)
    client.delete_prefix(ROOT)
    tmp = tmp_path_factory.mktemp("operate")
    c = Cluster(etcd_server.endpoint, tmp)
    try:
        c.start_controlplane()
        port = c.agent_ports.setdefault("agent-d", free_port())
        c.spawn(
            "agent-d",
            [
                script("kvcp-agent"),
                "--agent-id",
                "agent-d",
                "--listen",
                f"127.0.0.1:{port}",
                "--etcd",
                etcd_server.endpoint,
                "--cpu-capacity",
                "8MiB",
                "--disk-dir",
                str(tmp / "disk"),
                "--disk-capacity",
                "64MiB",
                "--lease-ttl-seconds",
                "3",
            ],
        )
        c.wait_serving("agent-d")
        wait_for(lambda: "agent-d" in c.agents(), 30, 0.3, "agent up")
        yield c
    finally:  # a failed wait above stops them too: they would go on registering in the worker's etcd
        c.stop()
    client.delete_prefix(ROOT)
    client.close()


def j(cluster, *args):
    return json.loads(kvctl(cluster.endpoint, "-o", "json", *args).stdout)


def test_pin_move_cleanup_from_kvctl(cluster, tmp_path):
    engine = EngineClient(f"127.0.0.1:{cluster.agent_ports['agent-d']}")
    doc = list(range(900_000, 900_000 + 5 * M.block_size))
    chat = list(range(800_000, 800_000 + 3 * M.block_size))
    engine.store(M.model_id, doc, bytes(5 * M.block_bytes), namespace="legal-kb")
    engine.store(M.model_id, chat, bytes(3 * M.block_bytes), namespace="chat")
    engine.close()
    tf = tmp_path / "doc.txt"
    tf.write_text(" ".join(map(str, doc)))
    wait_for(lambda: cluster.agents()["agent-d"]["num_blocks"] == 8, 10, 0.2, "indexed")

    pin_id = kvctl(
        cluster.endpoint,
        "pin",
        "--model",
        M.model_id,
        "--tokens-file",
        str(tf),
        "--tier",
        "cpu",
        "--ttl",
        "10m",
        "--owner",
        "e2e",
    ).stdout.strip()
    pins = j(cluster, "pins")
    assert [p["pin_id"] for p in pins] == [pin_id] and pins[0]["num_blocks"] == 5 and pins[0]["min_tier"] == "cpu"
    table = kvctl(cluster.endpoint, "pins").stdout
    assert pin_id in table and "5 blocks of demo-model" in table
    # a pin with an id chosen by the caller can be run again (a script retrying after a lost
    # answer): the same pin comes back, no second one; another request under it is refused
    chosen = ["pin", "--namespace", "chat", "--ttl", "10m", "--pin-id", "chat-hold-1"]
    assert kvctl(cluster.endpoint, *chosen).stdout.strip() == "chat-hold-1"
    assert kvctl(cluster.endpoint, *chosen).stdout.strip() == "chat-hold-1"
    assert sorted(p["pin_id"] for p in j(cluster, "pins")) == sorted([pin_id, "chat-hold-1"])
    clash = kvctl(cluster.endpoint, "pin", "--namespace", "chat", "--ttl", "5m", "--pin-id", "chat-hold-1", check=False)
    assert clash.returncode != 0 and "chat-hold-1" in clash.stderr and "exists with another" in clash.stderr
    bad = kvctl(cluster.endpoint, "pin", "--namespace", "chat", "--ttl", "5m", "--pin-id", "no spaces", check=False)
    assert bad.returncode != 0 and "pin_id" in bad.stderr
    assert len(j(cluster, "pins")) == 2
    kvctl(cluster.endpoint, "unpin", "chat-hold-1")

    # a pinned prefix is not demoted below its pin's tier: the move skips those blocks, and says so
    out = kvctl(cluster.endpoint, "move", "--model", M.model_id, "--tokens-file", str(tf), "--to", "disk", "--wait")
    assert (
        "SUCCEEDED, 0/5 blocks, 5 pinned skipped" in out.stdout and "where pins hold them (at tier cpu)" in out.stdout
    )
    moved = j(cluster, "move", "--namespace", "chat", "--to", "disk", "--wait")
    assert moved["state"] == "SUCCEEDED" and moved["num_done_blocks"] == 3
    lookup = j(cluster, "lookup", "--model", M.model_id, "--tokens", ",".join(map(str, chat)))
    assert lookup["agents"][0]["tiers"] == ["disk"] * 3

    dry = j(cluster, "cleanup", "--dry-run")
    assert dry["dry_run"] and dry["num_skipped_pinned_blocks"] == 5 and sum(t["num_blocks"] for t in dry["freed"]) == 3
    assert cluster.agents()["agent-d"]["num_blocks"] == 8
    text = kvctl(cluster.endpoint, "cleanup", "--older-than", "1h", "--dry-run").stdout
    assert "would free nothing" in text
    done = j(cluster, "cleanup", "--namespace", "chat", "--wait")
    assert done["state"] == "SUCCEEDED" and sum(t["num_blocks"] for t in done["freed"]) == 3
    wait_for(lambda: cluster.agents()["agent-d"]["num_blocks"] == 5, 10, 0.2, "cleanup indexed")

    comp = j(cluster, "compress", "--codec", "int8", "--namespace", "legal-kb", "--wait")
    assert comp["state"] == "SUCCEEDED" and comp["num_done_blocks"] == 5

    # kvctl -o json agents: stored vs uncompressed bytes per tier, as the agent reports them
    def cpu_tier() -> dict:
        agent = next(a for a in j(cluster, "agents") if a["agent_id"] == "agent-d")
        return next(t for t in agent["tiers"] if t["tier"] == "cpu")

    wait_for(lambda: 0 < cpu_tier()["stored_bytes"] < cpu_tier()["uncompressed_bytes"], 10, 0.3, "compressed bytes")
    assert cpu_tier()["uncompressed_bytes"] == 5 * M.block_bytes
    assert "[stored " in kvctl(cluster.endpoint, "agents").stdout
    ops = j(cluster, "ops")
    assert {o["kind"] for o in ops} >= {"move", "cleanup", "compress"}
    assert kvctl(cluster.endpoint, "op", ops[0]["op_id"]).stdout.startswith(ops[0]["kind"])
    assert kvctl(cluster.endpoint, "unpin", pin_id).stdout.strip() == f"unpinned {pin_id}"
    assert j(cluster, "pins") == []

    policy = j(cluster, "policy", "set", "quota.legal-kb=1MiB")
    assert policy["quota.legal-kb"] == "1MiB"
    assert j(cluster, "policy", "get")["quota.legal-kb"] == "1MiB"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["unpin", "no-such-pin"], "PIN_ID (pin_id): no pin 'no-such-pin'"),  # its argument, not --pin-id
        (["--endpoint", "garbage", "pins"], "--endpoint: 'garbage' is not HOST:PORT"),
        (["--endpoint", "127.0.0.1", "pins"], "--endpoint: '127.0.0.1' is not HOST:PORT"),  # not gRPC's port 443
        (["--endpoint", "http://127.0.0.1:1", "pins"], "is not HOST:PORT"),
        (["--endpoint", "127.0.0.1:99999", "pins"], "is not HOST:PORT"),
        (["transfer", "--model", M.model_id, "--from", "agent-d", "--to", "x"], "give the prefix: --tokens"),
        (["route", "--model", M.model_id], "give the request: --tokens"),  # neither has --namespace
        # a namespace's blocks of one model: a model the cluster knows (compress re-encoded every model's)
        (["compress", "--codec", "int8", "--namespace", "kb", "--model", "nope"], "unknown model 'nope'"),
        (["move", "--namespace", "kb", "--model", "nope", "--to", "disk"], "unknown model 'nope'"),
        (["pin", "--namespace", "kb", "--ttl", "soon"], "--ttl: 'soon' is not a duration"),
        (
            ["pin", "--namespace", "kb", "--model", M.model_id, "--ttl", "1h"],
            "--model (scope.model_id): a namespace pin",
        ),
        (["--timeout", "2d", "pins"], "--timeout: 172800 s is longer than 86400 s"),
        (["--timeout", "1e10", "pins"], "--timeout: '1e10' is not a duration"),
        (["--endpoint", " ", "pins"], "--endpoint: empty"),
        (["dashboard", "--endpoint", ""], "--endpoint: empty"),  # it went to the default address
        (["dashboard", "--endpoint", ",,"], "--endpoint: empty"),  # and showed ',,' as its title
        (["pin", "--namespace", "kb", "--ttl", "0.5ms"], "--ttl (ttl_seconds): 0.5ms is under the 1s minimum"),
        (["pin", "--namespace", "kb", "--ttl", "400d"], "--ttl (ttl_seconds): 400d is not between 1s and 365d"),
        (["pin", "--namespace", "kb", "--ttl", "100000d"], "100000d is not between"),  # not 1e+05d
        (["--tls-key", "client.key", "pins"], "--tls-cert/--tls-key need --tls-ca"),  # not plain text unsaid
        (["pin", "--namespace", "kb", "--ttl", "1h", "--tier", "ssd"], "unknown tier 'ssd'"),
        (["pin", "--namespace", "kb"], "needs a TTL"),
        (["pin", "--namespace", "kb", "--tier", "ssd"], "--tier: unknown tier 'ssd'"),  # said before the TTL
        (["move", "--namespace", "kb", "--to", "tape"], "unknown tier 'tape'"),
        (["cleanup", "--agent", "ghost"], "--agent (agent_id): no agent 'ghost'"),
        (["cleanup", "--older-than", "yesterday"], "--older-than"),
        (["compress", "--codec", "lz4", "--namespace", "kb"], "unknown codec 'lz4'"),
        (["policy", "set", "quota.kb=lots"], "quota.kb"),
        (["policy", "set", "nonsense"], "is not key=value"),
        (["op", "nope"], "OP_ID (op_id): no operation 'nope'"),
        (["op", "nope", "--wait", "--wait-timeout", "0"], "--wait-timeout"),
        (["cleanup", "--wait", "--wait-timeout", "soon"], "--wait-timeout: 'soon' is not a duration"),
        # an empty prefix is no prefix: it must not turn into "the whole namespace"
        (["pin", "--model", M.model_id, "--tokens", "[]", "--namespace", "kb", "--ttl", "1h"], "no tokens given"),
        (["move", "--model", M.model_id, "--tokens", "[]", "--namespace", "kb", "--to", "disk"], "no tokens given"),
        (["policy", "set", "quota.=0"], "quota.<namespace>"),
        (["pins", "--namespace", "a b"], "--namespace (namespace): 'a b' is not a namespace"),
        (["route", "--model", M.model_id, "--tokens", "1,2", "--prefill-agent", "x"], "only with --role decode"),
        (["pin", "--namespace", "kb", "--ttl", "1h", "--owner", "x" * 300], "--owner (owner): at most 256 characters"),
        (["pin", "--namespace", "kb", "--ttl", "1h", "--owner-lease", "-1"], "--owner-lease: -1 is out of range"),
        (["pin", "--namespace", "kb", "--owner-lease", "694d7e2ba6fe7a0f"], "write 0x694d7e2ba6fe7a0f"),
    ],
)
def test_bad_operate_input(cluster, args, needle):
    # the pins before and after, as `kvctl -o json pins` lists them (the same ListPins call and
    # PinView rows), read in process: two kvctl processes less per case (40 cases)
    with ControlPlaneClient(cluster.endpoint) as client:
        before = client.list_pins()
        proc = kvctl(cluster.endpoint, *args, check=False)
        assert proc.returncode != 0, proc.stdout
        assert needle in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert client.list_pins() == before


def test_wait_gives_up_after_wait_timeout(cluster, etcd_server):
    """--wait on an operation that does not finish in --wait-timeout: the operation as it
    stands, then one line on stderr and exit 1 (not 0 with a RUNNING operation)."""
    from controlplane.store.locks import EtcdLock
    from protos import etcd_keys

    # another cleanup of the namespace holds its lock: ours waits, PENDING
    etcd = etcd_keys.connect(etcd_server.endpoint)
    holder = EtcdLock(etcd, "cleanup/wait-kb", "someone-else")
    assert holder.try_acquire()
    op_id = ""
    try:
        args = ("cleanup", "--namespace", "wait-kb", "--wait", "--wait-timeout", "1")
        proc = kvctl(cluster.endpoint, "-o", "json", *args, check=False)
        op = json.loads(proc.stdout)
        op_id = op["op_id"]
        assert proc.returncode == 1 and op["state"] in ("PENDING", "RUNNING"), (proc.returncode, op)
        assert "--wait-timeout" in proc.stderr and f"kvctl op {op_id} --wait" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

        table = kvctl(cluster.endpoint, "op", op_id, "--wait", "--wait-timeout", "0.5s", check=False)
        assert table.returncode == 1 and "still" in table.stderr and op_id in table.stdout
    finally:
        if op_id:
            kvctl(cluster.endpoint, "cancel", op_id, check=False)
        holder.release()
        etcd.close()


def test_route_without_an_agent_fails_in_both_formats(cluster):
    """No agent to route to: non-zero for scripts (-o json, the decision still printed)
    as for people."""
    args = ("route", "--model", "nobody-serves-it", "--tokens", "1,2,3", "--role", "prefill")
    table = kvctl(cluster.endpoint, *args, check=False)
    assert table.returncode != 0, table
    js = kvctl(cluster.endpoint, "-o", "json", *args, check=False)
    assert js.returncode == table.returncode, js


def test_decode_for_a_prefill_agent_of_role_both_stays_on_it(cluster):
    """The only agent (role both) prefilled: --role decode said "no agent takes decode"
    and exited 2, though pair mode puts decode there (an operator's review)."""
    args = ("route", "--model", M.model_id, "--tokens", "1,2,3", "--role", "decode", "--prefill-agent", "agent-d")
    r = j(cluster, *args)
    assert r["agent_id"] == r["decode_agent_id"] == "agent-d" and not r["disaggregate"], r
    assert "no other decode agent" in r["reason"]


def test_kvctl_names_what_is_wrong_with_where_it_was_sent(cluster, tmp_path):
    """An empty KVCTL_ENDPOINT went to the default address (someone else's cluster on a
    shared host); an agent's port gave "Method not found!"; a prompt over the limit blamed
    --hashes, which the user never gave (an operator's review)."""
    import os
    import subprocess

    from tests.helpers import script

    env = dict(os.environ, KVCTL_ENDPOINT="")
    proc = subprocess.run([script("kvctl"), "pins"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "KVCTL_ENDPOINT: set but empty" in proc.stderr, proc
    env["KVCTL_ENDPOINT"] = "127.0.0.1"
    proc = subprocess.run([script("kvctl"), "pins"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 2 and "KVCTL_ENDPOINT: '127.0.0.1' is not HOST:PORT" in proc.stderr, proc

    agent = f"127.0.0.1:{cluster.agent_ports['agent-d']}"
    proc = kvctl(agent, "stats", check=False)
    assert proc.returncode == 1 and f"{agent} does not serve the kvcp admin API" in proc.stderr, proc

    huge = tmp_path / "huge.txt"
    huge.write_text(",".join(map(str, range(1_100_000))))
    for args in (
        ("pin", "--model", M.model_id, "--tokens-file", str(huge), "--ttl", "1m"),
        ("transfer", "--model", M.model_id, "--tokens-file", str(huge), "--from", "agent-d", "--to", "x"),
        ("move", "--model", M.model_id, "--tokens-file", str(huge), "--to", "disk"),
    ):
        proc = kvctl(cluster.endpoint, *args, check=False)
        assert proc.returncode == 1, proc
        assert "--tokens/--tokens-file (scope.token_ids): at most" in proc.stderr, proc.stderr
        assert f"per {args[0]}; got 1100000 tokens" in proc.stderr, proc.stderr


def test_a_server_error_about_a_field_names_the_flag_that_set_it():
    from cli.main import flag_named

    assert flag_named("to_tier: unknown tier 'tape'") == "--to (to_tier): unknown tier 'tape'"
    assert (
        flag_named("scope.namespace: 'a b' is not a namespace")
        == "--namespace (scope.namespace): 'a b' is not a namespace"
    )
    assert flag_named("no pin 'x'") == "no pin 'x'"  # not about a field: as it came
    # `policy set KEY=VALUE`: the key as typed, not the request's field (a review)
    assert flag_named("values[quota.kb]: 'lots' is not a size") == "quota.kb: 'lots' is not a size"


def test_the_store_prompt_script_stores_a_prompt_the_control_plane_then_finds(cluster, tmp_path):
    """scripts/store_prompt.py (the README's route example on the demo): a prompt stored
    on one agent as an engine would, its token ids in a file kvctl reads."""
    out = tmp_path / "long-prompt.txt"
    args = ["--agent", f"127.0.0.1:{cluster.agent_ports['agent-d']}", "--controlplane", cluster.endpoint]
    proc = subprocess.run(
        [sys.executable, str(STORE_PROMPT), *args, "--tokens", str(4 * M.block_size + 3), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "stored 4 of 4 blocks" in proc.stdout, proc.stderr
    wait_for(
        lambda: (
            [
                (a["agent_id"], a["num_hit_blocks"])
                for a in j(cluster, "lookup", "--model", M.model_id, "--tokens-file", str(out))["agents"]
            ]
            == [("agent-d", 4)]
        ),
        10,
        0.2,
        "found",
    )
    bad = subprocess.run(
        [sys.executable, str(STORE_PROMPT), *args, "--model", "nope", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "--model: unknown model 'nope'" in bad.stderr


def test_kvctl_cordon_and_uncordon(cluster):
    """kvctl cordon takes the agent out of rotation (kvctl agents says so and why),
    kvctl uncordon puts it back; an unknown agent is one line and exit 1."""
    out = kvctl(cluster.endpoint, "cordon", "agent-d", "--reason", "kernel upgrade").stdout
    assert out.strip() == "cordoned agent-d (kernel upgrade): no new work goes to it; kvctl uncordon agent-d undoes it"
    try:
        table = kvctl(cluster.endpoint, "agents").stdout
        assert "ready,cordoned" in table and "agent-d: cordoned (kernel upgrade)" in table, table
        assert [a["cordon_reason"] for a in j(cluster, "agents")] == ["kernel upgrade"]
        assert j(cluster, "policy", "get")["cordon.agent-d"] == "kernel upgrade"
        lookup = kvctl(cluster.endpoint, "lookup", "--model", M.model_id, "--tokens", "1,2,3,4").stdout
        assert "best agent: (none in rotation; cordoned, not looked at: agent-d)" in lookup, lookup
        bad = kvctl(cluster.endpoint, "cordon", "agent-typo", check=False)
        assert bad.returncode == 1 and "no agent 'agent-typo'" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
        assert bad.stderr.startswith("kvctl: AGENT_ID"), bad.stderr  # not the policy key it is stored under
        typo = kvctl(cluster.endpoint, "uncordon", "agent-typo", check=False)  # not "was not cordoned", exit 0
        assert typo.returncode == 1 and "no agent 'agent-typo' is registered" in typo.stderr, typo
    finally:
        assert j(cluster, "uncordon", "agent-d") == {"agent_id": "agent-d", "was_cordoned": True, "running_drains": []}
    assert kvctl(cluster.endpoint, "uncordon", "agent-d").stdout.strip() == "agent-d was not cordoned"
    assert [a["cordon_reason"] for a in j(cluster, "agents")] == [""]
