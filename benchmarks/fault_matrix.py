#!/usr/bin/env python3
"""The fault matrix's loop stalls: how long the scheduler's event loop went
without running a callback in each cell of ``tests/test_fault_matrix.py``
(every way in x every executor kind x every fault). The test asserts a
generous 1 s; the goal, measured here, is under 100 ms. One command:

    python benchmarks/fault_matrix.py [--goal-ms 100] [--out PATH]

It runs the matrix with pytest (the cells are the test's own), collects the
stall each cell recorded, prints one row per executor and fault with the
worst stall over the ways in, and saves every cell to
``benchmarks/results/fault_matrix.json``. Exit status 1 if a cell failed or
a stall passed the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--goal-ms", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fault_matrix.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "stalls.jsonl"
        env = {**os.environ, "FAULT_MATRIX_STALLS": str(record)}
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/test_fault_matrix.py"],
            cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        seconds = time.monotonic() - started
        cells = (
            [json.loads(line) for line in record.read_text().splitlines()]
            if record.exists()
            else []
        )
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for cell in cells:
        key = (cell["executor"], cell["fault"])
        worst[key] = max(worst[key], cell["stall_ms"])
    print(f"\n{'executor':<14} {'fault':<22} {'worst stall ms':>15}")
    for (executor, fault), stall in sorted(worst.items()):
        flag = "  over the goal" if stall > args.goal_ms else ""
        print(f"{executor:<14} {fault:<22} {stall:>15.1f}{flag}")
    over = [c for c in cells if c["stall_ms"] > args.goal_ms]
    longest = max((c["stall_ms"] for c in cells), default=0.0)
    print(f"\n{len(cells)} cells, longest stall {longest:.1f} ms, {len(over)} over {args.goal_ms:g} ms; "
          f"pytest exit {run.returncode}, {seconds:.0f} s")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True, check=False).stdout.strip(),
        "goal_ms": args.goal_ms, "pytest_exit": run.returncode, "cells": cells,
    }, indent=1) + "\n")  # fmt: skip
    return 1 if run.returncode or over else 0


if __name__ == "__main__":
    sys.exit(main())
