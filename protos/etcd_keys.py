"""The etcd side of the contract: key layout under the versioned root, and how a
process connects. Everything durable lives here; the block index never does.

    /kvcp/v1/agents/<agent_id>          AgentInfo (JSON), attached to the agent's lease
    /kvcp/v1/pins/<namespace>/<pin_id>  Pin
    /kvcp/v1/config/policy              Policy
    /kvcp/v1/ops/<op_id>                Operation
    /kvcp/v1/election/leader            leader address, under the leader's lease;
                                        its create_revision is the epoch
    /kvcp/v1/locks/<name>               distributed locks
"""

from __future__ import annotations

import time

ROOT = "/kvcp/v1/"
AGENTS_PREFIX = ROOT + "agents/"
PINS_PREFIX = ROOT + "pins/"
POLICY_KEY = ROOT + "config/policy"
OPS_PREFIX = ROOT + "ops/"
LEADER_KEY = ROOT + "election/leader"
LOCKS_PREFIX = ROOT + "locks/"


def agent_key(agent_id: str) -> str:
    return AGENTS_PREFIX + agent_id


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' -> [(h1, 2379), (h2, 2379)]; ValueError naming the bad part."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"etcd endpoint {part!r} is not host:port")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


def connect(endpoints: str, timeout_seconds: float = 5.0, wait_seconds: float = 0.0, log=print):
    """A pyetcd client to the first endpoint that answers. Retries for `wait_seconds`,
    saying so through `log`; raises ConnectionError with a sentence when none answers."""
    import pyetcd

    targets = parse_endpoints(endpoints)
    deadline = time.monotonic() + wait_seconds
    said = False
    while True:
        last_error = ""
        for host, port in targets:
            client = pyetcd.client(host=host, port=port, timeout=timeout_seconds)
            try:
                client.status()
                return client
            except Exception as exc:  # noqa: BLE001 - any failure means "try the next"
                last_error = f"{host}:{port}: {type(exc).__name__}"
                client.close()
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"etcd is not reachable at {endpoints} ({last_error}); start etcd "
                f"(make demo does) or pass --etcd HOST:PORT"
            )
        if not said:
            log(f"waiting for etcd at {endpoints} ({last_error}) ...")
            said = True
        time.sleep(0.5)
