"""Route (pure): prefill by cached prefix and queue, decode by link speed, idleness and
free capacity, and the rule for not splitting prefill and decode."""

from __future__ import annotations

import pytest

from controlplane.core.routing import Candidate, DataPlaneView, LinkView, RouteParams, route

MIB = 1 << 20
P = RouteParams(prefill_tokens_per_second=10_000, default_link_bytes_per_second=1e9, interference_factor=0.5)


def dp(free=512 * MIB, cap=1024 * MIB, inbound=0, queued=0, links=()):
    return DataPlaneView(free, cap, inbound, 4, 0, queued, {lk.peer_agent_id: lk for lk in links})


def test_prefill_prefers_the_cached_prefix_and_is_steered_away_from_queued_handoffs():
    agents = [
        Candidate("p1", "a:1", "prefill", num_cached_blocks=10, dataplane=dp()),
        Candidate("p2", "a:2", "prefill", num_cached_blocks=0, dataplane=dp()),
        Candidate("d1", "a:3", "decode", dataplane=dp()),
    ]
    r = route("prefill", agents, num_blocks=12, block_size=16, block_bytes=MIB, params=P)
    assert r.agent_id == "p1" and r.num_cached_tokens == 160
    # p1's handoffs queue behind slow decode agents: new prompts go to p2
    agents[0] = Candidate("p1", "a:1", "prefill", num_cached_blocks=10, dataplane=dp(queued=8))
    assert route("prefill", agents, 12, 16, MIB, P).agent_id == "p2"


def test_decode_prefers_a_fast_idle_link_and_skips_agents_behind():
    pre = dp(links=[LinkView("d1", 0.2e9), LinkView("d2", 2e9), LinkView("d3", 2e9, inflight=3)])
    agents = [
        Candidate("p", "a:0", "prefill", dataplane=pre),
        Candidate("d1", "a:1", "decode", dataplane=dp()),
        Candidate("d2", "a:2", "decode", dataplane=dp()),
        Candidate("d3", "a:3", "decode", dataplane=dp()),
        Candidate("d4", "a:4", "decode", dataplane=dp(free=50 * MIB)),  # under the 10% watermark
    ]
    r = route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p")
    assert r.agent_id == "d2" and not r.backpressure
    scores = {c.agent_id: c for c in r.candidates}
    assert scores["d4"].behind and "watermark" in scores["d4"].note
    assert scores["d1"].transfer_seconds > scores["d3"].transfer_seconds > scores["d2"].transfer_seconds
    # a decode agent that holds most of the prefix needs fewer bytes: preferred over a faster empty one
    agents[1] = Candidate("d1", "a:1", "decode", num_cached_blocks=60, dataplane=dp())
    assert route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p").agent_id == "d1"


def test_decode_agents_with_about_as_fast_links_are_chosen_by_room():
    """Links measured a little apart (1.1 and 1.0 GB/s between the same hosts) gave every
    handoff to the slightly faster one while the other had room (a stress review's
    driver: 28 of 32 handoffs to one decode agent, which pushed out 64 of its blocks).
    Scores within near_score_fraction of the best go by room; a clearly faster link still
    wins."""
    pre = dp(links=[LinkView("d1", 1.1e9), LinkView("d2", 1.0e9), LinkView("d3", 0.5e9)])
    agents = [
        Candidate("p", "a:0", "prefill", dataplane=pre),
        Candidate("d1", "a:1", "decode", dataplane=dp(free=300 * MIB)),
        Candidate("d2", "a:2", "decode", dataplane=dp(free=600 * MIB)),
        Candidate("d3", "a:3", "decode", dataplane=dp(free=900 * MIB)),  # twice as slow: not as good
    ]
    r = route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p")
    assert r.agent_id == "d2" and [c.agent_id for c in r.candidates] == ["d2", "d1", "d3"]
    agents[2] = Candidate("d2", "a:2", "decode", dataplane=dp(free=200 * MIB))
    assert route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p").agent_id == "d1"
    # an agent behind is never "as good" as one that is not, however roomy the rest
    agents[1] = Candidate("d1", "a:1", "decode", dataplane=dp(free=300 * MIB, inbound=4))
    assert route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p").agent_id == "d2"


def test_every_decode_agent_behind_is_backpressure():
    agents = [
        Candidate("p", "a:0", "prefill", dataplane=dp()),
        Candidate("d1", "a:1", "decode", dataplane=dp(inbound=4)),
        Candidate("d2", "a:2", "decode", dataplane=dp(free=0)),
    ]
    r = route("pair", agents, 8, 16, MIB, P)
    assert r.backpressure and r.disaggregate and "queue" in r.reason
    # an agent that can also decode keeps the request instead
    agents[0] = Candidate("p", "a:0", "both", dataplane=dp())
    r = route("pair", agents, 8, 16, MIB, P)
    assert r.backpressure and not r.disaggregate and r.decode_agent_id == "p"


def test_split_only_when_the_handoff_costs_less_than_it_saves():
    def agents(link_rate):
        pre = dp(links=[LinkView("d", link_rate)])
        return [Candidate("p", "a:0", "both", dataplane=pre), Candidate("d", "a:1", "decode", dataplane=dp())]

    # 64 blocks x 16 tokens = 1024 tokens: 0.1024 s of prefill, 0.0512 s saved by splitting;
    # 64 MiB over 2 GB/s is 0.034 s: split. Over 0.5 GB/s it is 0.134 s: not worth it.
    fast = route("pair", agents(2e9), 64, 16, MIB, P)
    assert fast.disaggregate and fast.decode_agent_id == "d" and fast.transfer_seconds < fast.saved_seconds
    slow = route("pair", agents(0.5e9), 64, 16, MIB, P)
    assert not slow.disaggregate and slow.decode_agent_id == "p" and "costs more" in slow.reason
    # the same 2 GB/s link with 25 ms of fixed cost a transfer (round trips): not worth it
    slow_start = [Candidate("p", "a:0", "both", dataplane=dp(links=[LinkView("d", 2e9, latency_seconds=0.025)]))]
    r = route("pair", [*slow_start, agents(2e9)[1]], 64, 16, MIB, P)
    assert not r.disaggregate and r.transfer_seconds == pytest.approx(0.025 + 64 * MIB / 2e9)
    assert "over a 2.00 GB/s link (measured) + 25.0 ms a transfer, 0 on it" in r.candidates[-1].note
    # a prefill-only agent always splits
    only = [Candidate("p", "a:0", "prefill", dataplane=dp(links=[LinkView("d", 0.5e9)])), agents(0.5e9)[1]]
    assert route("pair", only, 64, 16, MIB, P).disaggregate


def test_backpressure_keeps_decode_within_capacity():
    from benchmarks.handoff import SimConfig, simulate

    cfg = SimConfig(num_requests=600, requests_per_second=7.0, seed=3)
    on, off = simulate(cfg, True), simulate(cfg, False)
    assert on["requests"] == off["requests"] == 600
    assert not on["over_capacity"] and on["decode_peak_blocks"] <= cfg.decode_capacity_blocks and on["overruns"] == 0
    assert on["decode_queue_max"] > 0  # it held handoffs back instead
    assert off["over_capacity"] and off["overruns"] > 0


def test_route_sends_no_work_to_an_agent_without_a_stream_or_silent():
    """A dead or hung agent keeps its registration, and its blocks indexed, until its lease
    goes: Route must not pick it meanwhile, however much of the prompt it holds."""
    import queue

    import numpy as np

    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
    from controlplane.core.routing import route_request
    from protos import errors
    from protos.block_hash import ROOT_PARENT_HASH
    from protos.tier import Tier

    now = [100.0]
    cluster = Cluster(clock=lambda: now[0])
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")
    chain = [np.random.default_rng(1).bytes(16) for _ in range(4)]
    for agent_id in ("holder", "other", "no-stream"):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [model], []))
    for agent_id in ("holder", "other"):
        cluster.hello(agent_id, "s")
        held = [BlockGroup("m", Tier.CPU, b"".join(chain), ROOT_PARENT_HASH + b"".join(chain[:-1]))]
        cluster.apply_inventory_chunk(agent_id, 0, 0, True, held if agent_id == "holder" else [])
        cluster.attach_outbox(agent_id, "s", queue.Queue())
    packed = b"".join(chain)
    assert route_request(cluster, "m", block_hashes=packed, role="prefill").agent_id == "holder"
    # 'holder' goes silent (SIGSTOPped: its stream stays open); 'other' keeps reporting
    now[0] += 10
    cluster.update_stats("other", [], 0, 0, 0)
    decision = route_request(cluster, "m", block_hashes=packed, role="prefill")
    assert decision.agent_id == "other" and {c.agent_id for c in decision.candidates} == {"other"}
    with pytest.raises(errors.NotFound, match="'holder'.*silent"):
        route_request(cluster, "m", block_hashes=packed, role="decode", prefill_agent_id="holder")
    # 'holder' speaks again: routable again; the agent that never opened a stream never is
    cluster.update_stats("holder", [], 0, 0, 0)
    assert route_request(cluster, "m", block_hashes=packed, role="prefill").agent_id == "holder"
    cluster.stream_closed("other", "s")
    assert {c.agent_id for c in route_request(cluster, "m", block_hashes=packed, role="prefill").candidates} == {
        "holder"
    }
    # every agent silent: the answer says so, not that no agent takes the role (a review)
    now[0] += 10
    decision = route_request(cluster, "m", block_hashes=packed, role="prefill")
    assert not decision.agent_id and "holder silent for over 5s" in decision.reason, decision.reason


def test_a_cordoned_agent_gets_no_new_work_but_stays_a_transfer_source():
    """kvctl cordon: an agent out of rotation (a rolling upgrade, a bad GPU) is no holder
    to a router's Lookup and no candidate to Route, whatever it holds; its blocks stay
    indexed (a transfer may still empty it) and uncordoning puts it back."""
    import queue

    import numpy as np

    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
    from controlplane.core.routing import route_request
    from protos import errors
    from protos.block_hash import ROOT_PARENT_HASH
    from protos.tier import Tier

    cluster = Cluster()
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")
    chain = [np.random.default_rng(2).bytes(16) for _ in range(4)]
    packed = b"".join(chain)
    for agent_id in ("holder", "other"):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [model], []))
        cluster.hello(agent_id, "s")
        held = [BlockGroup("m", Tier.CPU, packed, ROOT_PARENT_HASH + b"".join(chain[:-1]))]
        cluster.apply_inventory_chunk(agent_id, 0, 0, True, held if agent_id == "holder" else [])
        cluster.attach_outbox(agent_id, "s", queue.Queue())
    assert route_request(cluster, "m", block_hashes=packed, role="prefill").agent_id == "holder"

    cluster.set_cordoned({"holder": "kernel upgrade"})
    assert cluster.lookup("m", block_hashes=packed).matches == []
    source = cluster.lookup("m", block_hashes=packed, record=False, include_cordoned=True)
    assert [(m.agent_id, m.num_hit_blocks) for m in source.matches] == [("holder", 4)]
    for role in ("prefill", "decode", "pair"):
        decision = route_request(cluster, "m", block_hashes=packed, role=role)
        assert {c.agent_id for c in decision.candidates} == {"other"}, role
        assert decision.agent_id == "other" or decision.decode_agent_id == "other", (role, decision)
    # a request prefilled there before the cordon: its decode goes elsewhere, holder the source
    decision = route_request(cluster, "m", block_hashes=packed, role="decode", prefill_agent_id="holder")
    assert (decision.prefill_agent_id, decision.decode_agent_id) == ("holder", "other"), decision
    with pytest.raises(errors.FailedPrecondition, match="'holder' is cordoned .kernel upgrade."):
        route_request(cluster, "m", block_hashes=packed, role="prefill", prefill_agent_id="holder")
    cluster.set_cordoned({"holder": "kernel upgrade", "other": "drained"})
    decision = route_request(cluster, "m", block_hashes=packed, role="prefill")
    assert not decision.agent_id and "cordoned: holder, other" in decision.reason, decision.reason

    cluster.set_cordoned({})
    assert route_request(cluster, "m", block_hashes=packed, role="prefill").agent_id == "holder"
    assert [m.agent_id for m in cluster.lookup("m", block_hashes=packed).matches] == ["holder"]


def test_prefill_ties_go_to_the_agent_the_lookup_ranks_first():
    """Two agents hold as long a prefix, one in CPU memory, one on disk: the lookup ranks
    the faster copy first and Route follows it (it went by agent id)."""
    on_disk = Candidate("agent-1", "a1:1", "both", 4, DataPlaneView(), lookup_rank=1)
    in_cpu = Candidate("agent-2", "a2:1", "both", 4, DataPlaneView(), lookup_rank=0)
    decision = route("prefill", [on_disk, in_cpu], 4, 16, 1024, RouteParams())
    assert decision.agent_id == "agent-2"


def test_decode_for_a_prefill_agent_of_role_both_stays_on_it_when_every_other_is_behind():
    """The pair Route kept the request on its role-both prefill agent; the decode step of
    the two-step flow named an agent that was behind (a review)."""
    agents = [
        Candidate("p", "a:0", "both", dataplane=dp()),
        Candidate("d", "a:1", "decode", dataplane=dp(free=10 * MIB)),  # under the watermark
    ]
    pair = route("pair", agents, 64, 16, MIB, P)
    decode = route("decode", agents, 64, 16, MIB, P, prefill_agent_id="p")
    assert pair.decode_agent_id == decode.decode_agent_id == "p" and not decode.disaggregate
    assert decode.backpressure and "every decode agent is behind" in decode.reason


def test_a_prompt_of_no_full_block_is_not_split():
    """0 s of handoff against 0 s saved was a split: the decode agent got nothing to
    reuse and recomputed the prompt (a review)."""
    agents = [Candidate("p", "a:0", "both", dataplane=dp()), Candidate("d", "a:1", "decode", dataplane=dp())]
    r = route("pair", agents, 0, 16, MIB, P)
    assert r.decode_agent_id == "p" and not r.disaggregate


def test_a_burst_of_routes_within_one_report_counts_what_it_sent():
    """Every Route of a burst saw the free bytes of the same report: all went to the
    decode agent with the most room, past it (its Reserve refused the rest: recompute; a
    review). What Route sent counts against an agent until ROUTED_HOLD_SECONDS pass."""
    import queue

    from controlplane.core.cluster import AgentRecord, Cluster, ModelInfo
    from controlplane.core.routing import ROUTED_HOLD_SECONDS, DataPlaneStates, RouteDecision, route_request
    from protos.block_hash import hash_prefix

    cluster = Cluster(clock=lambda: 100.0)
    t = [0.0]
    cluster.dataplane = DataPlaneStates(clock=lambda: t[0])
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")  # 32 KiB blocks
    block = 2 * 2 * 16 * 2 * 128 * 2
    for agent_id, role, free, capacity in (
        ("p", "prefill", 0, 0),
        ("d1", "decode", 300, 400),
        ("d2", "decode", 200, 300),
    ):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [model], []))
        cluster.hello(agent_id, "s")
        cluster.apply_inventory_chunk(agent_id, 0, 0, True, [])
        cluster.attach_outbox(agent_id, "s", queue.Queue())
        cluster.dataplane.register(agent_id, role)
        cluster.dataplane.update(agent_id, DataPlaneView(free * block, capacity * block, 0, 8))
    prompt = hash_prefix("m", range(100 * 16), 16)  # 100 blocks each

    def route() -> RouteDecision:
        return route_request(cluster, "m", block_hashes=prompt, role="decode", prefill_agent_id="p")

    picks = [route() for _ in range(5)]
    assert not any(r.backpressure for r in picks)  # each had room when it was routed
    assert sorted(r.decode_agent_id for r in picks) == ["d1"] * 3 + ["d2"] * 2  # 300 + 200 blocks
    assert route().backpressure  # a sixth finds neither with room: it waits
    t[0] += ROUTED_HOLD_SECONDS + 0.1  # reported since: the report is what counts again
    again = route()
    assert again.decode_agent_id == "d1" and not again.backpressure


def test_concurrent_routes_do_not_promise_a_decode_agent_past_its_free_bytes(monkeypatch):
    """Two Routes at once both read the decode agent's free bytes before either noted what
    it sent: both took the same room, promising it 200 blocks with 150 free (a review)."""
    import queue
    import threading
    import time

    from controlplane.core import routing
    from controlplane.core.cluster import AgentRecord, Cluster, ModelInfo
    from controlplane.core.routing import DataPlaneView, route_request
    from protos.block_hash import hash_prefix

    cluster = Cluster()
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")  # 32 KiB blocks
    block = 2 * 2 * 16 * 2 * 128 * 2
    for agent_id, role, free in (("p", "prefill", 0), ("d", "decode", 150)):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [model], []))
        cluster.hello(agent_id, "s")
        cluster.apply_inventory_chunk(agent_id, 0, 0, True, [])
        cluster.attach_outbox(agent_id, "s", queue.Queue())
        cluster.dataplane.register(agent_id, role)
        cluster.dataplane.update(agent_id, DataPlaneView(free * block, 1000 * block, 0, 8))
    decide = routing.route

    def slow_route(*args, **kwargs):  # the decision takes a moment: another Route runs meanwhile
        time.sleep(0.05)
        return decide(*args, **kwargs)

    monkeypatch.setattr(routing, "route", slow_route)
    prompts = [hash_prefix("m", range(k * 10_000, k * 10_000 + 100 * 16), 16) for k in range(2)]  # 100 blocks
    picks = []
    threads = [
        threading.Thread(
            target=lambda h=h: picks.append(
                route_request(cluster, "m", block_hashes=h, role="decode", prefill_agent_id="p")
            )
        )
        for h in prompts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # room for one of the two 100-block handoffs: the other waits (backpressure)
    assert sorted(r.backpressure for r in picks) == [False, True], [(r.decode_agent_id, r.reason) for r in picks]


def test_a_decode_agent_holding_the_prefix_pinned_or_in_another_tier_is_not_behind():
    """Its free bytes (the agent's reclaimable bytes of the handoff tier) never counted
    its pinned blocks, nor those in another tier, yet Route took all its cached blocks off
    them: the agent holding most of a pinned system prompt looked full (a review)."""
    import queue

    from controlplane.core.cluster import AgentRecord, BlockGroup, Cluster, ModelInfo
    from controlplane.core.pins import Pin
    from controlplane.core.routing import route_request
    from controlplane.manager import Manager
    from protos.block_hash import ROOT_PARENT_HASH, hash_prefix
    from protos.tier import Tier

    now = [100.0]  # the pins' clock
    cluster = Cluster(clock=lambda: 100.0)
    model = ModelInfo("m", 16, num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16")
    block = 2 * 2 * 16 * 2 * 128 * 2
    prompt = hash_prefix("m", range(12 * 16), 16)
    chain = [prompt[i : i + 16] for i in range(0, len(prompt), 16)]
    held = b"".join(chain[:10])
    parents = ROOT_PARENT_HASH + b"".join(chain[:9])
    for agent_id, role, tier in (
        ("p", "prefill", Tier.CPU),
        ("cpu", "decode", Tier.CPU),
        ("disk", "decode", Tier.DISK),
    ):
        cluster.register(AgentRecord(agent_id, f"{agent_id}:1", [model], []))
        cluster.hello(agent_id, "s")
        groups = [] if agent_id == "p" else [BlockGroup("m", tier, held, parents)]
        cluster.apply_inventory_chunk(agent_id, 0, 0, True, groups)
        cluster.attach_outbox(agent_id, "s", queue.Queue())
        cluster.dataplane.register(agent_id, role)
        # 16 blocks, 10 held: 6 free pages (its pinned or disk blocks are not reclaimable)
        view = DataPlaneView(6 * block, 16 * block, 0, 8, handoff_tier=int(Tier.CPU))
        cluster.dataplane.update(agent_id, view)
    manager = Manager(cluster, durable=None, election=None, clock=lambda: now[0])
    manager.pins["sys"] = Pin("sys", "ns", "m", held, Tier.CPU, 0.0, now[0] + 60, agent_id="cpu")

    def decode(pinned=manager.pinned_blocks):
        d = route_request(cluster, "m", block_hashes=prompt, role="decode", prefill_agent_id="p", pinned=pinned)
        return {c.agent_id: c for c in d.candidates}, d

    scores, decision = decode()
    assert not scores["cpu"].behind and not scores["disk"].behind, (scores["cpu"].note, scores["disk"].note)
    assert decision.decode_agent_id in ("cpu", "disk") and not decision.backpressure
    # unpinned blocks of the handoff tier are in its free bytes: a handoff keeps them
    scores, _ = decode(pinned=None)
    assert scores["cpu"].behind and "besides the prefix" in scores["cpu"].note
    assert not scores["disk"].behind
    # the pin ends: counted again
    now[0] += 61
    scores, _ = decode()
    assert scores["cpu"].behind
    assert manager.pinned_blocks("cpu", chain) == set()
    now[0] -= 61
    assert manager.pinned_blocks("cpu", chain) == set(chain[:10])
    assert manager.pinned_blocks("disk", chain) == set()  # the pin is the other agent's
    # Route answers from memory: it never waits for the manager's lock, which Pin and
    # Unpin hold across etcd writes (a review)
    import threading
    import time

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with manager._lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    try:
        t0 = time.monotonic()
        assert manager.pinned_blocks("cpu", chain) == set(chain[:10])
        assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        holder.join()
