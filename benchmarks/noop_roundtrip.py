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
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v2/health/ready")
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server not ready")


def measure(tree: Path, repository: Path, isolation: str, requests: int) -> tuple[float, float]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "tensorserve", "serve", "--model-repository", str(repository),
               "--host", "127.0.0.1", "--port", str(port), "--isolation", isolation,
               "--log-level", "WARNING"]
    server = subprocess.Popen(command, env=env, cwd=tree, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port)
        x = np.arange(64, dtype=np.int64)
        body = msgpack.packb({"items": [{"x": {"dtype": "int64", "shape": [64], "data": x.tobytes()}}]})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        latencies = []
        for i in range(requests + 300):  # the first 300 warm up
            started = time.perf_counter()
            conn.request("POST", "/v2/models/noop/infer", body=body,
                         headers={"Content-Type": "application/msgpack"})
            response = conn.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(data)
            if i >= 300:
                latencies.append(time.perf_counter() - started)
        return statistics.median(latencies) * 1e3, statistics.quantiles(latencies, n=100)[98] * 1e3
    finally:
        server.terminate()
        server.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="source trees to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp)
        (repository / "noop" / "1").mkdir(parents=True)
        (repository / "noop" / "config.toml").write_text(CONFIG)
        (repository / "noop" / "1" / "model.py").write_text(MODEL)
        p50s: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for tree in args.trees:
                for isolation in ("thread", "process"):
                    p50, p99 = measure(tree.resolve(), repository, isolation, args.requests)
                    p50s.setdefault((str(tree), isolation), []).append(p50)
                    print(f"round {round_ + 1}  {tree!s:24} {isolation:8} p50 {p50:.3f} ms  p99 {p99:.3f} ms",
                          flush=True)
    print("\n| tree | isolation | p50 ms per round | median |\n| --- | --- | --- | --- |")
    for (tree, isolation), values in p50s.items():
        print(f"| {tree} | {isolation} | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
