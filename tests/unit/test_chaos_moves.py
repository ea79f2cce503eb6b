"""kvcp-bench chaos's tier moves: a move the control plane accepted though its start was
answered with an error (the leader killed or stopped after it took it: the start times
out and is retried, or counted refused) is found in the operations list and followed
like the others, so `ops_unfinished` covers it too."""

from __future__ import annotations

from benchmarks.chaos import MOVED_NAMESPACE, ChaosConfig, Moves
from cli.client import OperationView


def view(op_id: str, state: str = "RUNNING", kind: str = "move", namespace: str = MOVED_NAMESPACE) -> OperationView:
    return OperationView(
        op_id, kind, state, 0.0, 3, 3, 0, 0, 0, [], "", 0.0, 0.0, {"namespace": namespace, "to": "disk"}, [], False
    )


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
