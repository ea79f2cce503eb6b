"""End to end: `kvctl drain` as an operator runs it before taking an agent down, against
console-script processes (control plane, two agents) and a real etcd."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from agent.client import EngineClient
from agent.server import DEMO_MODEL
from tests.e2e.test_console_scripts import Cluster, kvctl
from tests.helpers import wait_for

M = DEMO_MODEL
STORE_PROMPT = Path(__file__).resolve().parents[2] / "scripts" / "store_prompt.py"


def test_kvctl_drain_moves_an_agents_prefixes_before_maintenance(etcd, tmp_path):
    c = Cluster(etcd, tmp_path)
    try:
        c.start_controlplane()
        c.start_agent("agent-a")
        c.start_agent("agent-b")
        c.wait_serving("agent-a", "agent-b")
        wait_for(lambda: {a["state"] for a in c.agents().values()} == {"ready"} and len(c.agents()) == 2, 30, 0.3)
        prompt = tmp_path / "prompt.txt"
        store = [sys.executable, str(STORE_PROMPT), "--agent", f"127.0.0.1:{c.agent_ports['agent-a']}"]
        proc = subprocess.run(
            [*store, "--controlplane", c.endpoint, "--tokens", str(6 * M.block_size), "--out", str(prompt)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr

        def holders() -> list[tuple[str, int]]:
            out = kvctl(c.endpoint, "-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(prompt))
            return [(a["agent_id"], a["num_hit_blocks"]) for a in json.loads(out.stdout)["agents"]]

        wait_for(lambda: holders() == [("agent-a", 6)], 10, 0.2, "stored on agent-a")
        out = kvctl(c.endpoint, "drain", "agent-a", "--reason", "kernel upgrade", "--wait").stdout
        assert "SUCCEEDED" in out and "drain" in out and "agent-b" in out, out
        table = kvctl(c.endpoint, "agents").stdout
        assert "agent-a: cordoned (kernel upgrade)" in table, table
        wait_for(lambda: holders() == [("agent-b", 6)], 10, 0.2, "found on agent-b (agent-a cordoned)")
        again = json.loads(kvctl(c.endpoint, "-o", "json", "drain", "agent-a", "--wait").stdout)
        assert again["state"] == "SUCCEEDED" and again["moved_bytes"] == 0, again  # all there already
        bad = kvctl(c.endpoint, "drain", "agent-b", check=False)  # the only other agent is cordoned
        assert bad.returncode == 1 and "no ready agent in rotation" in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
        typo = kvctl(c.endpoint, "drain", "agent-typo", check=False)
        assert typo.returncode == 1 and "AGENT_ID (agent_id): no agent 'agent-typo'" in typo.stderr, typo.stderr
        assert kvctl(c.endpoint, "uncordon", "agent-a").stdout.strip() == "uncordoned agent-a"
        wait_for(lambda: sorted(holders()) == [("agent-a", 6), ("agent-b", 6)], 10, 0.2, "both in rotation")
    finally:
        c.stop()


def test_kvctl_drain_wait_exits_3_naming_the_blocks_it_left_when_the_destinations_lack_room(etcd, tmp_path):
    """A drain that could place only part of an agent's blocks ends SUCCEEDED with the rest
    counted failed; `--wait` then exits 3 (not 0), so `kvctl drain X --wait && restart X`
    does not take down an agent that still holds blocks nobody else has."""
    c = Cluster(etcd, tmp_path)
    try:
        c.start_controlplane()
        c.start_agent("agent-a")
        c.start_agent("agent-b", None, 3, "--cpu-capacity", "64KiB")  # 8 blocks of 8 KiB
        c.wait_serving("agent-a", "agent-b")
        wait_for(lambda: {a["state"] for a in c.agents().values()} == {"ready"} and len(c.agents()) == 2, 30, 0.3)
        engine = EngineClient(f"127.0.0.1:{c.agent_ports['agent-a']}")
        for k in range(4):  # four prompts of 6 blocks: agent-b has room for one
            engine.store(M.model_id, list(range(1000 * k, 1000 * k + 6 * M.block_size)), bytes(6 * M.block_bytes))
        engine.close()
        wait_for(lambda: c.agents()["agent-a"]["num_blocks"] == 24, 10, 0.2, "24 blocks indexed on agent-a")
        out = kvctl(c.endpoint, "drain", "agent-a", "--wait", check=False)
        assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
        assert "SUCCEEDED" in out.stdout, out.stdout
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        left = re.search(r"drain (\S+) left (\d+) of 24 blocks on agent-a \(why: `kvctl op \1`\)", out.stderr)
        assert left and 0 < int(left.group(2)) < 24, out.stderr
        assert f"{24 - int(left.group(2))}/24 blocks, {left.group(2)} failed" in out.stdout, out.stdout
    finally:
        c.stop()
