#!/usr/bin/env python3
"""The server's own cost per request at c=1: a real server on loopback, a model
that costs nothing (x + 1 on 64 int64s), one msgpack request at a time over
one keep-alive connection. Compares source trees (e.g. two git worktrees)
alternating, for before/after checks of a refactor:

    git worktree add /tmp/before <commit>
    python benchmarks/noop_roundtrip.py /tmp/before .      # ~2 minutes

Prints the median p50 (and p99) per tree and isolation over --rounds rounds.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tensorserve_bench.protocols import CONTENT_TYPES, msgpack_body
from tensorserve_bench.repositories import write_model
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import percentiles_ms

CONFIG = """max_batch_size = 32
device = "cpu"
[warmup]
enabled = false
[[input]]
name = "x"
dtype = "int64"
shape = [-1]
[[output]]
name = "y"
dtype = "int64"
shape = [-1]
"""
MODEL = "import torch\n\n\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x + 1\n"


def measure(
    tree: Path, repository: Path, isolation: str, requests: int, log: Path
) -> tuple[float, float]:
    server = ServerProcess(str(repository), ["--isolation", isolation], ready_timeout=60,
                           env={"PYTHONPATH": str(tree)}, cwd=tree, log=log).start()
    try:
        body = msgpack_body([{"x": np.arange(64, dtype=np.int64)}], {"x": "int64"})
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        latencies = []
        for i in range(requests + 300):  # the first 300 warm up
            started = time.perf_counter()
            conn.request("POST", "/v2/models/noop/infer", body=body,
                         headers={"Content-Type": CONTENT_TYPES["msgpack"]})
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(data)
            if i >= 300:
                latencies.append(time.perf_counter() - started)
        summary = percentiles_ms(latencies, (50, 99))
        return summary["p50"], summary["p99"]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp, "repository")
        write_model(repository, "noop", CONFIG, MODEL)
        p50s: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for tree in args.trees:
                for isolation in ("thread", "process"):
                    p50, p99 = measure(tree.resolve(), repository, isolation, args.requests,
                                       Path(tmp, "server.log"))
                    p50s.setdefault((str(tree), isolation), []).append(p50)
                    print(f"round {round_ + 1}  {tree!s:24} {isolation:8} p50 {p50:.3f} ms  p99 {p99:.3f} ms",
                          flush=True)
    print("\n| tree | isolation | p50 ms per round | median |\n| --- | --- | --- | --- |")
    for (tree, isolation), values in p50s.items():
        print(f"| {tree} | {isolation} | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
