"""`kvctl route`'s first line names the split decision once: the control plane's reason
may already start with it ("not split: ..."), and then it is not said twice."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli import main as cli_main
from cli.client import RouteCandidateView, RouteView


def view(disaggregate: bool, reason: str) -> RouteView:
    return RouteView(
        "pair", "a1", "127.0.0.1:1", "a1", "a2" if disaggregate else "a1", disaggregate, 96, 0.0, 0.0, reason, False, []
    )


class FakeClient:
    def __init__(self, answer: RouteView):
        self.answer = answer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def route(self, *args, **kwargs):
        return self.answer


@pytest.mark.parametrize(
    ("answer", "first_line"),
    [
        (
            view(False, "not split: the handoff to a2 (0.05 ms) costs more than the 0.00 ms of interference it saves"),
            "prefill a1, decode a1: not split: the handoff to a2 (0.05 ms) costs more than the 0.00 ms of interference"
            " it saves",
        ),
        (
            view(True, "split: prefill on a1, decode on a2 (idle)"),
            "prefill a1, decode a2: split: prefill on a1, decode on a2 (idle)",
        ),
        (
            view(False, "no other decode agent: prefill and decode on a1"),
            "prefill a1, decode a1 (not split): no other decode agent: prefill and decode on a1",
        ),
    ],
)
def test_route_says_split_or_not_once(monkeypatch, answer, first_line):
    monkeypatch.setattr(cli_main.Context, "client", lambda self: FakeClient(answer))
    result = CliRunner().invoke(cli_main.main, ["route", "--model", "m", "--tokens", "1,2,3"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == first_line


@pytest.mark.parametrize(
    "given, said",
    [
        ("0123456789abcdef0123456789abcde", "is 31 hex digits; block hashes are 16 bytes (32 hex digits) each"),
        ("abc", "is 3 hex digits"),
        ("abcd", "is 4 hex digits"),
        ("0123456789abcdef0123456789abcdeg", "is not hexadecimal"),
    ],
)
def test_hashes_of_the_wrong_length_say_so(given, said, capsys):
    """An odd count of hex digits was called 'not hexadecimal' (a review)."""
    from cli.main import parse_hashes

    with pytest.raises(SystemExit) as exit_info:
        parse_hashes((given,))
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_hashes_packed_or_separated_parse():
    from cli.main import parse_hashes

    one = "0123456789abcdef0123456789ABCDEF"
    assert parse_hashes((one + one.lower(), f"{one},{one}")) == bytes.fromhex(one) * 4


def test_route_table_shows_each_note_whole(monkeypatch):
    """The NOTE column was cut at 60 characters: a decode agent's 'behind' reason lost the
    end of its byte count ('< 1310720 B needed' read '< 13'), a link's note its count of
    transfers on it. It is the last column, so a long note misaligns nothing."""
    behind = "decode: free 33554432 B besides the prefix's own blocks < 1310720 B needed"
    link = "decode: 1310720 B over a 0.34 GB/s link (measured) + 4.0 ms a transfer, 0 on it"
    answer = RouteView(
        "pair", "a1", "127.0.0.1:1", "a1", "a2", True, 0, 0.0, 0.0, "split: prefill on a1, decode on a2", False,
        [
            RouteCandidateView("a2", 0.0079, 0, 0.0, 1 << 25, 0.34e9, 0.0079, False, link),
            RouteCandidateView("a3", 0.0079, 0, 0.0, 1 << 25, 0.34e9, 0.0079, True, behind),
        ],
    )  # fmt: skip
    monkeypatch.setattr(cli_main.Context, "client", lambda self: FakeClient(answer))
    result = CliRunner().invoke(cli_main.main, ["route", "--model", "m", "--tokens", "1,2,3"])
    assert result.exit_code == 0, result.output
    rows = result.output.splitlines()[2:]
    assert rows[0].endswith("  " + link) and rows[1].endswith("  " + behind), result.output
