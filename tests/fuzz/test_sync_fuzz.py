"""The agent Sync stream with hostile message sequences, from a fake agent registered
next to two real ones: no Hello first, inventory chunks out of order or repeated, event
seq gaps and duplicates, hashes of the wrong length, unknown tiers and kinds, garbage
stats, notices and op updates. The server keeps answering with expected codes; the
index stays consistent, holds for the fake agent only hashes it was sent, never touches
what the real agents hold, and a clean resync repairs the fake agent exactly."""

from __future__ import annotations

import time

import grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import etcd_keys
from protos.kvcp.v1 import agent_pb2, types_pb2
from tests.fuzz.support import (
    ENUM,
    FLOATS,
    FUZZ,
    UINT32,
    UINT64,
    M,
    check_alive,
    check_code,
    check_index,
    index_matches_agents,
    model_pb,
    start_cluster,
    texts,
)
from tests.helpers import wait_for

FAKE = "fuzz-fake"
SYNTHETIC = [bytes([i]) * 16 for i in range(1, 40)]


def register_fake(live, etcd: str) -> object:
    """A fake agent as the control plane sees one: a lease-bound key, then Register,
    tried again as a real agent would while the control plane is not serving as the
    leader (an etcd stall of a loaded machine can lapse its leadership for a moment)."""
    client = etcd_keys.connect(etcd)
    lease = client.lease(120)
    client.put(etcd_keys.agent_key(FAKE), "{}", lease=lease)
    request = agent_pb2.RegisterRequest(
        agent=types_pb2.AgentInfo(agent_id=FAKE, address="127.0.0.1:9", models=[model_pb()])
    )

    def registered() -> bool:
        try:
            live.sync.Register(request, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                raise
            return False
        return True

    wait_for(registered, 30, 0.2, "the fake agent registered with the leader")
    return client


def strategies(live):
    pool = SYNTHETIC + live.known_hashes
    packed = st.one_of(
        st.lists(st.sampled_from(pool), max_size=6).map(b"".join),
        st.binary(max_size=40),  # wrong lengths
        st.sampled_from([1, 15, 17, 33]).map(lambda n: b"\x05" * n),
    )
    tier = st.one_of(st.sampled_from([1, 2, 3]), ENUM)
    group = st.builds(
        agent_pb2.BlockGroup,
        model_id=texts(M.model_id, M.model_id),
        tier=tier,
        block_hashes=packed,
        parent_hashes=st.one_of(st.just(b""), packed),
    )
    good_group = st.builds(
        agent_pb2.BlockGroup,
        model_id=st.just(M.model_id),
        tier=st.sampled_from([1, 2, 3]),
        block_hashes=st.lists(st.sampled_from(pool), max_size=6).map(b"".join),
    )
    # mostly well-formed groups, so that a stream gets past its first message
    groups = st.lists(st.one_of(good_group, good_group, good_group, group), max_size=3)
    small = st.one_of(st.integers(0, 6), UINT64)
    hello = st.builds(
        agent_pb2.Hello,
        agent_id=st.one_of(st.just(FAKE), st.just(FAKE), texts("no-such-agent")),
        session_id=st.one_of(st.sampled_from(["s1", "s2"]), texts()),
    )
    usage = st.builds(
        types_pb2.TierUsage,
        tier=tier,
        capacity_bytes=UINT64,
        used_bytes=UINT64,
        num_blocks=UINT64,
        uncompressed_bytes=UINT64,
        stored_bytes=UINT64,
    )
    stats = st.builds(
        agent_pb2.AgentStats,
        tiers=st.lists(usage, max_size=3),
        lookups_total=UINT64,
        lookup_tokens_total=UINT64,
        lookup_hit_tokens_total=UINT64,
        namespaces=st.lists(
            st.builds(agent_pb2.NamespaceUsage, namespace=texts("chat"), num_blocks=UINT64, uncompressed_bytes=UINT64),
            max_size=3,
        ),
    )
    op_update = st.builds(
        agent_pb2.OpUpdate,
        op_id=texts("policy-1", "pin-x"),
        state=st.one_of(st.sampled_from(["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]), texts()),
        num_done_blocks=UINT32,
        num_total_blocks=UINT32,
        num_failed_blocks=UINT32,
        moved_bytes=UINT64,
        error=texts(),
        num_skipped_pinned_blocks=UINT32,
        freed=st.lists(usage, max_size=2),
    )
    notice = st.builds(agent_pb2.Notice, kind=texts("corrupt_block"), message=texts(), unix_seconds=FLOATS)
    inventory = st.builds(
        agent_pb2.Inventory,
        seq=small,
        chunk_index=st.one_of(st.integers(0, 3), UINT32),
        last_chunk=st.booleans(),
        groups=groups,
    )
    events = st.builds(
        agent_pb2.BlockEventBatch, seq=small, kind=st.one_of(st.sampled_from([1, 2]), ENUM), groups=groups
    )
    side_message = st.one_of(
        stats.map(lambda m: agent_pb2.AgentMessage(stats=m)),
        op_update.map(lambda m: agent_pb2.AgentMessage(op_update=m)),
        notice.map(lambda m: agent_pb2.AgentMessage(notice=m)),
    )
    any_message = st.one_of(
        hello.map(lambda m: agent_pb2.AgentMessage(hello=m)),
        inventory.map(lambda m: agent_pb2.AgentMessage(inventory=m)),
        events.map(lambda m: agent_pb2.AgentMessage(events=m)),
        stats.map(lambda m: agent_pb2.AgentMessage(stats=m)),
        op_update.map(lambda m: agent_pb2.AgentMessage(op_update=m)),
        notice.map(lambda m: agent_pb2.AgentMessage(notice=m)),
        st.just(agent_pb2.AgentMessage()),
    )

    @st.composite
    def protocol_like(draw):
        """Hello, an inventory in chunks, then event batches — then perturbed."""
        session = draw(st.sampled_from(["s1", "s2", "s3"]))
        msgs = [agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=FAKE, session_id=session))]
        seq = draw(st.integers(0, 5))
        n_chunks = draw(st.integers(1, 3))
        for i in range(n_chunks):
            inv = agent_pb2.Inventory(seq=seq, chunk_index=i, last_chunk=i == n_chunks - 1, groups=draw(groups))
            msgs.append(agent_pb2.AgentMessage(inventory=inv))
        for s in range(seq + 1, seq + 1 + draw(st.integers(0, 4))):
            ev = agent_pb2.BlockEventBatch(seq=s, kind=draw(st.sampled_from([1, 2])), groups=draw(groups))
            msgs.append(agent_pb2.AgentMessage(events=ev))
        for side in draw(st.lists(side_message, max_size=3)):  # stats, op updates, notices in between
            msgs.insert(draw(st.integers(1, len(msgs))), side)
        for _ in range(draw(st.integers(0, 3))):  # swap, duplicate, drop, or insert anything
            how = draw(st.sampled_from(["swap", "dup", "drop", "insert"]))
            i = draw(st.integers(0, len(msgs) - 1))
            j = draw(st.integers(0, len(msgs) - 1))
            if how == "swap":
                msgs[i], msgs[j] = msgs[j], msgs[i]
            elif how == "dup":
                msgs.insert(j, msgs[i])
            elif how == "drop" and len(msgs) > 1:
                msgs.pop(i)
            elif how == "insert":
                msgs.insert(i, draw(any_message))
        return msgs

    return st.one_of(protocol_like(), protocol_like(), protocol_like(), st.lists(any_message, max_size=8))


def sent_hashes(msgs) -> set[bytes]:
    out = set()
    for m in msgs:
        body = m.inventory if m.HasField("inventory") else m.events if m.HasField("events") else None
        if body is not None:
            for g in body.groups:
                out.update(g.block_hashes[i : i + 16] for i in range(0, len(g.block_hashes) - 15, 16))
    return out


def run_stream(live, msgs, timeout: float = 15.0) -> tuple[grpc.StatusCode, str, list]:
    replies = []
    try:
        for reply in live.sync.Sync(iter(msgs), timeout=timeout):
            replies.append(reply)
        return grpc.StatusCode.OK, "", replies
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", replies


def fake_blocks(live) -> dict[bytes, int]:
    with live.cp.cluster._lock:
        return dict(live.cp.cluster.index.agent_blocks(FAKE))


def test_sync_stream_survives_hostile_sequences(controlplane, make_agent, etcd):
    live = start_cluster(controlplane, make_agent)
    etcd_client = register_fake(live, etcd)
    ever_sent: set[bytes] = set()

    @settings(FUZZ, max_examples=250)  # a stream is cheap
    @given(msgs=strategies(live))
    def run(msgs):
        ever_sent.update(sent_hashes(msgs))
        code, details, replies = run_stream(live, msgs)
        check_code("Sync", code, details)
        for r in replies:
            assert r.WhichOneof("body") in ("resync", "command"), r
        check_alive(live)
        check_index(live)
        extra = set(fake_blocks(live)) - ever_sent
        assert not extra, f"the index holds {len(extra)} blocks for the fake agent that it never sent"
        wait_for(lambda: index_matches_agents(live) is None, 10, 0.1, "real agents' blocks untouched")

    run()
    # the reconcile loop's policy pass still runs over what the fuzzed streams left
    live.cp.manager.policy_pass(time.time())

    # a clean session repairs the fake agent exactly: a 2-chunk inventory, then events
    held = {SYNTHETIC[0]: 2, SYNTHETIC[1]: 3, live.known_hashes[0]: 2}
    clean = [
        agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=FAKE, session_id="clean")),
        agent_pb2.AgentMessage(
            inventory=agent_pb2.Inventory(
                seq=7,
                chunk_index=0,
                groups=[
                    agent_pb2.BlockGroup(model_id=M.model_id, tier=2, block_hashes=SYNTHETIC[0] + live.known_hashes[0])
                ],
            )
        ),
        agent_pb2.AgentMessage(
            inventory=agent_pb2.Inventory(
                seq=7,
                chunk_index=1,
                last_chunk=True,
                groups=[agent_pb2.BlockGroup(model_id=M.model_id, tier=3, block_hashes=SYNTHETIC[1])],
            )
        ),
    ]
    code, details, replies = run_stream(live, clean)
    assert code == grpc.StatusCode.OK, details
    assert not any(r.HasField("resync") for r in replies)
    assert fake_blocks(live) == held
    check_index(live)
    removal = agent_pb2.BlockEventBatch(
        seq=8,
        kind=agent_pb2.BLOCK_EVENT_KIND_REMOVED,
        groups=[agent_pb2.BlockGroup(model_id=M.model_id, tier=2, block_hashes=live.known_hashes[0])],
    )
    code, details, _ = run_stream(live, [*clean, agent_pb2.AgentMessage(events=removal)])
    assert code == grpc.StatusCode.OK, details
    assert fake_blocks(live) == {SYNTHETIC[0]: 2, SYNTHETIC[1]: 3}
    # the real agents' copy of the block the fake one dropped is still indexed
    wait_for(lambda: index_matches_agents(live) is None, 10, 0.1, "real agents' blocks untouched")
    etcd_client.close()


def test_sync_gap_and_out_of_order_chunk_ask_for_a_resync(controlplane, make_agent, etcd):
    live = start_cluster(controlplane, make_agent)
    etcd_client = register_fake(live, etcd)
    hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id=FAKE, session_id="g"))
    inv = lambda i, last: agent_pb2.AgentMessage(  # noqa: E731
        inventory=agent_pb2.Inventory(
            seq=1,
            chunk_index=i,
            last_chunk=last,
            groups=[agent_pb2.BlockGroup(model_id=M.model_id, tier=2, block_hashes=SYNTHETIC[i])],
        )
    )
    ev = lambda seq: agent_pb2.AgentMessage(  # noqa: E731
        events=agent_pb2.BlockEventBatch(
            seq=seq, kind=1, groups=[agent_pb2.BlockGroup(model_id=M.model_id, tier=2, block_hashes=SYNTHETIC[9])]
        )
    )
    # chunk 1 before chunk 0: one resync asked, nothing swapped in
    code, _, replies = run_stream(live, [hello, inv(1, True)])
    assert code == grpc.StatusCode.OK and [r.WhichOneof("body") for r in replies] == ["resync"]
    assert fake_blocks(live) == {}
    # a seq gap after a good inventory: a resync, and the batch past the gap is not applied
    code, _, replies = run_stream(live, [hello, inv(0, True), ev(3)])
    assert code == grpc.StatusCode.OK and [r.WhichOneof("body") for r in replies] == ["resync"]
    assert fake_blocks(live) == {SYNTHETIC[0]: 2}
    # a duplicate of an applied batch is a gap too (seq did not advance): resync, no change
    code, _, replies = run_stream(live, [hello, inv(0, True), ev(2), ev(2)])
    assert [r.WhichOneof("body") for r in replies] == ["resync"]
    assert fake_blocks(live) == {SYNTHETIC[0]: 2, SYNTHETIC[9]: 2}
    # no Hello first: FAILED_PRECONDITION; an unknown agent: NOT_FOUND
    assert run_stream(live, [inv(0, True)])[0] == grpc.StatusCode.FAILED_PRECONDITION
    nobody = agent_pb2.AgentMessage(hello=agent_pb2.Hello(agent_id="nobody", session_id="x"))
    assert run_stream(live, [nobody])[0] == grpc.StatusCode.NOT_FOUND
    check_index(live)
    etcd_client.close()
