"""The wire contract: generated code matches the .proto files, and hashes agree across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protos import generate

ROOT = Path(generate.__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    generate.generate(tmp_path)
    fresh = sorted((tmp_path / "protos" / "kvcp" / "v1").glob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / "protos" / "kvcp" / "v1" / path.name
        assert committed.exists(), f"{committed.name} missing: run `make protos`"
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale: run `make protos`"


def test_hashes_agree_across_processes():
    code = "from protos.block_hash import hash_prefix; print(hash_prefix('m', list(range(64)), 16, ('lora-a',)).hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        for _ in range(2)
    }
    from protos.block_hash import hash_prefix

    assert outs == {hash_prefix("m", list(range(64)), 16, ("lora-a",)).hex() + "\n"}
