"""End to end: an agent restarted with a mistyped `--model` keeps that model's disk blocks
parked and says why in its log (not that they wait for their prefix), `kvctl agents`
shows them parked, and a restart with the model as it was served finds them again.
Console-script processes and a real etcd."""

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
OTHER = "other-model:block_size=16,num_layers=2,num_kv_heads=2,head_dim=32,dtype=float16"


def test_a_restart_with_a_wrong_model_parks_its_disk_blocks_and_says_why(etcd, tmp_path):
    c = Cluster(etcd, tmp_path)
    disk = ["--disk-dir", str(tmp_path / "disk"), "--disk-capacity", "64MiB", "--transfer-engine", "none"]
    log = tmp_path / "agent-p.log"
    try:
        c.start_controlplane()
        c.start_agent("agent-p", None, 3, *disk)
        c.wait_serving("agent-p")
        wait_for(lambda: c.agents().get("agent-p", {}).get("state") == "ready", 30, 0.3, "agent ready")
        prompt = tmp_path / "prompt.txt"
        store = [sys.executable, str(STORE_PROMPT), "--agent", f"127.0.0.1:{c.agent_ports['agent-p']}"]
        proc = subprocess.run(
            [*store, "--controlplane", c.endpoint, "--tokens", str(5 * M.block_size), "--out", str(prompt)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        move = ["move", "--model", M.model_id, "--tokens-file", str(prompt), "--to", "disk", "--wait"]
        assert "SUCCEEDED, 5/5 blocks" in kvctl(c.endpoint, *move).stdout

        def hit() -> list[tuple[str, int, list[str]]]:
            out = kvctl(c.endpoint, "-o", "json", "lookup", "--model", M.model_id, "--tokens-file", str(prompt))
            return [(a["agent_id"], a["num_hit_blocks"], a["tiers"]) for a in json.loads(out.stdout)["agents"]]

        assert hit() == [("agent-p", 5, ["disk"] * 5)]

        def restart(*model: str) -> str:
            c.procs["agent-p"].terminate()
            c.procs["agent-p"].wait(20)
            start = len(log.read_text())
            c.start_agent("agent-p", None, 3, *disk, *model)
            c.wait_serving("agent-p")
            wait_for(lambda: c.agents().get("agent-p", {}).get("state") == "ready", 30, 0.3, "agent ready again")
            return log.read_text()[start:]

        said = restart("--model", OTHER)
        assert "5 recovered blocks" in said and "this agent does not serve it (--model)" in said, said
        recovered = next(line for line in said.splitlines() if "disk tier" in line and "recovered 0 blocks" in line)
        # the summary line names them as parked for their model, not as tails waiting for a prefix
        assert "0 more waiting for their prefix" in recovered and "5 parked for their model" in recovered, recovered
        disk_tier = next(t for t in c.agents()["agent-p"]["tiers"] if t["tier"] == "disk")
        assert disk_tier["num_parked_blocks"] == 5 and disk_tier["num_blocks"] == 0, disk_tier
        assert "5 blocks parked after a restart" in kvctl(c.endpoint, "agents").stdout

        said = restart()  # the model as it was served (the default, demo-model)
        assert "recovered 5 blocks, 0 more waiting for their prefix" in said, said
        wait_for(lambda: hit() == [("agent-p", 5, ["disk"] * 5)], 10, 0.2, "found again")
    finally:
        c.stop()
