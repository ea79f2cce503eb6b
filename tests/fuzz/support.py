"""What the fuzz tests share: a small live cluster (the suite's in-process control plane,
real etcd, two real agents holding known prompts), raw gRPC stubs, hypothesis
strategies for hostile field values, and the invariants checked after every example.

Invariants: the server keeps answering GetStats; every failed call carries one of the
status codes in ALLOWED (never UNKNOWN or INTERNAL); the block index is internally
consistent and agrees with what the agents really hold."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from agent.server import DEMO_MODEL
from protos.block_hash import BLOCK_HASH_BYTES, hash_prefix, split_hashes
from protos.kvcp.v1 import admin_pb2, admin_pb2_grpc, agent_pb2_grpc, types_pb2
from tests.helpers import wait_for

M = DEMO_MODEL
BS = M.block_size

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}

# modest example counts: tests/fuzz as a whole stays around a minute on 2 shared cores
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)


def kv(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, *M.block_shape), generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def model_pb() -> types_pb2.ModelSpec:
    return types_pb2.ModelSpec(
        model_id=M.model_id,
        block_size=M.block_size,
        num_layers=M.num_layers,
        num_kv_heads=M.num_kv_heads,
        head_dim=M.head_dim,
        dtype=M.dtype,
    )


@dataclass
class LiveCluster:
    cp: object  # controlplane.server.ControlPlane
    agents: list  # agent.server.Agent
    prompts: list[list[int]]  # token ids stored on the agents before fuzzing
    channel: grpc.Channel
    admin: admin_pb2_grpc.AdminServiceStub
    sync: agent_pb2_grpc.AgentServiceStub

    @property
    def agent_ids(self) -> list[str]:
        return [a.agent_id for a in self.agents]

    @property
    def known_hashes(self) -> list[bytes]:
        return [h for p in self.prompts for h in split_hashes(hash_prefix(M.model_id, p, BS))]


def start_cluster(controlplane, make_agent) -> LiveCluster:
    """Two agents with a few prefixes each (one shared), fully indexed."""
    a1, a2 = make_agent("fuzz-a1"), make_agent("fuzz-a2")
    shared, only1, only2 = tokens(6), tokens(4, start=50_000), tokens(3, start=90_000)
    a1.engine.store(M.model_id, shared, kv(6), namespace="chat")
    a1.engine.store(M.model_id, only1, kv(4, seed=1), namespace="legal-kb")
    a2.engine.store(M.model_id, shared[: 4 * BS], kv(4))
    a2.engine.store(M.model_id, only2, kv(3, seed=2))
    channel = grpc.insecure_channel(controlplane.address)
    live = LiveCluster(
        controlplane,
        [a1, a2],
        [shared, only1, only2],
        channel,
        admin_pb2_grpc.AdminServiceStub(channel),
        agent_pb2_grpc.AgentServiceStub(channel),
    )
    wait_for(lambda: index_matches_agents(live) is None, 20, 0.1, "agents indexed")
    return live


def code_of(call, request, timeout: float = 10.0) -> grpc.StatusCode:
    try:
        call(request, timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def check_code(what: str, code: grpc.StatusCode, details: str = "") -> None:
    assert code == grpc.StatusCode.OK or code in ALLOWED, f"{what} answered {code.name}: {details}"


def check_alive(live: LiveCluster) -> None:
    """The server answers GetStats. On a starved machine its election lease may lapse for
    a moment (it then answers FAILED_PRECONDITION, not leader): wait for it to lead again."""
    try:
        if live.admin.GetStats(admin_pb2.GetStatsRequest(), timeout=10).is_leader:
            return
    except grpc.RpcError as exc:
        check_code("GetStats", exc.code(), exc.details())

    def leads() -> bool:
        return live.admin.GetStats(admin_pb2.GetStatsRequest(), timeout=10).is_leader

    wait_for(leads, 20, 0.2, "the control plane to lead again")


def check_index(live: LiveCluster) -> None:
    """The index's own bookkeeping agrees with its contents, and every indexed agent is
    a registered one (Cluster's invariant)."""
    cluster = live.cp.cluster
    with cluster._lock:  # one consistent snapshot: the cluster's lock guards the index
        index = cluster.index
        registered = {r.agent_id for r, _ in cluster.agents()}
        union: set[bytes] = set()
        total = 0
        for agent_id in index.agents():
            blocks = index.agent_blocks(agent_id)
            n = index.num_agent_blocks(agent_id)
            assert len(blocks) == n, f"{agent_id}: {len(blocks)} blocks listed, {n} counted"
            assert all(len(h) == BLOCK_HASH_BYTES for h in blocks)
            assert n == 0 or agent_id in registered, f"index holds blocks of unregistered agent {agent_id!r}"
            for h, tier in list(blocks.items())[:64]:
                assert index.holders(h).get(agent_id) == tier, f"holders() disagrees for {agent_id}"
            union |= blocks.keys()
            total += n
        assert total == index.num_replicas, f"num_replicas {index.num_replicas} != sum over agents {total}"
        assert len(union) == index.num_blocks, f"num_blocks {index.num_blocks} != distinct blocks {len(union)}"


def index_matches_agents(live: LiveCluster) -> str | None:
    """None when the index holds exactly what each real agent's pool holds (and in the
    same tier), and a lookup of each stored prompt matches the agent's own answer."""
    cluster = live.cp.cluster
    for a in live.agents:
        with a.pool.lock:
            truth = {h: int(m.tier) for h, m in a.pool.blocks.items() if m.visible}
        with cluster._lock:
            indexed = {h: int(t) for h, t in cluster.index.agent_blocks(a.agent_id).items()}
        if truth != indexed:
            return f"{a.agent_id}: agent holds {len(truth)} blocks, index {len(indexed)} ({len(truth.keys() ^ indexed.keys())} differ)"
    for prompt in live.prompts:
        result = cluster.lookup(M.model_id, token_ids=prompt)
        hits = {m.agent_id: m.num_hit_blocks for m in result.matches}
        for a in live.agents:
            want = a.pool.num_leading(split_hashes(hash_prefix(M.model_id, prompt, BS)))
            if hits.get(a.agent_id, 0) != want:
                return f"lookup: {a.agent_id} holds {want} leading blocks, index says {hits.get(a.agent_id, 0)}"
    return None


def check_consistent_with_agents(live: LiveCluster, timeout_seconds: float = 20.0) -> None:
    """After fuzzing, once agents have reported: the index is exactly the agents' truth."""
    check_index(live)
    wait_for(lambda: index_matches_agents(live) is None, timeout_seconds, 0.2, "index to match the agents")


# ---- strategies -------------------------------------------------------------------
#
# A request is mostly valid with a few hostile fields (one garbage field behind another
# would never be reached: the first check rejects the call), and now and then hostile
# throughout. `hostile_fields` picks which.

FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 1.0, 5.0, 3600.0, 1e300, -1e300, math.nan, math.inf, -math.inf, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 100, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
UINT64 = st.one_of(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
# proto3 enums are open: any int32 reaches the server
ENUM = st.one_of(st.integers(-1, 6), st.sampled_from([-(2**31), 2**31 - 1, 99]))
GARBAGE_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24
)  # control chars, RTL marks, emoji, NUL
BIG_TEXT = st.sampled_from([1000, 70_000, 300_000]).map(lambda n: "n" * n)
TIERS = st.sampled_from([1, 2, 3])  # gpu, cpu, disk


def texts(*known: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), st.sampled_from(known) if known else st.nothing(), GARBAGE_TEXT, BIG_TEXT)


@st.composite
def hostile_fields(draw, names: list[str]) -> set[str]:
    if draw(st.integers(0, 7)) == 0:
        return set(names)
    return draw(st.sets(st.sampled_from(names), max_size=min(2, len(names))))


@st.composite
def fields(draw, valid: dict, hostile: dict) -> dict:
    """Values for every field named in `valid` or `hostile`: hostile for a few of them."""
    bad = draw(hostile_fields(sorted(hostile)))
    out = {}
    for name in sorted(valid.keys() | hostile.keys()):
        strategy = hostile[name] if name in bad else valid.get(name)
        if strategy is not None:
            out[name] = draw(strategy)
    return out


def packed_hashes(live: LiveCluster) -> st.SearchStrategy[bytes]:
    real = live.known_hashes
    return st.one_of(
        st.just(b""),
        st.binary(max_size=70),  # mostly not a multiple of 16
        st.lists(st.binary(min_size=16, max_size=16), max_size=6).map(b"".join),
        st.lists(st.sampled_from(real), min_size=1, max_size=8).map(b"".join),  # real, maybe out of order
        st.sampled_from([1 << 16, (1 << 16) + 1]).map(lambda n: b"\x07" * (16 * n)),  # at and over the block limit
        st.sampled_from([15, 17, 31, 33]).map(lambda n: b"\x01" * n),
    )


def token_lists(live: LiveCluster) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.just([]),
        st.lists(UINT32, max_size=3 * BS + 3),
        st.sampled_from([BS - 1, 1 << 20, (1 << 20) + 1]).map(
            lambda n: [2**32 - 1] * n
        ),  # out of vocab, at/over the cap
    )


def valid_prefixes(live: LiveCluster) -> st.SearchStrategy[tuple[list[int], bytes]]:
    """(token_ids, block_hashes) naming a real stored prefix (or part of one), one way or the other."""
    real_hashes = [split_hashes(hash_prefix(M.model_id, p, BS)) for p in live.prompts]
    return st.one_of(
        st.tuples(st.sampled_from(live.prompts), st.just(b"")),
        st.tuples(st.sampled_from(live.prompts).map(lambda p: p[: len(p) // 2 + 3]), st.just(b"")),
        st.tuples(st.just([]), st.sampled_from(real_hashes).map(b"".join)),
    )


def hostile_prefixes(live: LiveCluster) -> st.SearchStrategy[tuple[list[int], bytes]]:
    """Both, neither, or one of them hostile."""
    return st.one_of(
        st.tuples(token_lists(live), st.just(b"")),
        st.tuples(st.just([]), packed_hashes(live)),
        st.tuples(token_lists(live), packed_hashes(live)),
    )


@st.composite
def prefix_message(draw, live: LiveCluster, cls, valid: dict | None = None, hostile: dict | None = None):
    """A message with model_id / token_ids / block_hashes / extra_keys (Scope, LookupRequest, ...)."""
    values = draw(
        fields(
            {"model_id": st.just(M.model_id), "prefix": valid_prefixes(live), **(valid or {})},
            {
                "model_id": texts("other-model"),
                "prefix": hostile_prefixes(live),
                "extra_keys": st.lists(texts(), min_size=1, max_size=3),
                **(hostile or {}),
            },
        )
    )
    values["token_ids"], values["block_hashes"] = values.pop("prefix")
    return cls(**values)


def scopes(live: LiveCluster) -> st.SearchStrategy[admin_pb2.Scope]:
    namespace = {"namespace": texts("default", "chat", "legal-kb", "fuzz")}
    agent_id = {"agent_id": st.one_of(st.just(""), st.sampled_from(live.agent_ids))}
    hostile = {**namespace, "agent_id": texts("no-such-agent")}
    return st.one_of(
        prefix_message(live, admin_pb2.Scope, agent_id, hostile),
        # a whole namespace
        fields({"namespace": st.sampled_from(["chat", "legal-kb"]), **agent_id}, hostile).map(
            lambda v: admin_pb2.Scope(**v)
        ),
    )
