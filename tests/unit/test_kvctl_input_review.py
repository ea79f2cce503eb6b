"""kvctl's answers to bad input found by an operator's review: each names the option the
user typed (not an internal request field), exits non-zero and sends nothing it should not.
Run through click as a user would, against a fake client (no cluster)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli import main as cli_main
from cli.client import ClientError


class FakeClient:
    """Records what kvctl asked; `fail` is the ClientError each call raises (else it answers)."""

    def __init__(self, fail: ClientError | None = None):
        self.fail = fail
        self.calls: list[tuple[str, tuple, dict]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _call(self, name, *args, **kw):
        self.calls.append((name, args, kw))
        if self.fail is not None:
            raise self.fail
        return {}

    def cordon(self, agent_id, reason):
        return self._call("cordon", agent_id, reason) or reason


@pytest.fixture
def fake(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(cli_main.Context, "client", lambda self: client)
    return client


def kvctl(*args: str):
    return CliRunner().invoke(cli_main.main, list(args))


def test_cordon_reason_the_control_plane_refuses_is_said_as_reason(fake):
    """The control plane checks a cordon's reason as the policy value `cordon.<agent>`, and
    its error starts `values[cordon.a1]: ...`; kvctl cordon passes a mapping of that field
    to --reason, but the `values[...]` branch answered first and the user read of a policy
    key `cordon.a1` they never typed."""
    fake.fail = ClientError(
        "INVALID_ARGUMENT", "values[cordon.a1]: the reason must be one printable line of at most 200 characters"
    )
    out = kvctl("cordon", "a1", "--reason", "x" * 300)
    assert out.exit_code == 1, out.output
    assert "kvctl: --reason (cordon.a1): the reason must be one printable line" in out.output, out.output


def test_a_policy_key_error_still_names_the_key():
    assert (
        cli_main.flag_named("values[cpu.high_watermark]: must be a fraction in (0, 1], got 1.5")
        == "cpu.high_watermark: must be a fraction in (0, 1], got 1.5"
    )


def test_policy_set_refuses_a_key_given_twice_with_two_values(fake, monkeypatch):
    """`kvctl policy set cpu.high_watermark=0.8 cpu.high_watermark=0.99` set 0.99 and said
    nothing: the later value silently won over the one the user may have meant."""
    asked = []
    monkeypatch.setattr(FakeClient, "set_policy", lambda self, changes: asked.append(changes) or changes, raising=False)
    out = kvctl("policy", "set", "cpu.high_watermark=0.8", "cpu.high_watermark=0.99")
    assert out.exit_code == 2, out.output
    assert "cpu.high_watermark: given twice" in out.output and "'0.8'" in out.output and "'0.99'" in out.output
    assert asked == []
    out = kvctl("policy", "set", "quota.kb=1GiB", " quota.kb = 1GiB")  # the same value twice: one change
    assert out.exit_code == 0, out.output
    assert asked == [{"quota.kb": "1GiB"}]


def test_tokens_file_may_be_a_pipe_but_not_a_device(fake, monkeypatch):
    """`--tokens-file <(python make_prompt.py)` (a pipe, /dev/fd/N) was refused as
    "does not exist or is not a file"; a device that never ends (/dev/zero) stays refused,
    as does a directory, each with what it is."""
    import os

    asked = []

    def lookup(self, model_id, token_ids=None, **kw):
        asked.append(token_ids)
        raise ClientError("NOT_FOUND", "stop here")

    monkeypatch.setattr(FakeClient, "lookup", lookup, raising=False)
    r, w = os.pipe()
    try:
        os.write(w, b"1,2,3\n")
        os.close(w)
        out = kvctl("lookup", "--model", "m", "--tokens-file", f"/dev/fd/{r}")
    finally:
        os.close(r)
    assert asked == [[1, 2, 3]], out.output
    out = kvctl("lookup", "--model", "m", "--tokens-file", "/dev/zero")
    assert out.exit_code == 2 and "--tokens-file: /dev/zero is not a file or a pipe" in out.output, out.output
    out = kvctl("lookup", "--model", "m", "--tokens-file", "/")
    assert out.exit_code == 2 and "--tokens-file: / is a directory" in out.output, out.output
    out = kvctl("lookup", "--model", "m", "--tokens-file", "/nonexistent/prompt.txt")
    assert out.exit_code == 2 and "--tokens-file: /nonexistent/prompt.txt does not exist" in out.output, out.output
    assert len(asked) == 1


@pytest.mark.parametrize("field", ["extra_keys", "scope.extra_keys"])
def test_extra_keys_the_control_plane_refuses_are_said_as_extra_key(field):
    """Every other request field kvctl sets is said with its flag; too many --extra-key
    bytes came back as `kvctl: scope.extra_keys: ...` (lookup: `extra_keys`)."""
    said = cli_main.flag_named(f"{field}: extra keys take at most 4096 bytes as hashed")
    assert said == f"--extra-key ({field}): extra keys take at most 4096 bytes as hashed"


@pytest.mark.parametrize("command", [["lookup"], ["route"], ["pin"], ["move", "--to", "disk"]])
def test_extra_key_with_hashes_is_refused_not_ignored(fake, command):
    """--extra-key changes how tokens are hashed; given with --hashes it was dropped without
    a word, and the lookup (or pin, move) named another prefix than the user meant."""
    out = kvctl(*command, "--model", "m", "--hashes", "ab" * 16, "--extra-key", "lora-7")
    assert out.exit_code == 2, out.output
    assert "--extra-key: it is hashed with the tokens" in out.output, out.output
    assert not fake.calls


@pytest.mark.parametrize("command", [["lookup"], ["pin"]])
def test_an_empty_hashes_value_is_said_as_such(fake, command):
    """`--hashes ''` (an unset shell variable) was answered "give the prompt as --tokens,
    --tokens-file or --hashes", as if --hashes had not been given."""
    out = kvctl(*command, "--model", "m", "--hashes", "")
    assert out.exit_code == 2, out.output
    assert "--hashes: no hash given" in out.output, out.output
    assert not fake.calls
