"""The Sync stream and the index as a review found them wanting, driven in process
(AgentServicer.Sync with a fake agent's request queue; no etcd): a closed stream's queued
chunk that made its agent READY again, a second Hello on one stream, a superseded stream's
stats, blocks of a model the agent never registered, a not-told parent erasing a known
one, a half inventory kept after its stream, one bad chunk asking for a resync per later
chunk, and lookups not flagged stale at once when an agent starts resyncing."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from controlplane.api.agent_service import AgentServicer
from controlplane.core.cluster import AgentRecord, AgentState, BlockGroup, Cluster, ModelInfo
from controlplane.core.index import BlockIndex
from protos import errors
from protos.block_hash import ROOT_PARENT_HASH, hash_prefix
from protos.kvcp.v1 import agent_pb2, types_pb2
from protos.tier import Tier
from tests.metrics.test_controlplane_metrics import Leadership

BS = 4
_END = object()


def packed(n_blocks: int, start: int = 0, model_id: str = "m") -> bytes:
    return hash_prefix(model_id, range(start, start + n_blocks * BS), BS)


def cluster_of(*agent_ids: str) -> Cluster:
    c = Cluster(clock=lambda: 1000.0)
    for a in agent_ids:
        c.register(AgentRecord(agent_id=a, address=f"{a}:1", models=[ModelInfo("m", BS)], tiers=[]))
    return c


class Stream:
    """One agent's Sync stream: requests from a queue, replies and the final error kept."""

    def __init__(self, servicer: AgentServicer):
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.done = threading.Event()

        def requests():
            while (m := self.q.get()) is not _END:
                yield m

        def consume():
            try:
                for _ in servicer.Sync(requests(), None):
                    pass
            except BaseException as exc:  # noqa: BLE001 - looked at by the tests
                self.error = exc
            finally:
                self.done.set()

        threading.Thread(target=consume, daemon=True).start()

    def send(self, **body) -> None:
        self.q.put(agent_pb2.AgentMessage(**body))

    def end(self) -> None:
        self.q.put(_END)


def wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def group(blocks: bytes, model_id: str = "m") -> agent_pb2.BlockGroup:
    return agent_pb2.BlockGroup(model_id=model_id, tier=2, block_hashes=blocks)


def test_a_closed_streams_queued_chunk_does_not_make_its_agent_ready_again():
    cluster = cluster_of("a")
    s = Stream(AgentServicer(cluster, Leadership()))
    s.send(hello=agent_pb2.Hello(agent_id="a", session_id="s1"))
    wait(lambda: cluster.agent("a").outbox is not None, "the hello")
    gate, entered = threading.Event(), threading.Event()
    real = cluster.apply_inventory_chunk

    def busy_applier(*args, **kwargs):  # the applier is busy (another agent's big inventory)
        entered.set()
        gate.wait(5)
        return real(*args, **kwargs)

    cluster.apply_inventory_chunk = busy_applier  # type: ignore[method-assign]
    s.send(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True, groups=[group(packed(3))]))
    s.send(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True, groups=[group(packed(3))]))
    assert entered.wait(5)
    s.send(stats=agent_pb2.AgentStats(tiers=[types_pb2.TierUsage(tier=99)]))  # refused by the reader
    time.sleep(0.2)
    gate.set()
    wait(s.done.is_set, "the stream's end")
    time.sleep(0.3)  # what the applier still held of the stream
    rec = cluster.agent("a")
    assert isinstance(s.error, errors.InvalidArgument)
    assert rec.state is AgentState.DISCONNECTED and rec.outbox is None


def test_a_stream_says_hello_once():
    """Hello as a, then as b: a stayed attached to the dead stream (READY, commands
    'sent' into nothing)."""
    cluster = cluster_of("a", "b")
    s = Stream(AgentServicer(cluster, Leadership()))
    s.send(hello=agent_pb2.Hello(agent_id="a", session_id="sa"))
    s.send(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True, groups=[group(packed(2))]))
    s.send(hello=agent_pb2.Hello(agent_id="b", session_id="sb"))
    s.end()
    wait(s.done.is_set, "the stream's end")
    assert isinstance(s.error, errors.FailedPrecondition) and "says Hello once" in str(s.error)
    assert cluster.agent("a").state is AgentState.DISCONNECTED
    assert "a" not in [r.agent_id for r in cluster.connected_agents()]


def test_a_superseded_streams_stats_are_refused():
    cluster = cluster_of("a")
    servicer = AgentServicer(cluster, Leadership())
    old = Stream(servicer)
    old.send(hello=agent_pb2.Hello(agent_id="a", session_id="s1"))
    wait(lambda: cluster.agent("a").outbox is not None, "the first hello")
    new = Stream(servicer)
    new.send(hello=agent_pb2.Hello(agent_id="a", session_id="s2"))
    wait(lambda: cluster.agent("a").session_id == "s2", "the second hello")
    usage = dict(tier=1, capacity_bytes=100, num_blocks=1)
    new.send(stats=agent_pb2.AgentStats(tiers=[types_pb2.TierUsage(used_bytes=10, **usage)]))
    wait(lambda: cluster.agent("a").stats_reports == 1, "the current stream's stats")
    old.send(
        stats=agent_pb2.AgentStats(
            tiers=[types_pb2.TierUsage(used_bytes=99, **usage)],
            namespaces=[agent_pb2.NamespaceUsage(namespace="old", num_blocks=9, uncompressed_bytes=990)],
        )
    )
    wait(old.done.is_set, "the superseded stream's end")
    rec = cluster.agent("a")
    assert isinstance(old.error, errors.FailedPrecondition) and "superseded" in str(old.error)
    assert rec.tiers[0].used_bytes == 10 and rec.stats_reports == 1 and "old" not in rec.namespaces
    assert rec.session_id == "s2" and rec.outbox is not None  # the current stream is untouched
    new.end()


def test_blocks_of_a_model_the_agent_never_registered_are_refused():
    c = cluster_of("a")
    c.hello("a", "s")
    h = packed(2, model_id="zzz")
    with pytest.raises(errors.InvalidArgument, match="registered no model 'zzz'"):
        c.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("zzz", Tier.GPU, h)], "s")
    assert c.index.num_agent_blocks("a") == 0


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_parent_not_told_keeps_the_one_another_agent_told(use_kernel):
    idx = BlockIndex(use_kernel=use_kernel)
    chain = packed(2)
    parent, block = chain[:16], chain[16:]
    idx.add("a", block, Tier.GPU, parent)
    idx.add("b", block, Tier.CPU, ROOT_PARENT_HASH)  # an engine's block whose parent b was not told
    assert idx.parent_of(block) == parent


def test_a_half_inventory_goes_with_its_stream():
    c = cluster_of("a")
    c.hello("a", "s")
    assert c.apply_inventory_chunk("a", 0, 0, False, [BlockGroup("m", Tier.CPU, packed(100))], "s") is None
    c.stream_closed("a", "s")
    assert c.agent("a").staging == []


def test_one_bad_chunk_asks_for_one_resync():
    c = cluster_of("a")
    c.hello("a", "s")
    g = [BlockGroup("m", Tier.CPU, packed(1))]
    replies = [
        c.apply_inventory_chunk("a", 5, i, last, g, "s") for i, last in [(0, False), (0, False), (1, False), (2, True)]
    ]
    assert [r is not None for r in replies] == [False, True, False, False] and c.resyncs_total == 1
    assert c.apply_inventory_chunk("a", 6, 0, True, g, "s") is None  # the next inventory is taken
    assert c.agent("a").state is AgentState.READY


def test_lookups_are_flagged_stale_as_soon_as_an_agent_resyncs():
    c = cluster_of("a")
    c.hello("a", "s")
    c.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.CPU, packed(2))], "s")
    c.reconcile_membership({"a"}, 0.0)
    assert c.rebuilding() is False
    assert c.apply_events("a", 9, False, [BlockGroup("m", Tier.CPU, packed(2))], "s")  # a gap: removals lost
    assert c.rebuilding() is True


def test_an_operations_final_update_is_handled_after_the_events_sent_before_it():
    """Events went to the shared applier and op updates were handled at once: a pass
    that saw its command answered could read the block where it was and send it again."""
    cluster = cluster_of("a")
    seen = {}

    def on_op_update(agent_id, update):  # the block's tier in the index as the manager hears
        seen[update.op_id] = int(cluster.tiers_held(agent_id, packed(1))[0])

    s = Stream(AgentServicer(cluster, Leadership(), on_op_update=on_op_update))
    s.send(hello=agent_pb2.Hello(agent_id="a", session_id="s1"))
    one = agent_pb2.BlockGroup(model_id="m", tier=1, block_hashes=packed(1))
    s.send(inventory=agent_pb2.Inventory(seq=0, chunk_index=0, last_chunk=True, groups=[one]))
    wait(lambda: cluster.index.num_agent_blocks("a") == 1, "the inventory")
    gate = threading.Event()
    real = cluster.apply_events

    def busy_applier(*args, **kwargs):
        gate.wait(5)
        return real(*args, **kwargs)

    cluster.apply_events = busy_applier  # type: ignore[method-assign]
    moved = agent_pb2.BlockGroup(model_id="m", tier=3, block_hashes=packed(1))
    s.send(events=agent_pb2.BlockEventBatch(seq=1, kind=agent_pb2.BLOCK_EVENT_KIND_STORED, groups=[moved]))
    s.send(op_update=agent_pb2.OpUpdate(op_id="policy-1", state="SUCCEEDED", num_done_blocks=1, num_total_blocks=1))
    time.sleep(0.3)
    assert "policy-1" not in seen  # waits for the events before it
    gate.set()
    wait(lambda: "policy-1" in seen, "the op update")
    assert seen["policy-1"] == int(Tier.DISK)
    s.end()


class _HookedLock:
    """An RLock that runs `after_release` once, right after a release (as another thread
    taking the lock at that moment would)."""

    def __init__(self):
        self._lock = threading.RLock()
        self.after_release = None

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        r = self._lock.__exit__(*exc)
        hook, self.after_release = self.after_release, None
        if hook is not None:
            hook()
        return r


def test_a_stream_closed_as_rebuilding_lets_go_of_the_lock_is_not_overwritten():
    """rebuilding() cached its answer after letting go of the lock: a stream closed just
    then was overwritten by the old answer, and lookups said not stale for 0.1 s (a review)."""
    c = Cluster()
    c.register(AgentRecord("a", "a:1", [ModelInfo("m", 4)], []))
    c.hello("a", "s")
    c.attach_outbox("a", "s", outbox=type("Q", (), {"put": lambda self, x: None})())
    assert (
        c.apply_inventory_chunk("a", 0, 0, True, [BlockGroup("m", Tier.GPU, hash_prefix("m", range(8), 4))], "s")
        is None
    )
    c.reconcile_membership({"a"}, 0.0)
    assert c.rebuilding() is False
    c._rebuilding = (0.0, False)  # let the next call compute
    lock = _HookedLock()
    c._lock = lock
    # the agent's stream closes just as a lookup's rebuilding() let go of the lock
    lock.after_release = lambda: c.stream_closed("a", "s")
    c.rebuilding()
    assert c.agent("a").state == AgentState.DISCONNECTED
    assert c.rebuilding() is True, "an agent is disconnected, yet lookups are not flagged possibly stale"
