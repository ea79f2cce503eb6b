"""End to end: `kvctl drain` as an operator runs it before taking an agent down, against
console-script processes (control plane, two agents) and a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
