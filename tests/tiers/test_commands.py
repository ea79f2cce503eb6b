"""Control-plane commands as an agent executes them: ControlPlaneLink.handle_command on
an in-process Agent (real pool, CPU slab, disk directory and Mover; no control plane),
with the OpUpdates it queues for the control plane read back from its outbox."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from agent.core.mover import CANCELLED, FAILED, RUNNING, SUCCEEDED
from agent.server import Agent, AgentConfig
from protos.kvcp.v1 import agent_pb2
from protos.tier import Tier
from tests.tiers.support import BLOCK_BYTES, SPEC, check_pool, kv, tokens

MOVE, EVICT, COMPRESS = agent_pb2.COMMAND_KIND_MOVE, agent_pb2.COMMAND_KIND_EVICT, agent_pb2.COMMAND_KIND_COMPRESS
PIN, UNPIN, CANCEL = agent_pb2.COMMAND_KIND_PIN, agent_pb2.COMMAND_KIND_UNPIN, agent_pb2.COMMAND_KIND_CANCEL


@pytest.fixture
def agent(tmp_path):
    """Built, not started: nothing listens and nothing talks to etcd. Stopped after the test,
    which frees its transfer engine (left to the garbage collector, an engine's destructor
    stalled whichever later test the collection ran in)."""
    a = Agent(
        AgentConfig(
            agent_id="cmd",
            models=[SPEC],
            cpu_capacity_bytes=8 * BLOCK_BYTES,
            page_bytes=BLOCK_BYTES // 16,  # as an agent pages a tier: a compressed block frees pages
            disk_dir=str(tmp_path / "disk"),
            disk_capacity_bytes=1 << 20,
        )
    )
    yield a
    a.stop()


def store(agent: Agent, n: int = 3, start: int = 0, seed: int = 0):
    toks, data = tokens(n, start), kv(n, seed)
    assert agent.engine.store(SPEC.model_id, toks, data).num_stored_blocks == n
    return toks, data, agent.engine.hashes(SPEC, toks)


def command(kind, op_id: str, hashes=(), **fields) -> agent_pb2.Command:
    return agent_pb2.Command(op_id=op_id, kind=kind, block_hashes=b"".join(hashes), **fields)


def updates(agent: Agent) -> list[agent_pb2.OpUpdate]:
    """OpUpdates the link queued for the control plane since the last call."""
    out = []
    while True:
        try:
            msg = agent.link._outbox.get_nowait()
        except queue.Empty:
            return out
        if msg.WhichOneof("body") == "op_update":
            out.append(msg.op_update)


def run_mover(agent: Agent) -> None:
    while agent.mover.run_once(timeout_seconds=0.01) is not None:
        pass


# ---- MOVE / COMPRESS ----------------------------------------------------------------
def test_move_runs_as_an_operation_and_reports_progress(agent):
    toks, data, hs = store(agent)
    agent.link.handle_command(1, command(MOVE, "op-move", hs, tier=Tier.DISK))
    assert agent.mover.get("op-move").state == "PENDING"
    run_mover(agent)
    assert [agent.pool.tier_of(h) for h in hs] == [Tier.DISK] * 3
    ups = updates(agent)
    assert ups[0].op_id == "op-move" and ups[0].state == RUNNING
    last = ups[-1]
    assert (last.state, last.num_done_blocks, last.num_total_blocks, last.num_failed_blocks) == (SUCCEEDED, 3, 3, 0)
    assert last.moved_bytes == 3 * BLOCK_BYTES
    res = agent.engine.load(SPEC.model_id, toks)
    assert torch.equal(res.kv, data) and res.tiers == (Tier.DISK,) * 3
    check_pool(agent.pool)


def test_move_with_a_codec_reencodes(agent):
    toks, data, hs = store(agent)
    agent.link.handle_command(1, command(MOVE, "op-int8", hs[1:], tier=Tier.DISK, codec="int8"))
    run_mover(agent)
    assert [agent.pool.blocks[h].codec for h in hs] == ["none", "int8", "int8"]
    assert updates(agent)[-1].state == SUCCEEDED
    assert agent.engine.load(SPEC.model_id, toks).num_cached_tokens == len(toks)


def test_move_without_a_tier_fails_at_once(agent):
    _, _, hs = store(agent, n=1)
    agent.link.handle_command(1, command(MOVE, "op-notier", hs))
    (up,) = updates(agent)
    assert up.op_id == "op-notier" and up.state == FAILED and "tier" in up.error
    assert agent.mover.get("op-notier") is None


def test_move_with_an_unknown_codec_fails_and_the_mover_carries_on(agent):
    _, _, hs = store(agent, n=2)
    agent.link.handle_command(1, command(MOVE, "op-bad", hs, tier=Tier.DISK, codec="lz4"))
    agent.link.handle_command(1, command(MOVE, "op-good", hs, tier=Tier.DISK))
    run_mover(agent)
    final = {u.op_id: u for u in updates(agent) if u.state in (SUCCEEDED, FAILED)}
    assert final["op-bad"].state == FAILED and "lz4" in final["op-bad"].error
    assert final["op-good"].state == SUCCEEDED
    assert all(agent.pool.tier_of(h) is Tier.DISK for h in hs)


def test_move_of_blocks_not_held_has_nothing_to_do(agent):
    # named by the control plane's index, evicted here since: not the move's failure
    agent.link.handle_command(1, command(MOVE, "op-gone", [b"\x01" * 16], tier=Tier.DISK))
    run_mover(agent)
    last = updates(agent)[-1]
    assert (last.state, last.num_done_blocks, last.num_failed_blocks) == (
        SUCCEEDED,
        0,
        0,
    ) and "1 block(s) no longer held" in last.error


def test_compress_keeps_the_tier(agent):
    # KV zstd can shrink (random fp16 bytes of a block this small it cannot: such blocks
    # stay raw, test_batched_moves.py -k cannot_shrink)
    toks, data = tokens(3), kv(3).round()
    assert agent.engine.store(SPEC.model_id, toks, data).num_stored_blocks == 3
    hs = agent.engine.hashes(SPEC, toks)
    agent.link.handle_command(1, command(COMPRESS, "op-z", hs, codec="zstd"))
    run_mover(agent)
    assert all(agent.pool.tier_of(h) is Tier.CPU and agent.pool.blocks[h].codec == "zstd" for h in hs)
    assert all(agent.pool.blocks[h].stored_bytes < BLOCK_BYTES for h in hs)
    assert updates(agent)[-1].state == SUCCEEDED
    assert torch.equal(agent.engine.load(SPEC.model_id, toks).kv, data)
    check_pool(agent.pool)


def test_compress_without_hashes_takes_the_blocks_of_one_tier(agent):
    _, _, hs = store(agent, n=4)
    assert agent.pool.move_block(hs[3], Tier.DISK).ok
    agent.link.handle_command(1, command(COMPRESS, "op-cpu", codec="int8", only_tier=Tier.CPU))
    run_mover(agent)
    assert [agent.pool.blocks[h].codec for h in hs] == ["int8", "int8", "int8", "none"]
    assert updates(agent)[-1].num_done_blocks == 3


def test_promotions_send_no_op_updates(agent):
    toks, data, hs = store(agent, n=2)
    for h in hs:
        assert agent.pool.move_block(h, Tier.DISK).ok
    agent.engine.load(SPEC.model_id, toks)  # promotes in the background
    run_mover(agent)
    assert [agent.pool.tier_of(h) for h in hs] == [Tier.CPU] * 2
    assert updates(agent) == []


# ---- CANCEL -------------------------------------------------------------------------
def test_cancel_stops_a_queued_move(agent):
    _, _, hs = store(agent)
    agent.link.handle_command(1, command(MOVE, "op-c", hs, tier=Tier.DISK))
    agent.link.handle_command(1, command(CANCEL, "op-c"))
    run_mover(agent)
    assert agent.mover.get("op-c").state == CANCELLED
    assert updates(agent)[-1].state == CANCELLED
    assert all(agent.pool.tier_of(h) is Tier.CPU for h in hs)


def test_cancel_of_an_unknown_op_changes_nothing(agent):
    _, _, hs = store(agent, n=1)
    agent.link.handle_command(1, command(CANCEL, "nope"))
    assert agent.pool.tier_of(hs[0]) is Tier.CPU and agent.link.rejected_commands_total == 0


# ---- EVICT / PIN / UNPIN ------------------------------------------------------------
def test_evict_drops_blocks_and_their_descendants(agent):
    toks, data, hs = store(agent)
    agent.pool.drain_events()
    agent.link.handle_command(1, command(EVICT, "op-e", hs[1:2]))
    (up,) = updates(agent)
    assert (up.state, up.num_done_blocks, up.num_total_blocks, up.num_failed_blocks) == (SUCCEEDED, 1, 1, 0)
    assert set(agent.pool.blocks) == {hs[0]}
    assert agent.engine.lookup(SPEC.model_id, toks) == SPEC.block_size
    check_pool(agent.pool)


def test_evict_in_the_policys_order_children_first_drops_each_block_once(agent):
    _, _, hs = store(agent, n=4)
    agent.link.handle_command(1, command(EVICT, "op-e", list(reversed(hs))))  # as policy.Evict lists them
    (up,) = updates(agent)
    assert (up.state, up.num_done_blocks, up.num_total_blocks, up.num_failed_blocks) == (SUCCEEDED, 4, 4, 0)
    assert agent.pool.blocks == {}


def test_evict_of_a_namespace_goes_leaves_first(agent):
    store(agent, n=4)
    agent.link.handle_command(1, command(EVICT, "op-ns", namespace=""))
    (up,) = updates(agent)
    assert (up.num_done_blocks, up.num_total_blocks, up.num_failed_blocks) == (4, 4, 0) and agent.pool.blocks == {}


def test_a_prefix_scope_with_a_tier_touches_only_that_tier(agent):
    toks, data, hs = store(agent)
    assert agent.pool.move_block(hs[0], Tier.DISK).ok
    agent.link.handle_command(1, command(COMPRESS, "op-t", hs, codec="int4", only_tier=Tier.CPU))
    run_mover(agent)
    assert [agent.pool.blocks[h].codec for h in hs] == ["none", "int4", "int4"]
    assert updates(agent)[-1].num_done_blocks == 2


def test_an_operation_that_raises_tells_the_control_plane_why(agent, monkeypatch):
    _, _, hs = store(agent)

    def broken(*args, **kwargs):
        raise RuntimeError("the disk controller caught fire")

    monkeypatch.setattr(agent.pool, "move_blocks", broken)
    agent.link.handle_command(1, command(MOVE, "op-x", hs, tier=Tier.DISK))
    with pytest.raises(RuntimeError):
        agent.mover.run_op(agent.mover.get("op-x"))
    last = updates(agent)[-1]
    assert last.state == FAILED and "caught fire" in last.error


def test_an_operation_queued_behind_another_says_it_is_pending(agent):
    _, _, hs = store(agent)
    agent.link.handle_command(1, command(MOVE, "op-q", hs, tier=Tier.DISK))
    pings = list(agent.link._queued_op_pings())
    assert [(m.op_update.op_id, m.op_update.state) for m in pings] == [("op-q", "PENDING")]
    run_mover(agent)
    assert list(agent.link._queued_op_pings()) == []


def test_the_link_takes_commands_as_big_as_the_control_plane_sends():
    from agent.api.sync_client import KEEPALIVE_OPTIONS
    from controlplane.server import MAX_MESSAGE_BYTES

    assert dict(KEEPALIVE_OPTIONS)["grpc.max_receive_message_length"] >= MAX_MESSAGE_BYTES


def test_pin_protects_until_unpinned(agent):
    toks, data, hs = store(agent)
    agent.link.handle_command(1, command(PIN, "op-p", hs, tier=Tier.CPU, pin_id="pin-1"))
    assert updates(agent)[-1].state == SUCCEEDED
    assert all(agent.pool.pin_tier(agent.pool.blocks[h]) == Tier.CPU for h in hs)
    # neither evicted nor moved below the pin's tier
    agent.link.handle_command(1, command(EVICT, "op-e1", hs))
    up = updates(agent)[-1]
    assert (up.num_done_blocks, up.num_failed_blocks) == (0, 3) and set(agent.pool.blocks) == set(hs)
    agent.link.handle_command(1, command(MOVE, "op-m1", hs, tier=Tier.DISK))
    run_mover(agent)
    up = updates(agent)[-1]
    # left where the pin holds them: skipped (as a cleanup skips them), not a failure
    assert (up.state, up.num_done_blocks, up.num_failed_blocks, up.num_skipped_pinned_blocks) == (SUCCEEDED, 0, 0, 3)
    assert "3 block(s) left where pins hold them (at tier cpu)" in up.error
    assert all(agent.pool.tier_of(h) is Tier.CPU for h in hs)
    # unpinned: both work
    agent.link.handle_command(1, command(UNPIN, "op-u", pin_id="pin-1"))
    assert updates(agent)[-1].state == SUCCEEDED
    agent.link.handle_command(1, command(EVICT, "op-e2", hs[2:]))
    assert updates(agent)[-1].num_done_blocks == 1 and hs[2] not in agent.pool.blocks


def test_blocks_a_namespace_pin_holds_are_named_in_the_reply(agent):
    """The control plane cannot map a namespace pin to blocks: the agent says which
    blocks of an evict or a move its pins held, and at which tier."""
    toks, data = tokens(3), kv(3)
    agent.engine.store(SPEC.model_id, toks, data, namespace="docs")
    hs = agent.engine.hashes(SPEC, toks)
    _, _, other = store(agent, n=1, start=500, seed=2)
    agent.link.handle_command(1, command(PIN, "op-p", tier=Tier.CPU, pin_id="ns", namespace="docs"))
    updates(agent)
    agent.link.handle_command(1, command(EVICT, "op-e", [*hs, *other]))
    up = updates(agent)[-1]
    assert (up.num_done_blocks, up.num_failed_blocks) == (1, 3) and other[0] not in agent.pool.blocks
    held = [up.pinned_block_hashes[i : i + 16] for i in range(0, len(up.pinned_block_hashes), 16)]
    assert sorted(held) == sorted(hs) and list(up.pinned_tiers) == [int(Tier.CPU)] * 3
    agent.link.handle_command(1, command(MOVE, "op-m", hs, tier=Tier.DISK))
    run_mover(agent)
    up = updates(agent)[-1]
    assert (up.state, up.num_skipped_pinned_blocks) == (SUCCEEDED, 3) and up.pinned_block_hashes == b"".join(hs)
    assert list(up.pinned_tiers) == [int(Tier.CPU)] * 3


def test_pin_at_disk_allows_demotion_but_not_eviction(agent):
    _, _, hs = store(agent, n=2)
    agent.link.handle_command(1, command(PIN, "op-p", hs, tier=Tier.DISK, pin_id="pin-d"))
    agent.link.handle_command(1, command(MOVE, "op-m", hs, tier=Tier.DISK))
    run_mover(agent)
    assert all(agent.pool.tier_of(h) is Tier.DISK for h in hs)
    agent.link.handle_command(1, command(EVICT, "op-e", hs))
    assert updates(agent)[-1].num_done_blocks == 0 and set(agent.pool.blocks) == set(hs)


def test_an_expired_pin_protects_nothing(agent):
    _, _, hs = store(agent, n=1)
    past = time.time() - 1
    agent.link.handle_command(1, command(PIN, "op-p", hs, tier=Tier.CPU, pin_id="old", expires_unix_seconds=past))
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == 0
    agent.link.handle_command(1, command(EVICT, "op-e", hs))
    assert updates(agent)[-1].num_done_blocks == 1 and agent.pool.blocks == {}


def test_a_pin_lasts_its_time_left_on_the_agent_clock_whatever_the_senders_clock(agent):
    """A control plane whose clock runs ahead (or behind) sends an expiry in its own time;
    the time left it sends is what the agent counts."""
    _, _, hs = store(agent, n=1)
    ahead = time.time() + 3600  # the sender's clock an hour ahead: its expiry is far away here
    agent.link.handle_command(
        1, command(PIN, "op-p", hs, tier=Tier.CPU, pin_id="short", expires_unix_seconds=ahead, ttl_seconds=3.0)
    )
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == Tier.CPU  # (3 s: a stall of this machine is shorter)
    time.sleep(3.1)
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == 0  # expired after its 3 s, not an hour
    behind = time.time() - 3600  # the sender's clock an hour behind: its expiry is already past here
    agent.link.handle_command(
        1, command(PIN, "op-q", hs, tier=Tier.CPU, pin_id="long", expires_unix_seconds=behind, ttl_seconds=60)
    )
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == Tier.CPU


def test_a_wall_clock_step_neither_shortens_nor_stretches_a_pin(agent, monkeypatch):
    _, _, hs = store(agent, n=1)
    wall = time.time
    agent.link.handle_command(1, command(PIN, "op-p", hs, tier=Tier.CPU, pin_id="long", ttl_seconds=60))
    agent.link.handle_command(1, command(PIN, "op-q", hs, tier=Tier.GPU, pin_id="short", ttl_seconds=3.0))
    monkeypatch.setattr(time, "time", lambda: wall() + 86400)  # the wall clock jumps a day ahead
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == Tier.GPU  # neither pin cut short
    monkeypatch.setattr(time, "time", lambda: wall() - 86400)  # ... and a day back
    time.sleep(3.1)
    assert agent.pool.pin_tier(agent.pool.blocks[hs[0]]) == Tier.CPU  # the short one ended on time
    # an expired pin leaves the agent's table (it is not listed to the control plane as held)
    agent.link.handle_command(1, command(PIN, "op-r", hs, tier=Tier.CPU, pin_id="other", ttl_seconds=60))
    assert set(agent.pool.pins.pins) == {"long", "other"}


def test_the_time_left_of_a_pin_is_taken_when_the_command_leaves():
    from controlplane.api.convert import command_to_pb
    from controlplane.core.cluster import AgentCommand

    pin = AgentCommand("pin-p", "pin", pin_id="p", expires_unix_seconds=1000.0)
    assert command_to_pb(pin, 1, now=970.0).command.ttl_seconds == 30.0
    assert 0 < command_to_pb(pin, 1, now=2000.0).command.ttl_seconds < 1e-3  # already over: expires at once
    forever = AgentCommand("pin-f", "pin", pin_id="f")
    assert command_to_pb(forever, 1, now=970.0).command.ttl_seconds == 0.0


# ---- fencing and bad input ----------------------------------------------------------
def test_commands_of_an_older_epoch_are_rejected_and_counted(agent):
    _, _, hs = store(agent)
    agent.link.handle_command(5, command(EVICT, "op-new", hs[2:]))
    assert updates(agent)[-1].state == SUCCEEDED and agent.link.highest_epoch == 5
    agent.link.handle_command(4, command(EVICT, "op-stale", hs[1:2]))  # a deposed leader
    (up,) = updates(agent)
    assert up.op_id == "op-stale" and up.state == FAILED and "stale epoch 4 < 5" in up.error
    assert hs[1] in agent.pool.blocks
    assert agent.link.rejected_commands_total == 1
    agent.link.handle_command(4, command(MOVE, "op-stale2", hs[:1], tier=Tier.DISK))
    assert agent.mover.get("op-stale2") is None and agent.link.rejected_commands_total == 2
    updates(agent)
    agent.link.handle_command(5, command(EVICT, "op-same", hs[1:2]))  # the same epoch is fine
    assert updates(agent)[-1].state == SUCCEEDED and hs[1] not in agent.pool.blocks
    agent.link.handle_command(7, command(EVICT, "op-newer", hs[:1]))
    assert agent.link.highest_epoch == 7 and agent.pool.blocks == {}
    assert agent.link.rejected_commands_total == 2


def test_block_hashes_not_a_multiple_of_16_bytes_fail(agent):
    agent.link.handle_command(1, agent_pb2.Command(op_id="op-x", kind=EVICT, block_hashes=b"\x01" * 17))
    (up,) = updates(agent)
    assert up.state == FAILED and up.error


def test_unknown_command_kind_fails(agent):
    agent.link.handle_command(1, agent_pb2.Command(op_id="op-u", kind=agent_pb2.COMMAND_KIND_UNSPECIFIED))
    (up,) = updates(agent)
    assert up.state == FAILED and "unknown command kind" in up.error


# ---- final updates survive a broken stream -------------------------------------------
def _stream_until_stats(agent: Agent, stream) -> list[agent_pb2.AgentMessage]:
    out = []
    for msg in stream:
        out.append(msg)
        if msg.WhichOneof("body") == "stats":
            return out
    return out


def test_a_final_update_lost_with_its_stream_or_a_full_outbox_is_sent_again(agent):
    import threading

    _, _, hs = store(agent, n=2)
    stop, done = threading.Event(), threading.Event()
    stream = agent.link._outgoing(stop, done)
    _stream_until_stats(agent, stream)
    agent.link.handle_command(1, command(EVICT, "op-lost", hs[1:]))
    # the stream takes the update off the outbox, then breaks before it reaches the wire
    taken = next(m for m in stream if m.WhichOneof("body") == "op_update")
    assert taken.op_update.op_id == "op-lost" and taken.op_update.state == SUCCEEDED
    stream.close()
    # while no stream is up, the outbox fills and drops what comes next
    while True:
        try:
            agent.link._outbox.put_nowait(agent_pb2.AgentMessage())
        except queue.Full:
            break
    agent.link.handle_command(1, command(EVICT, "op-dropped", hs[:1]))
    finals = [
        m.op_update
        for m in _stream_until_stats(agent, agent.link._outgoing(stop, done))
        if m.WhichOneof("body") == "op_update"
    ]
    assert [(u.op_id, u.state) for u in finals] == [("op-lost", SUCCEEDED), ("op-dropped", SUCCEEDED)]
    assert finals[0].num_done_blocks == 1 and finals[1].num_done_blocks == 1


def test_a_long_cleanup_is_said_running_while_it_runs(agent):
    """A cleanup runs on the command loop and said nothing until it ended: one longer
    than the control plane's silence timeout (a large disk tier) was failed, and its scope
    lock let the next cleanup in (a review). The link's pings say it is RUNNING."""
    import threading

    store(agent, 3)
    entered, release = threading.Event(), threading.Event()
    real = agent.pool.cleanup

    def slow_cleanup(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    agent.pool.cleanup = slow_cleanup
    cmd = command(agent_pb2.COMMAND_KIND_CLEANUP, "op-slow-cleanup", older_than_seconds=0.0)
    t = threading.Thread(target=agent.link.handle_command, args=(1, cmd))
    t.start()
    try:
        assert entered.wait(10)
        pings = [m.op_update for m in agent.link._queued_op_pings()]
        assert [(u.op_id, u.state) for u in pings] == [("op-slow-cleanup", RUNNING)]
    finally:
        release.set()
        t.join(10)
    assert [u.state for u in updates(agent)] == [SUCCEEDED]
    assert list(agent.link._queued_op_pings()) == []  # ended: no more pings


def test_a_cleanup_is_in_the_disk_dead_log_before_it_answers(agent):
    """A freed extent reached the dead log from the disk's background thread: a kill -9
    between a cleanup answered SUCCEEDED and that write brought the blocks back at the
    next start (a review). The command records them itself before answering."""
    import threading

    _, _, hs = store(agent, 3)
    for h in reversed(hs):
        assert agent.pool.move_block(h, Tier.DISK).ok
    disk = agent.disk
    assert disk is not None
    on_command_thread: list[bool] = []
    real = disk.drain

    def watched() -> None:
        on_command_thread.append(threading.current_thread() is threading.main_thread())
        real()

    disk.drain = watched
    agent.link.handle_command(1, command(agent_pb2.COMMAND_KIND_CLEANUP, "op-durable", older_than_seconds=0.0))
    [done] = updates(agent)
    assert done.state == SUCCEEDED and done.num_done_blocks == 3
    assert any(on_command_thread)  # drained by the command itself, before its answer


def test_a_pin_past_its_expiry_protects_nothing_on_a_machine_just_booted(agent):
    """A pin sent with an expiry already past protects nothing, also on a machine booted
    moments ago (its monotonic clock is small: the time left, negative, must not become
    "no expiry")."""
    toks = tokens(1)
    assert agent.engine.store(SPEC.model_id, toks, kv(1)).num_stored_blocks == 1
    h = agent.engine.hashes(SPEC, toks)[0]
    agent.pool.pins.clock = lambda: 5.0  # booted 5 s ago
    past = time.time() - 60  # expired a minute ago (a control plane sending only its absolute expiry)
    cmd = agent_pb2.Command(
        op_id="op-p", kind=PIN, block_hashes=h, tier=int(Tier.CPU), pin_id="old", expires_unix_seconds=past
    )
    agent.link.handle_command(1, cmd)
    assert agent.pool.pin_tier(agent.pool.blocks[h]) == 0, "a pin past its expiry holds (for ever)"


def test_a_replaced_stream_takes_no_events_from_the_new_one(agent):
    """A stream replaced by a new one (its call dead, `done` not set yet) could pass its
    loop's check and drain the events that followed the new stream's inventory into the
    void: lost, and an agent idle after that left the index without those blocks until its
    next event (a review, by reading). A stream drains only while the latest inventory is
    its own, and ends once a newer one was taken."""
    import threading

    stop, old_done = threading.Event(), threading.Event()
    old = agent.link._outgoing(stop, old_done)
    _stream_until_stats(agent, old)
    new = agent.link._outgoing(stop, threading.Event())
    _stream_until_stats(agent, new)  # the new stream's inventory
    _, _, hs = store(agent, n=2)
    from_old: list = []
    pump = threading.Thread(target=lambda: from_old.extend(old), daemon=True)
    pump.start()
    pump.join(2.0)
    assert not pump.is_alive(), "the replaced stream did not end"
    assert not [m for m in from_old if m.WhichOneof("body") == "events"]
    events = next(m for m in new if m.WhichOneof("body") == "events")
    sent = b"".join(g.block_hashes for g in events.events.groups)
    assert set(hs) <= {sent[i : i + 16] for i in range(0, len(sent), 16)}
    stop.set()
