"""kvcp-bench's options and traces: bad input is one line naming it and a non-zero exit,
never a traceback or a figure measured on something else (a review, 2026-12-06)."""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner

from benchmarks.main import main

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'


def _corrupt_deflate() -> bytes:
    data = bytearray(gzip.compress(GOOD.encode() * 50, mtime=0))
    data[30:50] = b"\xff" * 20  # inside the compressed stream
    return bytes(data)


@pytest.mark.parametrize(
    "args, said",
    [
        (["handoff", "--sizes", ","], "--sizes"),  # a traceback, and the etcd it started left running
        (["handoff", "--sizes", "0"], "--sizes"),  # measured 1 MiB instead
        (["handoff", "--sizes", "-4"], "--sizes"),
        (["handoff", "--simulate", "--rate", "0"], "--rate"),  # ZeroDivisionError
        (["handoff", "--simulate", "--rate", "nan"], "--rate"),  # meaningless figures, exit 0
        (["tiers", "--repeats", "0"], "--repeats"),
        (["tiers", "--block-mib", "0"], "--block-mib"),
        (["tiers", "--blocks", "-2"], "--blocks"),  # quietly 4
        (["controlplane", "--lookup-rate", "0"], "--lookup-rate"),  # a child's traceback, then a hang
        (["workload", "--rate", "nan"], "--rate"),
        (["workload", "--duration", "nan"], "--duration"),
    ],
)
def test_an_option_out_of_range_is_refused_by_name(args, said):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize(
    "content, said",
    [
        (b'{"timestamp": 0, "input_length": 1e400, "hash_ids": [1]}\n', "input_length must be an integer"),
        (b'{"timestamp": 0, "input_length": 10, "hash_ids": "123"}\n', "hash_ids must be a list"),
        (b'{"timestamp": 0, "input_length": 10, "hash_ids": [1.7]}\n', "hash_ids must be an integer"),
        (b'{"timestamp": 0, "input_length": true, "hash_ids": [1]}\n', "input_length must be an integer"),
        (b"[1, 2]\n", "not a JSON object"),
        (gzip.compress(GOOD.encode(), mtime=0)[:-12], "cannot be read as gzip"),  # a truncated gzip
        (gzip.compress(GOOD.encode() * 50, mtime=0)[:20] + b"\xff" * 40, "cannot be read as gzip"),  # a corrupt one
        (_corrupt_deflate(), "cannot be read as gzip"),  # zlib.error, not an OSError
    ],
)
def test_a_bad_trace_line_or_file_is_named(tmp_path, content, said):
    trace = tmp_path / "trace.jsonl.gz"
    trace.write_bytes(content)
    result = CliRunner().invoke(main, ["replay", str(trace), "--capacity-blocks", "2"])
    assert result.exit_code != 0 and said in result.output and "Traceback" not in result.output, result.output


def test_a_gzipped_trace_is_read_whatever_its_name_and_a_request_of_no_block_hits_nothing(tmp_path):
    """A gzipped trace without .gz failed with a bare codec error; a request with no
    hash_ids counted as a full hit on an empty cache (all of its no blocks hit)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(gzip.compress((GOOD * 3 + '{"timestamp": 1, "input_length": 100, "hash_ids": []}\n').encode()))
    result = CliRunner().invoke(main, ["replay", str(trace), "--capacity-blocks", "2", "-o", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    row = data[0] if isinstance(data, list) else data
    # 3 requests of 1024 tokens and one of 100 that has no block: the last two of the first
    # three hit all 1024, the first and the blockless one nothing
    assert row["infinite_hit_ratio"] == pytest.approx(2048 / (3 * 1024 + 100), abs=1e-4)
