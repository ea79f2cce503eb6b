"""A small synthetic serving workload that makes a cluster live: multi-turn chat
sessions that share a few system prompts, and documents whose popularity is Zipf.

Each request is routed like a KV-aware router would: ask the control plane which agent
holds the longest cached prefix (Lookup), pick the agent with the least work (blocks to
compute, plus its share of recent requests beyond a fair one: a router that only
followed cached prefixes would send everything to the agent that holds the shared
system prompts, and an agent that restarted empty would never get a request), load the
prefix from it, "compute" the rest, and store the new blocks. The KV of a block is a fill derived from its hash,
so every loaded block is checked: a wrong byte is counted as corruption.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from agent.client import EngineClient
from cli.client import ControlPlaneClient
from protos.block_hash import hash_prefix, split_hashes

DTYPES = {"float16": np.float16, "bfloat16": np.float16, "float32": np.float32}


@dataclass
class WorkloadStats:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    hit_tokens_total: int = 0
    stored_blocks_total: int = 0
    corrupt_blocks_total: int = 0
    errors_total: int = 0
    per_agent_requests: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0


@dataclass(frozen=True)
class WorkloadConfig:
    num_system_prompts: int = 4
    system_prompt_tokens: int = 256
    num_documents: int = 200
    document_tokens: tuple[int, int] = (128, 768)
    zipf_s: float = 1.1
    turn_tokens: tuple[int, int] = (32, 160)
    continue_probability: float = 0.6
    max_active_sessions: int = 64
    max_turns: int = 8
    vocab_size: int = 32000
    seed: int = 0


class PromptGenerator:
    """Deterministic prompts: the same seed gives the same request stream."""

    def __init__(self, cfg: WorkloadConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        r = np.random.default_rng(cfg.seed)
        self.system_prompts = [
            r.integers(0, cfg.vocab_size, cfg.system_prompt_tokens).tolist() for _ in range(cfg.num_system_prompts)
        ]
        self.documents = [
            r.integers(0, cfg.vocab_size, int(r.integers(*cfg.document_tokens))).tolist()
            for _ in range(cfg.num_documents)
        ]
        weights = 1.0 / np.arange(1, cfg.num_documents + 1) ** cfg.zipf_s
        self.doc_cdf = np.cumsum(weights / weights.sum())
        self.sessions: list[list[int]] = []
        self.session_namespaces: list[str] = []
        self.last_namespace = "chat"  # namespace of the prompt next_prompt() returned last
        self._np = r

    def _turn(self) -> list[int]:
        return self._np.integers(0, self.cfg.vocab_size, self.rng.randint(*self.cfg.turn_tokens)).tolist()

    def next_prompt(self) -> list[int]:
        cfg = self.cfg
        if self.sessions and self.rng.random() < cfg.continue_probability:
            i = self.rng.randrange(len(self.sessions))
            prompt = self.sessions[i] + self._turn()  # previous context + answer + new user turn
            self.last_namespace = self.session_namespaces[i]
            if len(prompt) > cfg.system_prompt_tokens + cfg.document_tokens[1] + cfg.max_turns * cfg.turn_tokens[1]:
                self.sessions.pop(i)
                self.session_namespaces.pop(i)
            else:
                self.sessions[i] = prompt + self._turn()
            return prompt
        prompt = list(self.rng.choice(self.system_prompts))
        self.last_namespace = "chat"
        if self.rng.random() < 0.7:  # questions about a document of the knowledge base
            doc = int(np.searchsorted(self.doc_cdf, self.rng.random()))
            prompt += self.documents[min(doc, cfg.num_documents - 1)]
            self.last_namespace = "legal-kb"
        prompt += self._turn()
        if len(self.sessions) >= cfg.max_active_sessions:
            j = self.rng.randrange(len(self.sessions))
            self.sessions.pop(j)
            self.session_namespaces.pop(j)
        self.sessions.append(prompt + self._turn())
        self.session_namespaces.append(self.last_namespace)
        return prompt


def _codec_exact_fills() -> list[float]:
    """Integers under 2048 (exact in fp16) that a block holding only that value keeps
    exactly through every codec: the demo compresses namespaces with lossy codecs, and a
    value int8 or fp8 rounds (8 and 180 of the 2048 do) would be counted as corruption."""
    import torch

    from agent.core import codecs

    values = torch.arange(2048, dtype=torch.float16)
    x = values.reshape(-1, 1, 1, 1, 1, 1).expand(-1, 1, 2, 1, 1, 8).contiguous()  # blocks [L, 2, T, H, D]
    exact = torch.ones(2048, dtype=torch.bool)
    for codec in codecs.available_codecs():
        for i in range(2048):
            if exact[i] and not torch.equal(
                codecs.decode(codec, codecs.encode(codec, x[i]), x[i].shape, x.dtype), x[i]
            ):
                exact[i] = False
    return [float(v) for v in values[exact]]


_FILLS: list[float] = []


def block_fill(block_hash: bytes) -> float:
    """The value every element of a block's KV holds in this workload (exact in fp16 and
    through every codec)."""
    if not _FILLS:
        _FILLS.extend(_codec_exact_fills())
    return _FILLS[int.from_bytes(block_hash[:2], "little") % len(_FILLS)]


RECENT_REQUESTS = 50  # the window an agent's share of requests is counted over
LOAD_BLOCKS_PER_REQUEST = 0.5  # a request over its fair share costs as much as computing this many blocks


class Workload:
    def __init__(self, controlplane: str, rate_per_second: float = 10.0, cfg: WorkloadConfig | None = None):
        self.controlplane = controlplane
        self.rate_per_second = rate_per_second
        self.cfg = cfg or WorkloadConfig()
        self.prompts = PromptGenerator(self.cfg)
        self.stats = WorkloadStats()
        self._engines: dict[str, EngineClient] = {}
        self._rng = random.Random(self.cfg.seed + 1)
        self._models: dict[str, dict] = {}
        self._recent: collections.deque[str] = collections.deque(maxlen=RECENT_REQUESTS)

    def _engine(self, agent_id: str, address: str) -> EngineClient:
        e = self._engines.get(agent_id)
        if e is None or e.address != address:
            e = self._engines[agent_id] = EngineClient(address)
        return e

    def run_request(self, cp: ControlPlaneClient, agents: dict[str, tuple[str, dict]]) -> None:
        prompt = self.prompts.next_prompt()
        agent_id = next(iter(agents))
        model = agents[agent_id][1]
        model_id, block_size = model["model_id"], model["block_size"]
        view = cp.lookup(model_id, prompt)
        serving = {a: v for a, v in agents.items() if v[1]["model_id"] == model_id}
        agent_id = self.choose(serving, len(prompt) // block_size, {m.agent_id: m.num_hit_blocks for m in view.agents})
        engine = self._engine(agent_id, agents[agent_id][0])
        hashes = split_hashes(hash_prefix(model_id, prompt, block_size))
        loaded = engine.load(model_id, prompt)
        n_cached = loaded.num_cached_tokens // block_size
        dtype = DTYPES[model["dtype"]]
        if n_cached:
            arr = np.frombuffer(loaded.kv, dtype=dtype).reshape(n_cached, -1)
            for i in range(n_cached):
                if not np.all(arr[i] == block_fill(hashes[i])):
                    self.stats.corrupt_blocks_total += 1
        new = hashes[n_cached:]
        if new:
            kv = np.empty((len(new), model["block_elems"]), dtype=dtype)
            for i, h in enumerate(new):
                kv[i] = block_fill(h)
            stored = engine.store(
                model_id, prompt, kv.tobytes(), first_block=n_cached, namespace=self.prompts.last_namespace
            ).num_stored_blocks
            self.stats.stored_blocks_total += stored
        self.stats.requests_total += 1
        self.stats.prompt_tokens_total += len(prompt)
        self.stats.hit_tokens_total += loaded.num_cached_tokens
        self.stats.per_agent_requests[agent_id] = self.stats.per_agent_requests.get(agent_id, 0) + 1
        self._recent.append(agent_id)

    def choose(self, agents, num_blocks: int, hit_blocks: dict[str, int]) -> str:
        """The agent with the least work for this request: blocks to compute there, plus
        LOAD_BLOCKS_PER_REQUEST for each of its recent requests beyond a fair share."""
        fair = len(self._recent) / len(agents)
        counts = collections.Counter(self._recent)

        def cost(a: str) -> float:
            return num_blocks - hit_blocks.get(a, 0) + LOAD_BLOCKS_PER_REQUEST * (counts[a] - fair)

        return min(agents, key=lambda a: (cost(a), self._rng.random()))

    def run(self, stop: threading.Event, duration_seconds: float | None = None, report=None) -> WorkloadStats:
        # the fill table (a few seconds of codec round trips on a busy machine) is made before
        # the clock starts: a short run's duration went on it inside its first request
        block_fill(b"\0\0")
        deadline = time.monotonic() + duration_seconds if duration_seconds else None
        interval = 1.0 / self.rate_per_second if self.rate_per_second > 0 else 0.0
        next_report = time.monotonic() + 10
        with ControlPlaneClient(self.controlplane) as cp:
            agents: dict[str, tuple[str, dict]] = {}
            refreshed = 0.0
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                t0 = time.monotonic()
                try:
                    if t0 - refreshed > 2.0 or not agents:
                        agents = {
                            a.agent_id: (a.address, self._model_of(cp, a.models[0]))
                            for a in cp.list_agents()
                            if a.state == "ready" and a.models and not a.cordon_reason  # a router's view
                        }
                        refreshed = t0
                    if agents:
                        self.run_request(cp, agents)
                    else:
                        stop.wait(0.5)
                        continue
                except Exception as exc:  # noqa: BLE001 - a demo keeps going (ClientError, gRPC errors)
                    self.stats.errors_total += 1
                    if report:
                        report(f"workload: request failed: {exc}")
                    stop.wait(0.5)
                if report and time.monotonic() >= next_report:
                    next_report += 10
                    s = self.stats
                    report(
                        f"workload: {s.requests_total} requests, hit ratio {s.hit_ratio:.1%}, "
                        f"{s.corrupt_blocks_total} corrupt blocks, {s.errors_total} errors"
                    )
                stop.wait(max(0.0, interval - (time.monotonic() - t0)))
        for e in self._engines.values():
            e.close()
        return self.stats

    def _model_of(self, cp: ControlPlaneClient, model_id: str) -> dict:
        if model_id not in self._models:
            for m in cp.stats().models:
                if m["model_id"] == model_id:
                    elems = m["num_layers"] * 2 * m["block_size"] * m["num_kv_heads"] * m["head_dim"]
                    self._models[model_id] = {**m, "block_elems": elems}
        return self._models[model_id]
