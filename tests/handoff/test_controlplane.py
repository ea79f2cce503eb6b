"""The control plane's side: `transfer` operations fanned out to the source agent,
Route over live agents' reports, and `kvctl transfer` / `kvctl route` as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import torch

from cli.client import ClientError, ControlPlaneClient
from tests.handoff.support import BIG, prompt
from tests.helpers import script, wait_for


def _unless_etcd_away(call):
    """`call()`, or None where the control plane refused it for an unreachable etcd."""
    try:
        return call()
    except ClientError as exc:
        if exc.kind != "EtcdUnreachable":
            raise
        return None


def test_transfer_operation_and_route(controlplane, make_agent, tmp_path):
    a = make_agent("pre", models=[BIG], cpu_capacity_bytes=24 << 20, role="prefill", transfer_engine="none")
    b = make_agent("dec", models=[BIG], cpu_capacity_bytes=24 << 20, role="decode", transfer_engine="none")
    make_agent("small", models=[BIG], cpu_capacity_bytes=2 << 20, role="decode", transfer_engine="none")
    tokens, kv, hashes = prompt(BIG, 6, seed=21)
    a.engine.store(BIG.model_id, tokens, kv)
    c = ControlPlaneClient(controlplane.address)
    wait_for(lambda: c.lookup(BIG.model_id, tokens).best_agent_id == "pre", 10, what="prefill agent indexed")
    # the control plane sends the whole prefix even while the index still lags (not all 6 yet)

    looked_up = controlplane.cluster.lookups_total
    # refused while etcd stalls (a clean-clone CI run's did): nothing was made, so asked again
    deadline = time.monotonic() + 30
    while (
        op := _unless_etcd_away(lambda: c.transfer(BIG.model_id, "pre", "dec", token_ids=tokens, deadline_seconds=10))
    ) is None:
        assert time.monotonic() < deadline, "etcd stayed unreachable for 30 s"
        time.sleep(0.5)
    assert op.kind == "transfer" and op.params["to"] == "dec"
    op = c.wait_operation(op.op_id, timeout_seconds=20)
    assert controlplane.cluster.lookups_total == looked_up  # its own lookup is no router's
    assert (op.state, op.num_done_blocks, op.num_total_blocks, op.moved_bytes) == (
        "SUCCEEDED",
        6,
        6,
        6 * BIG.block_bytes,
    ), op
    assert torch.equal(b.engine.load(BIG.model_id, tokens).kv, kv)
    wait_for(
        lambda: any(m.agent_id == "dec" and m.num_hit_blocks == 6 for m in c.lookup(BIG.model_id, tokens).agents), 10
    )

    # bad input: a clear error, no operation
    with pytest.raises(ClientError) as e:
        c.transfer(BIG.model_id, "pre", "nobody", token_ids=tokens)
    assert e.value.code == "NOT_FOUND" and "nobody" in str(e.value)
    _, _, other = prompt(BIG, 2, seed=22)
    with pytest.raises(ClientError) as e:
        c.transfer(BIG.model_id, "pre", "dec", block_hashes=b"".join(other))
    assert e.value.code == "FAILED_PRECONDITION" and "holds no block" in str(e.value)
    with pytest.raises(ClientError) as e:
        c.transfer(BIG.model_id, "pre", "small", token_ids=tokens)
    assert e.value.code == "FAILED_PRECONDITION" and "needs" in str(e.value)

    # Route: prefill on the agent with the prefix; decode on one with room (its link now measured)
    wait_for(lambda: controlplane.cluster.dataplane.view("pre") is not None, 5)
    r = c.route(BIG.model_id, tokens, role="pair")
    assert r.prefill_agent_id == "pre" and r.disaggregate and r.decode_agent_id == "dec", r
    assert {x.agent_id for x in r.candidates} >= {"pre", "dec", "small"}
    small = next(x for x in r.candidates if x.agent_id == "small")
    assert small.behind
    looked_up = controlplane.cluster.lookups_total  # a request's decode Route: not a second lookup
    assert c.route(BIG.model_id, tokens, role="decode", prefill_agent_id="pre").decode_agent_id == "dec"
    assert controlplane.cluster.lookups_total == looked_up

    # the same from the console script
    f = tmp_path / "prompt.txt"
    f.write_text(",".join(map(str, tokens)))
    kvctl = [script("kvctl"), "--endpoint", controlplane.address]
    p = subprocess.run(
        [*kvctl, "-o", "json", "route", "--model", BIG.model_id, "--tokens-file", str(f)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["decode_agent_id"] == "dec"
    b.pool.cleanup(0)

    def transfer(to: str) -> subprocess.CompletedProcess:
        argv = [*kvctl, "transfer", "--model", BIG.model_id, "--tokens-file", str(f), "--from", "pre", "--to", to]
        return subprocess.run([*argv, "--wait"], capture_output=True, text=True, timeout=60)

    p = transfer("dec")
    assert p.returncode == 0 and "SUCCEEDED" in p.stdout and "6/6 blocks" in p.stdout, (p.stdout, p.stderr)
    assert re.search(r", via (shm|grpc) in \d+\.\d\ds", p.stdout), p.stdout  # the path it took
    p = transfer("dec")  # again: the destination has it all, and says so
    assert p.returncode == 0 and "6 blocks already on the destination" in p.stdout, (p.stdout, p.stderr)
    p = transfer("x")
    assert p.returncode != 0 and "no agent 'x'" in p.stderr and "Traceback" not in p.stderr
    c.close()
