"""vLLM KV events: an agent started with vllm_kv_events subscribes to a publisher that
speaks vLLM's wire format and indexes the engine's blocks under vLLM's own hashes, as
metadata-only blocks (not in its BlockPool); a lookup at the control plane by those
hashes finds the agent. Gaps are filled through replay, or the engine's blocks are
dropped and counted; malformed messages are counted and skipped."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time

import msgspec
import pytest
import torch
import zmq
from prometheus_client import generate_latest

from agent.api.vllm_events import VllmEventSubscriber
from agent.core.journal import REMOVED, STORED, EventJournal
from agent.core.vllm_events import (
    AllCleared,
    BlockSizeMismatch,
    BlocksRemoved,
    BlocksStored,
    ExternalBlocks,
    MalformedBatch,
    decode_batch,
)
from agent.server import DEMO_MODEL
from cli.client import ControlPlaneClient
from protos.block_hash import ROOT_PARENT_HASH, external_block_hash, hash_prefix, split_hashes
from protos.tier import Tier
from tests.helpers import script, wait_for
from tests.scale.vllm_publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MapBatch,
    MapBlockStored,
    VllmPublisher,
)

M = DEMO_MODEL
BY_VLLM = {"vllm_index_by": "vllm"}  # the tests below look blocks up by the engine's hashes


def stored(hashes, parent=None, medium="GPU"):
    return BlockStored(hashes, parent, list(range(16 * len(hashes))), 16, None, medium)


def batch(*events):
    return EventBatch(time.time(), list(events), 0)


def packed(hashes) -> bytes:
    return b"".join(external_block_hash(h) for h in hashes)


# ---- decoding and the external inventory (no sockets) --------------------------------
def test_decode_array_like_and_map_batches():
    sha = hashlib.sha256(b"x").digest()
    d = decode_batch(msgspec.msgpack.encode(batch(stored([1, 2], medium="CPU"), BlockRemoved([sha], None))))
    assert d.data_parallel_rank == 0
    assert d.events[0] == BlocksStored(
        [external_block_hash(1), external_block_hash(2)], ROOT_PARENT_HASH, Tier.CPU, 16, None, tuple(range(32))
    )
    assert d.events[1] == BlocksRemoved([sha[:16]], Tier.GPU)
    d = decode_batch(msgspec.msgpack.encode(batch(AllBlocksCleared())))
    assert d.events == [AllCleared()]
    m = MapBatch(1.0, [MapBlockStored([7], 6, [1] * 16, 16, None, "GPU", "lora-a")])
    d = decode_batch(msgspec.msgpack.encode(m))
    lora = BlocksStored([external_block_hash(7)], external_block_hash(6), Tier.GPU, 16, None, (1,) * 16, keyed=True)
    assert d.events == [lora]
    assert d.data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode([1.0, "not a list"]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], "16", None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [], 16, None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", "nope", None, [], 16, None, "GPU"]]]),
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], 7]]]),
        msgspec.msgpack.encode([1.0, [[1, 2]]]),
        msgspec.msgpack.encode(["ts", []]),
        msgspec.msgpack.encode({"ts": 1.0, "events": [{"no": "type"}]}),
    ],
)
def test_malformed_batches_raise(payload):
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_events_of_an_unknown_kind_are_left_out_and_the_rest_applies():
    """A later vLLM's or a fork's event kind (ATOM's BlockTransferred) must not cost the
    batch's removals: it is counted and the known events apply."""
    raw = msgspec.msgpack.encode([1.0, [["BlockRemoved", [31, 32], "GPU"], ["BlockTransferred", [31], "x"]]])
    d = decode_batch(raw)
    assert d.events == [BlocksRemoved([external_block_hash(31), external_block_hash(32)], Tier.GPU)]
    assert d.unknown_events == 1
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)
    sub.handle(_message(0, [31, 32]))
    sub.handle([b"", (1).to_bytes(8, "big"), raw])
    assert _claimed(ext) == set() and sub.stats.unknown_events_total == 1 and sub.stats.malformed_total == 0


def test_events_with_every_field_vllm_added_since_decode():
    """Array-like events of vLLM from lora_name on carry 7 to 14 fields: the ones not read
    here are left out, never a reason to drop the batch (it was: 'too many values to
    unpack', the whole batch lost and a removed block still listed)."""
    toks = list(range(16))
    v10 = ["BlockStored", [41], None, toks, 16, None, "GPU", None]  # + lora_name
    later = ["BlockStored", [42], 41, toks, 16, None, "GPU", "lora-a", None, 0, "full_attention", None, "LOCAL"]
    gone = ["BlockRemoved", [41], "GPU", 0, "LOCAL", None]
    d = decode_batch(msgspec.msgpack.encode([1.0, [v10, later, gone], 0]))
    assert d.events == [
        BlocksStored([external_block_hash(41)], ROOT_PARENT_HASH, Tier.GPU, 16, None, tuple(toks)),
        BlocksStored([external_block_hash(42)], external_block_hash(41), Tier.GPU, 16, 0, tuple(toks), keyed=True),
        BlocksRemoved([external_block_hash(41)], Tier.GPU, 0),
    ]
    assert (d.unknown_events, d.other_group_events) == (0, 0)


def test_one_kv_cache_group_is_indexed_and_the_others_left_out():
    """A hybrid model reports each group's blocks under the same hashes; the sliding-window
    group drops blocks the full-attention group keeps, and may use another block size."""
    toks = list(range(16))
    full = ["BlockStored", [51, 52], None, toks * 2, 16, None, "GPU", None, None, 0]
    window = ["BlockStored", [51, 52], None, toks * 2, 16, None, "GPU", None, None, 1, "sliding_window", 128]
    window_dropped = ["BlockRemoved", [51], "GPU", 1]
    other_size = ["BlockStored", [53], None, toks * 4, 64, None, "GPU", None, None, 1]
    ext = ExternalBlocks(_Pool(), "m", block_size=16, index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)  # group 0, as --vllm-kv-group's default
    sub.handle([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [full, window]])])
    sub.handle([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [window_dropped, other_size]])])
    assert _claimed(ext) == {external_block_hash(51), external_block_hash(52)}
    assert sub.stats.other_group_events_total == 3 and sub.stats.malformed_total == 0
    d = decode_batch(msgspec.msgpack.encode([1.0, [full, window, window_dropped]]), group=1)
    assert [type(e).__name__ for e in d.events] == ["BlocksStored", "BlocksRemoved"] and d.other_group_events == 1


def test_a_batch_that_does_not_decode_forgets_the_engine_and_a_wrong_block_size_is_refused():
    """What a broken batch stored or removed is unknown: nothing of the engine's stays
    claimed. A store of blocks of another size than the model's is refused whole (the
    control plane counts hit tokens in the model's block size)."""
    ext = ExternalBlocks(_Pool(), "m", block_size=16, index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)
    sub.handle(_message(0, [1, 2]))
    assert _claimed(ext) == {external_block_hash(1), external_block_hash(2)}
    sub.handle([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], 7]]])])
    assert _claimed(ext) == set() and sub.stats.malformed_total == 1
    sub.handle(_message(2, [5]))
    eight = msgspec.msgpack.encode(batch(BlockStored([6, 7], 5, list(range(16)), 8, None, "GPU")))
    sub.handle([b"", (3).to_bytes(8, "big"), eight])
    assert _claimed(ext) == set() and sub.stats.malformed_total == 2
    with pytest.raises(BlockSizeMismatch):
        ext.apply(decode_batch(eight))
    assert ExternalBlocks(_Pool(), "m", block_size=8, index_by="vllm").apply(decode_batch(eight)) == (2, 0)


class _Replayer:
    """A replay endpoint (vLLM's ROUTER) answering from `batches`, `delay` seconds per answer."""

    def __init__(self, batches: list[bytes], delay: float):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches, self.delay = batches, delay
        self._closing = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            ident, _, start = self.sock.recv_multipart()
        except zmq.ZMQError:
            return
        for seq in range(int.from_bytes(start, "big"), len(self.batches)):
            if self._closing.wait(self.delay):  # the test is done: the answers left go unsent
                return
            self.sock.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), self.batches[seq]])
        self.sock.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self):
        self._closing.set()
        self.thread.join(10)
        self.sock.close(linger=0)


@pytest.mark.parametrize("delay", [0.02, 0.5])
def test_a_late_start_whose_replay_does_not_reach_the_live_batch_claims_nothing_stale(delay):
    """Started against a running engine: its history comes from the replay buffer. When
    that answer stops short of the live batch (here: each answer 0.5 s late against a
    0.2 s timeout), the batches it left out (a removal of 1..5) are unknown, so nothing
    read of the history stays claimed. A slow but steady replay (each answer within the
    timeout, the whole longer than it) is read to the end."""
    history = [msgspec.msgpack.encode(batch(stored([1, 2, 3, 4, 5])))]
    history += [msgspec.msgpack.encode(batch(stored([10 + i]))) for i in range(8)]
    history.append(msgspec.msgpack.encode(batch(BlockRemoved([1, 2, 3, 4, 5], "GPU"))))
    replayer = _Replayer(history, delay)
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext, replay_endpoint=replayer.endpoint, replay_timeout_seconds=0.2)
    sub._reset_dealer()
    try:
        sub.handle(_message(len(history), [99]))
        if delay < 0.2:
            assert _claimed(ext) == {external_block_hash(h) for h in [10, 11, 12, 13, 14, 15, 16, 17, 99]}
            assert sub.stats.unrecovered_gaps_total == 0 and sub.stats.replayed_batches_total == len(history)
        else:
            assert _claimed(ext) == {external_block_hash(99)}
            assert sub.stats.unrecovered_gaps_total == 1
    finally:
        sub._dealer.close(linger=0)
        replayer.close()


class _Pool:
    def __init__(self):
        self.lock = threading.RLock()
        self.journal = EventJournal()
        self.blocks: dict = {}  # the agent's own store holds nothing here


def test_external_blocks_track_media_and_journal():
    pool = _Pool()
    ext = ExternalBlocks(pool, "m", index_by="vllm")
    h1, h2 = external_block_hash(1), external_block_hash(2)
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(stored([1, 2], medium="CPU")))))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(stored([1], medium="GPU")))))  # also on GPU now
    assert ext.holds(h1) == Tier.GPU and ext.holds(h2) == Tier.CPU
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([1], "GPU")))))  # back to CPU only
    assert ext.holds(h1) == Tier.CPU
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([2, 99], "CPU")))))
    assert ext.holds(h2) is None and ext.num_blocks == 1
    kinds = [(b.kind, g.tier, bytes(g.block_hashes)) for b in pool.journal.drain() for g in b.groups]
    assert kinds == [
        (STORED, Tier.CPU, h1 + h2),
        (STORED, Tier.GPU, h1),
        (STORED, Tier.CPU, h1),
        (REMOVED, Tier.CPU, h2),
    ]
    groups = ext.inventory_groups()
    assert [(g.tier, g.block_hashes) for g in groups] == [(Tier.CPU, h1)]
    assert groups[0].parent_hashes == ROOT_PARENT_HASH
    assert ext.clear() == 1 and ext.num_blocks == 0


def _journal(pool) -> list[tuple[str, Tier, bytes, bytes]]:
    """(kind, tier, block hash, parent hash) of each block the journal recorded, in order."""
    return [
        (b.kind, g.tier, h, p)
        for b in pool.journal.drain()
        for g in b.groups
        for h, p in zip(split_hashes(bytes(g.block_hashes)), split_hashes(bytes(g.parent_hashes)), strict=True)
    ]


def test_blocks_are_indexed_by_their_tokens_so_a_token_lookup_finds_them():
    """By default an engine's blocks are indexed under kvcp's digest of the model and
    their tokens, chained from their parent's: the hash a Lookup by tokens computes."""
    pool = _Pool()
    ext = ExternalBlocks(pool, "m", block_size=16)
    toks = list(range(1000, 1048))
    ours = split_hashes(hash_prefix("m", toks, 16))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([1, 2], None, toks[:32], 16, None, "GPU")))))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([3], 2, toks[32:], 16, None, "GPU")))))
    assert _journal(pool) == [
        (STORED, Tier.GPU, ours[0], ROOT_PARENT_HASH),
        (STORED, Tier.GPU, ours[1], ours[0]),
        (STORED, Tier.GPU, ours[2], ours[1]),
    ]
    assert ext.holds(ours[2]) == Tier.GPU and ext.holds(external_block_hash(3)) == Tier.GPU
    # offloaded to CPU and dropped from GPU: the same block, named by the engine's hash
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([3], 2, toks[32:], 16, None, "CPU")))))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([3], "GPU")))))
    assert ext.holds(ours[2]) == Tier.CPU and ext.num_blocks == 3
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([3], "CPU"), BlockRemoved([2], "GPU")))))
    assert _journal(pool)[-2:] == [(REMOVED, Tier.CPU, ours[2], ours[1]), (REMOVED, Tier.GPU, ours[1], ours[0])]
    assert ext.num_blocks == 1 and (ext.indexed_by_tokens_total, ext.indexed_by_engine_hash_total) == (3, 0)
    assert ext.clear() == 1 and ext.holds(external_block_hash(1)) is None


def test_blocks_their_tokens_do_not_name_stay_under_the_engines_hash():
    """A LoRA adapter's or a multimodal prompt's KV is not decided by the tokens alone;
    a block whose parent was never indexed by tokens (read from the middle of the
    engine's history) cannot be chained: those, and what follows them, keep vLLM's hash."""
    pool = _Pool()
    ext = ExternalBlocks(pool, "m", block_size=16)
    toks = list(range(16))
    lora = ["BlockStored", [61], None, toks, 16, 3, "GPU", "adapter"]
    multimodal = ["BlockStored", [62], None, toks, 16, None, "GPU", None, [["img-hash", 0]]]
    orphan = ["BlockStored", [63, 64], 99, toks * 2, 16, None, "GPU"]
    after_lora = ["BlockStored", [65], 61, toks, 16, None, "GPU"]
    short = ["BlockStored", [66], None, toks[:8], 16, None, "GPU"]
    ext.apply(decode_batch(msgspec.msgpack.encode([1.0, [lora, multimodal, orphan, after_lora, short], 0])))
    engine = [external_block_hash(h) for h in (61, 62, 63, 64, 65, 66)]
    assert [h for _, _, h, _ in _journal(pool)] == engine
    assert (ext.indexed_by_tokens_total, ext.indexed_by_engine_hash_total) == (0, 6)
    # a text-only prompt on the same engine is chained by its tokens
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([70], None, toks, 16, None, "GPU")))))
    assert [h for _, _, h, _ in _journal(pool)] == split_hashes(hash_prefix("m", toks, 16))
    # the same tokens under another engine hash (a cache salt vLLM's hash saw): its own
    # block, kept under its hash (one digest for both lost the first at the second's removal)
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([71], None, toks, 16, None, "CPU")))))
    assert [h for _, _, h, _ in _journal(pool)] == [external_block_hash(71)]
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([71], "CPU")))))
    assert ext.holds(external_block_hash(70)) == Tier.GPU


def test_a_block_offloaded_again_keeps_the_parent_it_was_stored_with():
    """A re-store in another medium (an offload event naming no parent) reset the
    block's parent to the root, which inventories and removals then said."""
    pool = _Pool()
    ext = ExternalBlocks(pool, "m", block_size=16)
    toks = list(range(32))
    ours = split_hashes(hash_prefix("m", toks, 16))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([1, 2], None, toks, 16, None, "GPU")))))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockStored([2], None, toks[16:], 16, None, "CPU")))))
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(BlockRemoved([2], "GPU"), BlockRemoved([2], "CPU")))))
    assert _journal(pool)[-1] == (REMOVED, Tier.CPU, ours[1], ours[0])
    assert [g.parent_hashes for g in ext.inventory_groups()] == [ROOT_PARENT_HASH]


def test_only_a_connection_down_past_the_grace_forgets_the_engine():
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    ext.apply(decode_batch(msgspec.msgpack.encode(batch(stored([1, 2])))))
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext, disconnect_grace_seconds=5.0)
    sub.on_connection_event(zmq.EVENT_CONNECTED, 0.0)
    sub.on_connection_event(zmq.EVENT_DISCONNECTED, 10.0)  # a blip: back within the grace
    sub.check_lost(14.0)
    sub.on_connection_event(zmq.EVENT_CONNECTED, 14.5)
    sub.check_lost(100.0)
    assert ext.num_blocks == 2 and sub.stats.engine_lost_total == 0
    sub.on_connection_event(zmq.EVENT_DISCONNECTED, 200.0)
    sub.on_connection_event(zmq.EVENT_DISCONNECTED, 203.0)  # the first drop counts
    sub.check_lost(204.9)
    assert ext.num_blocks == 2
    sub.check_lost(205.0)
    assert ext.num_blocks == 0 and sub.stats.engine_lost_total == 1 and sub.stats.last_seq == -1
    sub.check_lost(500.0)  # counted once
    assert sub.stats.engine_lost_total == 1


def _message(seq: int, hashes: list[int]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch(stored(hashes)))]


def _claimed(ext: ExternalBlocks) -> set[bytes]:
    return {h for h in (external_block_hash(i) for i in range(1000)) if ext.holds(h) is not None}


def test_a_restarted_engine_whose_first_new_number_is_the_last_old_one_is_a_restart():
    """The new engine's seq 0 went out before we reconnected: the first batch seen is seq 1,
    the old engine's last number. PUB/SUB never delivers a batch twice, so it is a restart."""
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)  # no replay buffer
    sub.handle(_message(0, [1]))
    sub.handle(_message(1, [2]))
    sub.handle(_message(1, [20]))
    assert sub.stats.engine_restarts_total == 1
    assert _claimed(ext) == {external_block_hash(20)}


def test_a_publisher_that_came_back_is_read_again_from_its_start():
    """The connection dropped and came back (within the grace): the engine behind it may be
    a new one whose numbers passed the old one's. Its blocks are read again from its replay
    buffer, as at start, instead of filling a 'gap' from the new engine and keeping the
    old one's blocks for good."""
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)
    sub.on_connection_event(zmq.EVENT_CONNECTED, 0.0)
    sub.handle(_message(0, [100]))
    sub.handle(_message(1, [101]))
    sub.on_connection_event(zmq.EVENT_DISCONNECTED, 5.0)
    sub.on_connection_event(zmq.EVENT_CONNECTED, 6.0)
    sub.handle(_message(3, [303]))  # a new engine, already at seq 3
    assert _claimed(ext) == {external_block_hash(303)}
    sub.handle(_message(4, [304]))  # and on from there as usual
    assert _claimed(ext) == {external_block_hash(303), external_block_hash(304)}
    assert sub.stats.last_seq == 4


# ---- end to end: publisher -> agent -> control plane ---------------------------------
@pytest.fixture
def publisher():
    p = VllmPublisher()
    yield p
    p.close()


def lookup_hits(client: ControlPlaneClient, hashes) -> dict[str, int]:
    res = client.lookup(M.model_id, block_hashes=packed(hashes))
    return {m.agent_id: m.num_hit_blocks for m in res.agents}


def test_vllm_blocks_found_by_vllm_hashes(controlplane, make_agent, publisher):
    agent = make_agent(
        "vllm-1", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    sub = agent.vllm_events
    assert sub is not None and sub.connected.wait(5)
    time.sleep(0.3)  # PUB/SUB joins late; anything lost before is replayed anyway
    sha = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    publisher.publish(batch(stored([101, 102, 103])))  # int hashes (vLLM's int mode)
    publisher.publish(batch(stored(sha, medium="CPU")))  # bytes hashes (sha256)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: lookup_hits(c, [101, 102, 103]) == {"vllm-1": 3}, what="int hashes indexed")
        res = c.lookup(M.model_id, block_hashes=packed(sha))
        assert res.best_agent_id == "vllm-1" and res.agents[0].tiers == ["cpu"] * 3
        assert lookup_hits(c, [101, 102, 999]) == {"vllm-1": 2}
        # metadata only: nothing went into the block pool
        assert not agent.pool.blocks
        publisher.publish(batch(BlockRemoved([103], "GPU")))
        wait_for(lambda: lookup_hits(c, [101, 102, 103]) == {"vllm-1": 2}, what="removal indexed")
        # a reconnect's inventory carries the engine's blocks too
        agent.link.request_reconnect()
        wait_for(lambda: agent.link.connections_total >= 2, what="reconnected")
        wait_for(lambda: lookup_hits(c, [101, 102]) == {"vllm-1": 2}, what="inventory with external blocks")
        publisher.publish(batch(AllBlocksCleared()))
        wait_for(lambda: lookup_hits(c, [101]) == {}, what="all cleared")
        assert lookup_hits(c, sha) == {}
    assert sub.stats.malformed_total == 0 and sub.stats.unrecovered_gaps_total == 0


def test_an_engines_blocks_are_found_by_a_lookup_by_tokens_and_by_kvctl(controlplane, make_agent, publisher):
    """The default (--vllm-index-by tokens): a router's Lookup by tokens, and kvctl
    lookup --tokens, find the engine that reported the prefix in its events."""
    agent = make_agent("vllm-t", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint)
    assert agent.vllm_events is not None and agent.vllm_events.connected.wait(5)
    time.sleep(0.3)
    toks = list(range(5000, 5000 + 16 * 3))
    publisher.publish(batch(BlockStored([11, 12, 13], None, toks, 16, None, "GPU")))
    with ControlPlaneClient(controlplane.address) as c:
        hits = lambda t: {m.agent_id: m.num_hit_blocks for m in c.lookup(M.model_id, token_ids=t).agents}  # noqa: E731
        wait_for(lambda: hits(toks + [1, 2, 3]) == {"vllm-t": 3}, what="indexed by tokens")
        assert hits(toks[:16] + [7] * 16) == {"vllm-t": 1}
        out = subprocess.run(
            [
                script("kvctl"),
                "--endpoint",
                controlplane.address,
                "-o",
                "json",
                "lookup",
                "--model",
                M.model_id,
                "--tokens",
                ",".join(map(str, toks)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["best_agent_id"] == "vllm-t"
        publisher.publish(batch(BlockRemoved([13], "GPU")))
        wait_for(lambda: hits(toks) == {"vllm-t": 2}, what="removal by the engine's hash")
    assert agent.vllm_events.stats.malformed_total == 0


def test_the_engines_copy_and_the_agents_own_of_one_block_are_held_while_either_is(controlplane, make_agent, publisher):
    """Indexed by tokens, an engine block and the agent's own stored copy (a connector's)
    share a digest, and the index keeps one tier per agent and block: the engine's removal
    of its copy must not drop the agent's (nor the agent's drop the engine's), and the
    faster copy is the tier said."""
    agent = make_agent("vllm-m", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint)
    assert agent.vllm_events is not None and agent.vllm_events.connected.wait(5)
    time.sleep(0.3)
    toks = list(range(8000, 8000 + 2 * M.block_size))
    agent.engine.store(M.model_id, toks, torch.zeros((2, *M.block_shape), dtype=torch.float16))
    with ControlPlaneClient(controlplane.address) as c:
        tiers = lambda: [m.tiers for m in c.lookup(M.model_id, token_ids=toks).agents]  # noqa: E731
        wait_for(lambda: tiers() == [["cpu", "cpu"]], what="the agent's own copy indexed")
        publisher.publish(batch(BlockStored([21, 22], None, toks, M.block_size, None, "GPU")))
        wait_for(lambda: tiers() == [["gpu", "gpu"]], what="the engine's faster copy said")
        publisher.publish(batch(BlockRemoved([22, 21], "GPU")))
        wait_for(lambda: tiers() == [["cpu", "cpu"]], what="the agent's copy kept")
        time.sleep(0.5)
        assert tiers() == [["cpu", "cpu"]]
        publisher.publish(batch(BlockStored([21, 22], None, toks, M.block_size, None, "GPU")))
        wait_for(lambda: tiers() == [["gpu", "gpu"]], what="the engine's copy again")
        hashes = split_hashes(hash_prefix(M.model_id, toks, M.block_size))
        assert agent.pool.drop(hashes[0])  # the agent's own copy goes (its child with it)
        time.sleep(0.5)
        assert tiers() == [["gpu", "gpu"]]
        # an inventory says the same (the engine's copy listed after the pool's)
        agent.link.request_reconnect()
        wait_for(lambda: agent.link.connections_total >= 2, what="reconnected")
        wait_for(lambda: tiers() == [["gpu", "gpu"]], what="the inventory's tiers")


def test_gap_recovered_through_replay_and_unrecoverable_gap_drops(controlplane, make_agent, publisher):
    agent = make_agent(
        "vllm-2", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    sub = agent.vllm_events
    assert sub.connected.wait(5)
    time.sleep(0.3)
    publisher.publish(batch(stored([1])))
    wait_for(lambda: sub.stats.last_seq == 0, what="first batch")
    publisher.publish(batch(stored([2], parent=1)), send=False)  # lost on PUB, kept for replay
    publisher.publish(batch(stored([3], parent=2)), send=False)
    publisher.publish(batch(stored([4], parent=3)))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: lookup_hits(c, [1, 2, 3, 4]) == {"vllm-2": 4}, what="gap filled by replay")
        assert sub.stats.gaps_total == 1 and sub.stats.replayed_batches_total == 2
        assert sub.stats.unrecovered_gaps_total == 0
        # a batch the engine no longer has: the engine's blocks are forgotten, then rebuilt
        publisher.publish(batch(stored([5], parent=4)), send=False, keep=False)
        publisher.publish(batch(stored([11])))
        wait_for(lambda: sub.stats.unrecovered_gaps_total == 1, what="unrecoverable gap counted")
        wait_for(lambda: lookup_hits(c, [1]) == {} and lookup_hits(c, [11]) == {"vllm-2": 1}, what="dropped, then new")
        # the engine restarts: seq back to 0, its cache empty
        publisher.seq = 0
        publisher.buffer.clear()
        publisher.publish(batch(stored([21])))
        wait_for(lambda: sub.stats.engine_restarts_total == 1, what="restart seen")
        wait_for(lambda: lookup_hits(c, [11]) == {} and lookup_hits(c, [21]) == {"vllm-2": 1}, what="after restart")


def test_a_restart_whose_first_batches_were_missed_is_seen_and_replayed(controlplane, make_agent, publisher):
    agent = make_agent(
        "vllm-4", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    sub = agent.vllm_events
    assert sub.connected.wait(5)
    time.sleep(0.3)
    for k in range(6):  # the old engine gets to seq 5
        publisher.publish(batch(stored([100 + k], parent=100 + k - 1 if k else None)))
    wait_for(lambda: sub.stats.last_seq == 5, what="old engine's batches")
    # the engine restarts; its first batches (seq 0, 1) go out while we are not listening
    publisher.seq = 0
    publisher.buffer.clear()
    publisher.publish(batch(stored([200])), send=False)
    publisher.publish(batch(stored([201], parent=200)), send=False)
    publisher.publish(batch(stored([202], parent=201)))  # seq 2: back, not a duplicate
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: lookup_hits(c, [200, 201, 202]) == {"vllm-4": 3}, what="new engine's blocks, replayed")
        assert lookup_hits(c, [100]) == {}  # the old engine's blocks are gone with it
    assert sub.stats.engine_restarts_total == 1 and sub.stats.last_seq == 2


def test_malformed_messages_counted_and_skipped(controlplane, make_agent, publisher):
    agent = make_agent(
        "vllm-3", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    sub = agent.vllm_events
    assert sub.connected.wait(5)
    time.sleep(0.3)
    publisher.publish(batch(stored([1])))
    wait_for(lambda: sub.stats.last_seq == 0, what="first batch")
    publisher.publish(b"\xc1 not msgpack")
    publisher.publish(msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [], 16, None, "GPU"]]]))
    publisher.pub.send_multipart([b"", b"short"])  # not [topic, seq, payload]
    publisher.pub.send_multipart([b"only one frame"])
    publisher.publish(batch(stored([2], parent=1)))
    publisher.publish(batch(stored([1]), stored([2], parent=1)))
    with ControlPlaneClient(controlplane.address) as c:
        # the batches that did not decode may have removed 1: it was forgotten, then stored again
        wait_for(lambda: lookup_hits(c, [1, 2]) == {"vllm-3": 2}, what="valid batch after bad ones")
    wait_for(lambda: sub.stats.malformed_total == 4, what="malformed counted")
    assert sub.stats.batches_total == 3 and sub.stats.gaps_total == 0


def test_subscriber_picks_up_history_when_started_late(controlplane, make_agent, publisher):
    for i in range(5):
        publisher.publish(batch(stored([100 + i])))  # nobody listening yet
    agent = make_agent(
        "vllm-4", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    assert agent.vllm_events.connected.wait(5)
    time.sleep(0.3)
    publisher.publish(batch(stored([200])))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: all(lookup_hits(c, [h]) == {"vllm-4": 1} for h in [100, 104, 200]), what="history replayed")


def test_an_idle_engine_is_indexed_from_its_replay_buffer_at_start(controlplane, make_agent, publisher):
    """No live batch after the agent starts: its history is read at start all the same (it
    was read only when the next live batch came); one published right after is not lost."""
    for i in range(3):
        publisher.publish(batch(stored([300 + i])))  # nobody listening yet
    agent = make_agent(
        "vllm-6", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    assert agent.vllm_events.connected.wait(5)
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: all(lookup_hits(c, [h]) == {"vllm-6": 1} for h in [300, 301, 302]), what="idle engine read")
        time.sleep(0.3)
        publisher.publish(batch(stored([303])))
        wait_for(lambda: lookup_hits(c, [303]) == {"vllm-6": 1}, what="the next live batch")
    st = agent.vllm_events.stats
    assert st.gaps_total == 0 and st.unrecovered_gaps_total == 0 and st.engine_restarts_total == 0


def test_an_engine_back_with_numbers_past_the_old_ones_is_read_again(controlplane, make_agent, publisher):
    """The engine's process restarts (its PUB socket goes and comes back) and is at seq 3
    by the time we hear from it, past the old engine's last number: not a gap to fill, a
    new engine. Its blocks come from its replay buffer; the old engine's are forgotten."""
    agent = make_agent(
        "vllm-6", vllm_kv_events=publisher.endpoint, vllm_kv_events_replay=publisher.replay_endpoint, **BY_VLLM
    )
    sub = agent.vllm_events
    assert sub.connected.wait(5)
    time.sleep(0.3)
    with ControlPlaneClient(controlplane.address) as c:
        publisher.publish(batch(stored([100])))
        publisher.publish(batch(stored([101], parent=100)))
        wait_for(lambda: lookup_hits(c, [100, 101]) == {"vllm-6": 2}, what="old engine indexed")
        publisher.drop_pub()
        wait_for(lambda: sub._down_since is not None, what="the publisher's connection dropped")
        publisher.rebind_pub()
        publisher.seq = 0
        publisher.buffer.clear()
        for k in range(3):  # seq 0..2 go out before we are back
            publisher.publish(batch(stored([300 + k], parent=300 + k - 1 if k else None)), send=False)
        wait_for(lambda: sub._down_since is None, what="reconnected")
        publisher.publish(batch(stored([303], parent=302)))  # seq 3
        wait_for(lambda: lookup_hits(c, [300, 301, 302, 303]) == {"vllm-6": 4}, what="the new engine's blocks")
        assert lookup_hits(c, [100]) == {}


def test_vllm_own_event_classes_if_vllm_imports():
    """With the vllm package installed, its own KVEventBatch decodes the same."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    values = {
        "block_hashes": [5, 6],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    fields = kv.BlockStored.__struct_fields__
    ev = kv.BlockStored(**{k: v for k, v in values.items() if k in fields})
    payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=[ev, kv.AllBlocksCleared()]))
    d = decode_batch(payload)
    assert d.events == [
        BlocksStored([external_block_hash(5), external_block_hash(6)], ROOT_PARENT_HASH, Tier.CPU),
        AllCleared(),
    ]


def test_an_engine_gone_past_the_grace_is_forgotten_and_read_again_when_back(controlplane, make_agent, publisher):
    agent = make_agent(
        "vllm-6",
        vllm_kv_events=publisher.endpoint,
        **BY_VLLM,
        vllm_kv_events_replay=publisher.replay_endpoint,
        vllm_disconnect_grace_seconds=1.0,
    )
    sub = agent.vllm_events
    assert sub.connected.wait(5)
    time.sleep(0.3)
    publisher.publish(batch(stored([301, 302])))
    with ControlPlaneClient(controlplane.address) as c:
        wait_for(lambda: lookup_hits(c, [301, 302]) == {"vllm-6": 2}, what="indexed")
        publisher.drop_pub()  # the engine dies: nothing says so but its connection
        wait_for(lambda: sub.stats.engine_lost_total == 1, 10, what="engine given up after the grace")
        wait_for(lambda: lookup_hits(c, [301, 302]) == {}, what="its blocks no longer found")
        # the same engine is back (a network partition healed): its replay buffer is read
        # again, then its live batches
        publisher.rebind_pub()
        time.sleep(0.5)  # SUB reconnects on its own
        publisher.publish(batch(stored([303], parent=302)))
        wait_for(lambda: lookup_hits(c, [301, 302, 303]) == {"vllm-6": 3}, what="read again")
    assert sub.stats.engine_lost_total == 1 and sub.stats.unrecovered_gaps_total == 0
    scraped = generate_latest(agent.registry).decode()
    assert 'kvcp_vllm_engine_lost_total{agent_id="vllm-6"} 1.0' in scraped
    assert 'kvcp_vllm_event_batches_total{agent_id="vllm-6"}' in scraped


def test_an_agent_indexing_a_vllm_engine_serves_its_one_model(etcd):
    """vLLM's block hashes do not name the model: on an agent that also served another
    model, a lookup of that model by the same hashes would find the engine's blocks."""
    from agent.core.model_spec import ModelSpec
    from agent.server import Agent, AgentConfig

    other = ModelSpec("other-model", block_size=16, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
    with pytest.raises(ValueError, match="serves that engine's one model"):
        Agent(AgentConfig("two-models", etcd=etcd, models=[M, other], vllm_kv_events="tcp://127.0.0.1:1"))


# ---- found by a review (twelfth session) ------------------------------------------------
# a KVEventBatch array whose events list is nested 200k deep: msgspec raises RecursionError
DEEP_BATCH = b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 200_000 + b"\xc0"


def test_every_live_batch_the_start_up_read_applied_is_skipped_not_taken_for_a_restart():
    """Batches 3 and 4 came live and in the replay buffer read at start: only the first
    was skipped, the second counted as an engine restart (every block forgotten, then
    the whole buffer replayed again)."""
    pub = VllmPublisher()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint)
    try:
        for i in range(5):
            pub.publish(batch(stored([10 + i])), send=False)
        sub._reset_dealer()
        sub.read_buffer_at_start()
        assert sub.stats.last_seq == 4
        ext._pool.journal.drain()
        for seq in (3, 4):  # live, the same payload as in the buffer (as vLLM's publisher sends)
            sub.handle([b"", seq.to_bytes(8, "big"), pub.buffer[seq][1]])
        assert sub.stats.engine_restarts_total == 0 and ext._pool.journal.drain() == []
        sub.handle(_message(5, [15]))  # the first new one is applied
        assert external_block_hash(15) in _claimed(ext) and sub.stats.last_seq == 5
    finally:
        if sub._dealer is not None:
            sub._dealer.close(linger=0)
        pub.close()


def test_an_engine_restarted_after_the_start_up_read_is_a_restart_not_batches_read_already():
    """The engine restarted (seq from 0) after the buffer was read at start, its connection's
    drop not seen (the SUB socket had not connected yet): its batches numbered within the
    read were skipped as read already, the old engine's blocks claimed for good and the
    new engine's first blocks never indexed."""
    pub = VllmPublisher()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint)
    try:
        for i in range(5):
            pub.publish(batch(stored([10 + i])), send=False)
        sub._reset_dealer()
        sub.read_buffer_at_start()
        assert sub.stats.last_seq == 4
        sub.handle([b"", (4).to_bytes(8, "big"), pub.buffer[4][1]])  # published while it was read: skipped
        assert sub.stats.engine_restarts_total == 0
        for seq, h in enumerate([20, 21, 22]):  # the new engine's first batches
            sub.handle(_message(seq, [h]))
        assert sub.stats.engine_restarts_total == 1
        assert _claimed(ext) == {external_block_hash(h) for h in (20, 21, 22)}
    finally:
        if sub._dealer is not None:
            sub._dealer.close(linger=0)
        pub.close()


def test_a_batch_nested_too_deep_is_malformed_and_forgets_the_engine():
    """msgspec's RecursionError was no MalformedBatch: the engine's blocks stayed claimed."""
    with pytest.raises(MalformedBatch):
        decode_batch(DEEP_BATCH)
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber("tcp://127.0.0.1:1", ext)
    sub.handle(_message(0, [1, 2]))
    sub.handle([b"", (1).to_bytes(8, "big"), DEEP_BATCH])
    assert sub.stats.malformed_total == 1 and _claimed(ext) == set()


def test_a_bad_batch_in_the_replay_buffer_at_start_does_not_stop_the_subscriber():
    """It killed the subscriber's thread: the agent ran on, never applying another event."""
    pub = VllmPublisher()
    stop = threading.Event()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint)
    t = threading.Thread(target=sub.run_forever, args=(stop,), daemon=True)
    try:
        pub.publish(batch(stored([1])), send=False)
        pub.publish(DEEP_BATCH, send=False)
        t.start()
        assert sub.connected.wait(10)
        time.sleep(0.3)  # the SUB socket joins
        deadline = time.monotonic() + 10
        while external_block_hash(7) not in _claimed(ext) and time.monotonic() < deadline:
            pub.publish(batch(stored([7])))
            time.sleep(0.1)
        assert t.is_alive() and external_block_hash(7) in _claimed(ext)
    finally:
        stop.set()
        t.join(5)
        pub.close()


def test_a_replay_that_failed_leaves_no_answer_for_the_next_replay_to_read():
    """The replay of gap 1 stopped at a bad batch with the rest of its answer unread; the
    next gap's replay read that stale answer and declared a replayable gap (4) lost."""
    pub = VllmPublisher()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint)
    sub._reset_dealer()
    try:

        def live(seq, hashes, send=True):
            assert pub.publish(batch(stored(hashes)) if hashes else DEEP_BATCH, send=False) == seq
            if send:
                sub.handle([b"", seq.to_bytes(8, "big"), pub.buffer[seq][1]])
                time.sleep(0.3)  # the publisher answers each replay before the next batch

        live(0, [100])
        live(1, None, send=False)  # lost on PUB; in the buffer, and bad
        live(2, [102])  # a gap: its replay meets the bad batch
        live(3, [103])
        live(4, [104], send=False)  # lost on PUB, replayable
        live(5, [105])  # a gap: replayed
        live(6, [106])
        assert sub.stats.unrecovered_gaps_total <= 1
        assert {external_block_hash(h) for h in (104, 105, 106)} <= _claimed(ext)
    finally:
        sub._dealer.close(linger=0)
        pub.close()


def test_an_engine_restarted_within_the_grace_and_idle_holds_nothing_of_the_old_one():
    """The reconnect was acted on at the next live batch only: an idle new engine on the
    same endpoint left the old engine's blocks claimed indefinitely."""
    pub = VllmPublisher()
    stop = threading.Event()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint, disconnect_grace_seconds=30)
    t = threading.Thread(target=sub.run_forever, args=(stop,), daemon=True)
    try:
        t.start()
        assert sub.connected.wait(10)
        time.sleep(0.5)
        pub.publish(batch(stored([1, 2])))
        wait_for(lambda: ext.num_blocks == 2, 5, 0.05, "the engine's blocks indexed")
        pub.drop_pub()
        time.sleep(0.5)
        with pub._lock:  # a new engine: an empty replay buffer, numbers from 0
            pub.buffer.clear()
            pub.seq = 0
        pub.rebind_pub()
        wait_for(lambda: ext.num_blocks == 0, 10, 0.1, "the old engine's blocks forgotten")
        pub.publish(batch(stored([3])))  # the new engine's batches are applied
        wait_for(lambda: ext.num_blocks == 1, 10, 0.1, "the new engine's block indexed")
    finally:
        stop.set()
        t.join(5)
        pub.close()


def test_an_engine_back_after_the_grace_and_idle_is_read_again_at_once():
    """Given up after the grace, the engine's connection coming back was not a reconnect
    (the grace had cleared its drop): its replay buffer was read only at its next live
    batch, so an idle engine's blocks went unclaimed meanwhile."""
    pub = VllmPublisher()
    stop = threading.Event()
    ext = ExternalBlocks(_Pool(), "m", index_by="vllm")
    sub = VllmEventSubscriber(pub.endpoint, ext, replay_endpoint=pub.replay_endpoint, disconnect_grace_seconds=1.0)
    t = threading.Thread(target=sub.run_forever, args=(stop,), daemon=True)
    try:
        t.start()
        assert sub.connected.wait(10)
        time.sleep(0.5)
        pub.publish(batch(stored([1, 2])))
        wait_for(lambda: ext.num_blocks == 2, 5, 0.05, "the engine's blocks indexed")
        pub.drop_pub()
        wait_for(lambda: sub.stats.engine_lost_total == 1, 10, 0.05, "the engine given up")
        assert ext.num_blocks == 0
        pub.rebind_pub()  # the same engine, idle: nothing live comes
        wait_for(lambda: ext.num_blocks == 2, 10, 0.1, "its replay buffer read again")
    finally:
        stop.set()
        t.join(5)
        pub.close()


def test_a_block_hash_twice_in_one_event_is_malformed():
    """Both copies were indexed (by tokens) and a removal reached only one: the other
    stayed claimed for good."""
    with pytest.raises(MalformedBatch, match="repeats"):
        decode_batch(msgspec.msgpack.encode(batch(BlockStored([5, 5], None, list(range(32)), 16, None, "GPU"))))
