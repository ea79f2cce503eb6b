"""agent.core.drain: the chains a drained agent hands off (every visible block in one,
most recently used first), and where each goes (one destination per root, the next one
with room when it is full or failing, never past a destination's free bytes)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.core.blocks import BlockMeta
from agent.core.drain import MAX_FAILED_CHAINS_IN_A_ROW, DrainChain, DrainPlan, drain_chains
from protos.tier import Tier

ROOT_PARENT = b"\0" * 16


def meta(name: str, parent: str = "", last_access: int = 0, model: str = "m", visible: bool = True) -> BlockMeta:
    return BlockMeta(
        name.encode().ljust(16, b"."),
        parent.encode().ljust(16, b".") if parent else ROOT_PARENT,
        model,
        100,
        Tier.CPU,
        None,
        stored_bytes=100,
        last_access=last_access,
        ready=visible,
    )


def names(chain: DrainChain) -> list[str]:
    return [h.rstrip(b".").decode() for h in chain.block_hashes]


def test_chains_run_root_to_leaf_most_recent_leaf_first():
    blocks = [
        meta("sys", last_access=9),
        meta("a1", "sys", 5),
        meta("a2", "a1", 6),
        meta("b1", "sys", 8),
        meta("doc", last_access=7),
        meta("other", model="m2", last_access=10),
    ]
    chains = drain_chains(blocks, "m")
    assert [names(c) for c in chains] == [["sys", "b1"], ["doc"], ["sys", "a1", "a2"]]
    assert len(drain_chains(blocks)) == 4  # every model


def test_a_block_being_written_is_not_sent_and_ends_no_chain():
    chains = drain_chains([meta("p"), meta("c", "p", visible=False)])
    assert [names(c) for c in chains] == [["p"]]


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(-1, 30), st.integers(0, 100)), max_size=40))
def test_every_visible_block_is_in_a_chain_that_starts_at_a_root(specs):
    blocks = {}
    for i, parent, access in specs:  # parents may be missing, or form a cycle
        blocks[str(i)] = meta(str(i), str(parent) if parent >= 0 else "", access)
    chains = drain_chains(blocks.values())
    for c in chains:  # a walk ends, and never repeats a block
        assert len(set(c.block_hashes)) == len(c.block_hashes)
    assert [c.last_access for c in chains] == sorted((c.last_access for c in chains), reverse=True)
    acyclic = {k: m for k, m in blocks.items() if not _on_cycle(blocks, k)}
    covered = {h for c in chains for h in c.block_hashes}
    assert {m.block_hash for m in acyclic.values()} <= covered


def _on_cycle(blocks: dict[str, BlockMeta], start: str) -> bool:
    by_hash = {m.block_hash: m for m in blocks.values()}
    seen, m = set(), blocks[start]
    while m is not None and m.block_hash not in seen:
        seen.add(m.block_hash)
        m = by_hash.get(m.parent_hash)
    return m is not None  # came back to a block seen: its ancestry loops


def chain(*hashes: str) -> DrainChain:
    return DrainChain("m", tuple(h.encode() for h in hashes), tuple(100 for _ in hashes), 0)


def test_roots_are_dealt_in_turn_and_siblings_follow_their_root():
    plan = DrainPlan(["big", "small"], [1000, 500])
    assert plan.order(chain("r1", "x")) == ["big", "small"]
    plan.took("big", chain("r1", "x"), 200)
    assert plan.order(chain("r2", "y")) == ["small", "big"]
    assert plan.order(chain("r1", "z")) == ["big", "small"]  # its root went to big


def test_a_destination_is_never_sent_past_its_free_bytes():
    plan = DrainPlan(["a", "b"], [300, 200])
    plan.took("a", chain("r"), 250)
    assert plan.need("a", chain("r", "s")) == 100 and plan.order(chain("r", "s")) == ["b"]  # a has 50 B left
    plan.took("b", chain("r", "s"), 200)
    assert plan.order(chain("q")) == [] and plan.exhausted is False
    plan.took("a", chain("q"), 50)
    assert plan.exhausted


def test_a_chain_that_follows_its_root_elsewhere_counts_its_shared_prefix_there():
    """Review: the shared prefix went to `a` with the first chain; a sibling chain that goes
    to `b` (a full) carries it again, and b's room must cover that, not only the new leaf."""
    plan = DrainPlan(["a", "b"], [400, 300])
    plan.took("a", chain("sys1", "sys2", "x1", "x2"), 400)
    sibling = chain("sys1", "sys2", "y1", "y2")
    assert plan.need("a", sibling) == 200 and plan.need("b", sibling) == 400
    assert plan.order(sibling) == []  # a is full, b has 300 B: the chain is 400 B there
    plan.took("a", chain("sys1"), 0, 1)  # a block held already costs nothing
    assert plan.need("a", chain("sys1", "q")) == 100


def test_a_chain_goes_only_to_destinations_serving_its_model():
    plan = DrainPlan(["a", "b"], [1000, 1000], serves={"a": frozenset({"m"}), "b": frozenset({"m2"})})
    assert plan.order(chain("r1")) == ["a"]
    assert plan.order(chain("r2")) == ["a"]  # b is not dealt a root of a model it does not serve
    other = DrainChain("m2", (b"o",), (100,), 0)
    assert plan.order(other) == ["b"]
    assert DrainPlan(["c"], [1000]).order(other) == ["c"]  # models not known: tried


def test_a_failing_destination_is_given_up_after_some_chains_in_a_row():
    plan = DrainPlan(["a", "b"], [10_000, 10_000])
    for _ in range(MAX_FAILED_CHAINS_IN_A_ROW - 1):
        plan.failed("a", "recompute: peer stalled")
    plan.took("a", chain("r"), 100)  # one that went through starts the count again
    for _ in range(MAX_FAILED_CHAINS_IN_A_ROW - 1):
        plan.failed("a", "recompute: peer stalled")
    assert "a" not in plan.given_up
    plan.failed("a", "recompute: peer stalled")
    assert plan.given_up == {"a": "recompute: peer stalled"}
    assert plan.order(chain("r", "s")) == ["b"]
    plan.failed("b", "destination_agent_id: agent b is cordoned", permanent=True)
    assert plan.exhausted


def test_a_destinations_room_is_its_cpu_and_disk_below_where_the_policy_drops():
    """Review: the budget was the free bytes of every tier, a GPU tier's included (no
    handoff lands there), and up to the last byte (a pass over the high watermark drops)."""
    from types import SimpleNamespace as T

    from controlplane.core.policy import Policy, drop_line_bytes, room_without_drops_bytes

    policy = Policy.from_mapping({})  # watermarks 0.90 / 0.95
    gpu = T(tier=Tier.GPU, capacity_bytes=1000, used_bytes=0)
    cpu = T(tier=Tier.CPU, capacity_bytes=1000, used_bytes=500)
    disk = T(tier=Tier.DISK, capacity_bytes=2000, used_bytes=0)
    assert room_without_drops_bytes([gpu, cpu], policy) == 950 - 500  # cpu the slowest: its high watermark
    assert room_without_drops_bytes([gpu, cpu, disk], policy) == 900 + 1900 - 500  # cpu down to low, disk to high
    assert room_without_drops_bytes([gpu], policy) == 0
    assert room_without_drops_bytes([T(tier=Tier.CPU, capacity_bytes=1000, used_bytes=990)], policy) == 0
    # the line each destination holds the drain's blocks to as its tiers stand (used bytes, summed)
    assert drop_line_bytes([gpu, cpu, disk], policy) == 900 + 1900
    assert drop_line_bytes([T(tier=Tier.GPU, capacity_bytes=1000, used_bytes=980), cpu], policy) == 950 - 80
    assert drop_line_bytes([gpu], policy) == 0


def test_a_destination_that_refused_a_chain_past_its_line_is_sent_no_more():
    """Route's handoffs took the room it had left: the chain goes to the next one."""
    plan = DrainPlan(["a", "b"], [1000, 1000])
    plan.took("a", chain("p"), 100)
    plan.full("a")
    assert plan.room("a") == 0 and plan.order(chain("q")) == ["b"] and not plan.exhausted
    plan.full("b")
    assert plan.exhausted and not plan.given_up


def test_a_full_destination_reopened_is_sent_up_to_the_room_it_was_given_less_what_it_took():
    """Review: a destination that refused past its line was full for the rest of the drain,
    even once room freed there. Its chains wait (waits_for_room) and it is tried again
    (reopen), up to what it had free less what it was sent: the room the control plane
    holds for the drain there; whether a chain fits now is the destination's to say."""
    plan = DrainPlan(["a"], [1000])
    plan.took("a", chain("p"), 300)
    plan.full("a")
    assert plan.room("a") == 0 and plan.order(chain("q")) == [] and plan.exhausted
    assert plan.full_destinations == ["a"] and plan.waits_for_room(chain("q"))
    assert not plan.waits_for_room(chain(*"abcdefgh"))  # 800 B: more than the 700 B it was given
    assert plan.reopen() == ["a"] and plan.full_destinations == []
    assert plan.room("a") == 700 and plan.order(chain("q")) == ["a"] and not plan.exhausted
    plan.took("a", chain("q"), 700)
    assert plan.room("a") == 0 and not plan.waits_for_room(chain("r"))  # out of room, not full: no wait
    assert plan.sent_bytes == {"a": 1000}


def test_a_chain_waits_for_room_only_at_a_full_destination_that_could_take_it():
    plan = DrainPlan(["a", "b"], [1000, 1000], serves={"a": frozenset({"m"}), "b": frozenset({"m2"})})
    plan.full("b")
    assert not plan.waits_for_room(chain("r"))  # b serves another model
    assert plan.waits_for_room(DrainChain("m2", (b"o",), (100,), 0))
    plan.failed("b", "destination_agent_id: agent b is cordoned", permanent=True)
    assert plan.full_destinations == [] and not plan.waits_for_room(DrainChain("m2", (b"o",), (100,), 0))
    assert plan.reopen() == [] and plan.order(DrainChain("m2", (b"o",), (100,), 0)) == []  # given up stays so


def test_chains_holding_a_pinned_block_go_first():
    blocks = [meta("hot", last_access=9), meta("kb", last_access=1), meta("kb-q", "kb", 2)]
    pinned = frozenset({blocks[1].block_hash})  # the pinned parent: its chain goes first
    assert [names(c) for c in drain_chains(blocks, "m", pinned)] == [["kb", "kb-q"], ["hot"]]
    assert [names(c) for c in drain_chains(blocks, "m")] == [["hot"], ["kb", "kb-q"]]


def test_a_destination_is_charged_what_a_block_takes_where_it_lands():
    """Review: a compressed block's payload may end inside a page of the destination's
    slab; its room is charged the whole pages (an int8 block took 18 % more than counted)."""
    pages = DrainPlan(["a", "b"], [1024, 1024], footprint=lambda d, n: -(-n // 256) * 256)
    c = DrainChain("m", (b"r", b"s", b"t"), (300, 300, 300), 0)
    assert pages.need("a", c) == 3 * 512 and pages.order(c) == []  # 900 B of payload, 1,536 B of pages
    assert pages.landed("a", c, 1, 3) == 2 * 512  # the first was there already
    pages.took("a", chain("q"), pages.landed("a", chain("q"), 0, 1), 1)
    assert pages.room("a") == 1024 - 256
    assert DrainPlan(["a"], [1024]).need("a", c) == 900  # (the default: as stored)


def test_a_gpu_tier_over_its_high_watermark_takes_its_excess_out_of_the_room():
    """Review: a destination's GPU tier over its high watermark is brought down to its low
    one by the next pass, and what it demotes lands in the CPU tier the drain was promised:
    that room was counted twice (the drain's blocks and the GPU's pushed out the CPU's own
    blocks). A GPU tier under its high watermark moves nothing and takes nothing."""
    from types import SimpleNamespace as T

    from controlplane.core.policy import Policy, room_without_drops_bytes

    policy = Policy.from_mapping({})  # watermarks 0.90 / 0.95
    cpu = T(tier=Tier.CPU, capacity_bytes=1000, used_bytes=500)
    over = T(tier=Tier.GPU, capacity_bytes=1000, used_bytes=980)
    assert room_without_drops_bytes([over, cpu], policy) == 950 - 500 - (980 - 900)
    under = T(tier=Tier.GPU, capacity_bytes=1000, used_bytes=940)
    assert room_without_drops_bytes([under, cpu], policy) == 950 - 500
    full = T(tier=Tier.GPU, capacity_bytes=10_000, used_bytes=10_000)
    assert room_without_drops_bytes([full, cpu], policy) == 0
