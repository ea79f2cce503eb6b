"""Store a prompt's KV on one agent, as an inference engine would (its EngineService), and
write the prompt's token ids to a file for `kvctl --tokens-file`: the README's route
example on `make demo` ("a 160-block prompt on agent-1 only").

    .venv/bin/python scripts/store_prompt.py --agent 127.0.0.1:50061 --tokens 2560 --out long-prompt.txt

The model's shape comes from the control plane's stats; every element of a block holds
the demo workload's value for it (benchmarks.workload.block_fill), so the workload's own
checks of what it loads hold for these blocks too.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from agent.client import EngineClient
from benchmarks.workload import block_fill
from cli.client import ClientError, ControlPlaneClient
from protos.block_hash import hash_prefix, split_hashes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agent", required=True, help="the agent's gRPC address (HOST:PORT)")
    ap.add_argument("--controlplane", default="127.0.0.1:50051", help="where to read the model's shape")
    ap.add_argument("--model", default="demo-model")
    ap.add_argument("--tokens", type=int, default=2560, help="prompt length in tokens")
    ap.add_argument("--seed", type=int, default=4242, help="the prompt's random token ids come from this seed")
    ap.add_argument("--namespace", default="")
    ap.add_argument("--out", required=True, help="file to write the token ids to (comma separated)")
    args = ap.parse_args(argv)
    if args.tokens <= 0:
        ap.error("--tokens must be positive")
    try:
        models = {m["model_id"]: m for m in ControlPlaneClient(args.controlplane).stats().models}
    except ClientError as exc:
        print(f"store_prompt: the control plane at {args.controlplane}: {exc}", file=sys.stderr)
        return 1
    m = models.get(args.model)
    if m is None:
        print(f"store_prompt: --model: unknown model {args.model!r} (known: {', '.join(models)})", file=sys.stderr)
        return 1
    tokens = np.random.default_rng(args.seed).integers(0, 32000, args.tokens).tolist()
    hashes = split_hashes(hash_prefix(args.model, tokens, m["block_size"]))
    elems = m["num_layers"] * 2 * m["block_size"] * m["num_kv_heads"] * m["head_dim"]
    kv = np.empty((len(hashes), elems), dtype=np.dtype(m["dtype"]))
    for i, h in enumerate(hashes):
        kv[i] = block_fill(h)
    stored = EngineClient(args.agent).store(args.model, tokens, kv.tobytes(), namespace=args.namespace)
    with open(args.out, "w") as f:
        f.write(",".join(map(str, tokens)))
    print(f"stored {stored.num_stored_blocks} of {len(hashes)} blocks on {args.agent}; token ids in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
