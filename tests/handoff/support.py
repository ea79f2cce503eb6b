"""Helpers of the handoff tests: a model with 1 MiB blocks, KV with a known fill, agent
processes started from the real console script."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch

from agent.core.model_spec import ModelSpec
from agent.store.transfer_engine import open_engine
from protos.block_hash import hash_prefix, split_hashes
from tests.helpers import free_port, script, wait_for

# 8 layers x 2 x 32 tokens x 8 heads x 128 x fp16 = 1 MiB per block
BIG = ModelSpec("big", block_size=32, num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
SMALL = ModelSpec("small", block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16")


def engine_works() -> str:
    """'' when the Mooncake engine starts here, else why not."""
    e = open_engine()
    try:
        return "" if e.available else e.status
    finally:
        e.close()


def prompt(model: ModelSpec, num_blocks: int, seed: int = 0):
    """Token ids of `num_blocks` full blocks, their KV (random, reproducible) and hashes."""
    tokens = [seed * 1_000_003 + i for i in range(num_blocks * model.block_size)]
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((num_blocks, *model.block_shape), generator=g).to(model.torch_dtype)
    hashes = split_hashes(hash_prefix(model.model_id, tokens, model.block_size))
    return tokens, kv, hashes


class AgentProcess:
    """A kvcp-agent started as a user would, on free ports."""

    def __init__(self, agent_id: str, etcd: str, *extra: str, model: ModelSpec = BIG, cpu: str = "96MiB"):
        self.agent_id = agent_id
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        self.proc = subprocess.Popen(
            [
                script("kvcp-agent"),
                "--agent-id",
                agent_id,
                "--listen",
                self.address,
                "--etcd",
                etcd,
                "--model",
                model.format(),
                "--cpu-capacity",
                cpu,
                "--metrics-listen",
                "",
                "--lease-ttl-seconds",
                "2",
                "--log-level",
                "WARNING",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def wait_registered(self, etcd_client, timeout_seconds: float = 20.0) -> None:
        from protos.etcd_keys import agent_key

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"agent {self.agent_id} exited: {self.proc.stderr.read()[-2000:]}")
            return etcd_client.get(agent_key(self.agent_id))[0] is not None

        wait_for(up, timeout_seconds, what=f"agent {self.agent_id} in etcd")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_until(predicate, timeout_seconds: float, interval_seconds: float = 0.005) -> float:
    """Seconds until `predicate()` held (AssertionError at the timeout)."""
    start = time.monotonic()
    wait_for(predicate, timeout_seconds, interval_seconds)
    return time.monotonic() - start
