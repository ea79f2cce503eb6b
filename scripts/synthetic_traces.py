"""Write Mooncake-format traces of three shapes the shipped traces lack, to check that the
tier policy is not fitted to those (README, "Against the targets"):

- `zipf_docs.jsonl`: RAG-style requests, one of 5 system prompts + one of 3,000 documents
  drawn by a Zipf law (a = 1.1) whose ranking drifts every 2,000 requests + a new question;
- `sessions.jsonl`: multi-turn chats, ~200 live at once, each turn the last prompt grown
  by 1-2 blocks, chats ending at random (8 % a turn) or past 120 blocks;
- `scan_mix.jsonl`: half hot prompts (300, Zipf a = 1.3), half one-off long prompts of
  20-80 blocks that pass through the cache once (a scan, which LRU keeps).

    .venv/bin/python scripts/synthetic_traces.py --out /tmp/traces
    .venv/bin/kvcp-bench replay /tmp/traces/zipf_docs.jsonl --capacity-fraction 1/16 --capacity-fraction 1/64

Seeded: the same files every run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512


class _Ids:
    """Fresh block ids, each shape in its own range."""

    def __init__(self, first: int):
        self._next = itertools.count(first)

    def new(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _request(t_ms: int, hash_ids: list[int], output_tokens: int, short_tokens: int = 0) -> dict:
    return {
        "timestamp": t_ms,
        "input_length": BLOCK_TOKENS * len(hash_ids) - short_tokens,
        "output_length": output_tokens,
        "hash_ids": hash_ids,
    }


def zipf_docs(num_requests: int = 12000, num_docs: int = 3000, a: float = 1.1, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = _Ids(10_000_000)
    system = [ids.new(int(rng.integers(2, 8))) for _ in range(5)]
    docs = [ids.new(int(rng.integers(4, 40))) for _ in range(num_docs)]
    ranking = rng.permutation(num_docs)
    weights = 1.0 / np.arange(1, num_docs + 1) ** a
    weights /= weights.sum()
    out, t_ms = [], 0
    for i in range(num_requests):
        t_ms += int(rng.exponential(300))
        if i % 2000 == 0:  # popularity drifts
            ranking = np.roll(ranking, int(rng.integers(50, 400)))
        doc = docs[ranking[rng.choice(num_docs, p=weights)]]
        blocks = system[int(rng.integers(0, len(system)))] + doc + ids.new(int(rng.integers(1, 3)))
        out.append(_request(t_ms, blocks, int(rng.integers(10, 500)), int(rng.integers(0, BLOCK_TOKENS - 1))))
    return out


def sessions(num_requests: int = 12000, live: int = 200, seed: int = 2) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = _Ids(20_000_000)
    system = [ids.new(int(rng.integers(4, 12))) for _ in range(3)]
    active: list[list[int]] = []
    out, t_ms = [], 0
    for _ in range(num_requests):
        t_ms += int(rng.exponential(200))
        if len(active) < live or rng.random() < 0.15:
            active.append(list(system[int(rng.integers(0, len(system)))]) + ids.new(int(rng.integers(1, 6))))
        k = int(rng.integers(0, len(active)))
        chat = active[k]
        out.append(_request(t_ms, list(chat), 300, 100))
        chat += ids.new(int(rng.integers(1, 3)))  # the answer and the next question
        if len(chat) > 120 or rng.random() < 0.08:
            active.pop(k)
    return out


def scan_mix(num_requests: int = 12000, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    ids = _Ids(30_000_000)
    hot = [ids.new(int(rng.integers(5, 30))) for _ in range(300)]
    out = []
    for i in range(num_requests):
        if rng.random() < 0.5:
            blocks = hot[int(rng.zipf(1.3) - 1) % len(hot)] + ids.new(1)
        else:
            blocks = ids.new(int(rng.integers(20, 80)))
        out.append(_request(100 * (i + 1), blocks, 100))
    return out


SHAPES = {"zipf_docs": zipf_docs, "sessions": sessions, "scan_mix": scan_mix}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the traces into")
    parser.add_argument("--requests", type=int, default=12000, help="requests in each trace (default 12000)")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, not {args.requests}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in SHAPES.items():
        path = args.out / f"{name}.jsonl"
        with path.open("w") as f:
            for request in make(num_requests=args.requests):
                f.write(json.dumps(request) + "\n")
        print(path)


if __name__ == "__main__":
    main()
