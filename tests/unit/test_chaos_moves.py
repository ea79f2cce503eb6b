"""kvcp-bench chaos's tier moves: a move the control plane accepted though its start was
answered with an error (the leader killed or stopped after it took it: the start times
out and is retried, or counted refused) is found in the operations list and followed
like the others, so `ops_unfinished` covers it too. Drains the same: a drain taken
though its start was answered with an error is followed, an older one of that agent is not."""

from __future__ import annotations

from benchmarks.chaos import MOVED_NAMESPACE, ChaosConfig, Drains, Moves
from cli.client import OperationView


def view(
    op_id: str,
    state: str = "RUNNING",
    kind: str = "move",
    namespace: str = MOVED_NAMESPACE,
    created: float = 0.0,
    params: dict[str, str] | None = None,
) -> OperationView:
    params = {"namespace": namespace, "to": "disk"} if params is None else params
    return OperationView(op_id, kind, state, 0.0, 3, 3, 0, 0, 0, [], "", created, 0.0, params, [], False)


class FakeFacade:
    def __init__(self, listed: list[OperationView]):
        self.listed = listed

    def call(self, fn, deadline_seconds: float = 10.0):
        return fn(self)

    def list_operations(self, max_operations: int = 100) -> list[OperationView]:
        return self.listed


def test_a_move_accepted_without_an_answer_is_found_and_followed():
    moves = Moves(ChaosConfig(), [], None, "", [])
    waits: dict[str, float] = {}
    listed = [
        view("lost-answer"),  # accepted: the start's answer was lost with the leader
        view("ended-meanwhile", state="SUCCEEDED"),
        view("other-namespace", namespace="elsewhere"),
        view("a-cleanup", kind="cleanup"),
    ]
    assert moves._find_unanswered(FakeFacade(listed), waits)
    assert set(waits) == {"lost-answer"}
    assert moves.stats.started == 2 and moves.stats.found_unanswered == 2 and moves.stats.succeeded == 1
    # each is counted once, however often the list is read
    assert moves._find_unanswered(FakeFacade(listed), waits)
    assert moves.stats.started == 2


def test_a_drain_accepted_without_an_answer_is_found_and_an_older_one_is_not():
    drains = Drains(ChaosConfig(), [], None, {}, {}, lambda n, salt: [])
    listed = [
        view("older", kind="drain", created=100.0, params={"agent": "agent-1"}),  # followed before
        view("of-another", kind="drain", created=205.0, params={"agent": "agent-2"}),
        view("a-move", created=205.0),
        view("lost-answer", kind="drain", created=206.0, params={"agent": "agent-1"}),
    ]
    found = drains._find_unanswered(FakeFacade(listed), "agent-1", asked=200.0)
    assert found is not None and found.op_id == "lost-answer"
    assert drains.stats.found_unanswered == 1
    assert drains._find_unanswered(FakeFacade(listed[:3]), "agent-1", asked=200.0) is None
