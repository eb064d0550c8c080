"""What a scheduler's per-batch work costs when its loop has just sat idle.

The scheduler process wakes for each batch (a front end's message, a batch
that finished) after an idle gap of a few milliseconds. On a shared VM the
caches and predictors are cold by then, and the same call costs several
times its CPU in a tight loop. This measures it: each step's thread CPU,
called back to back ("hot") and after sleeping ``--gaps`` milliseconds.

    python benchmarks/idle_cost.py [--waiting 24] [--gaps 1 6] [--output f.json]

Steps: one small numpy call (``argmax`` of 16x16), a pure-Python loop of
300 additions, the length-aware policy's choice among ``--waiting`` items,
and padding ``--waiting`` token-id items (two 1-D features) as the flat
model's batches are padded.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tensorserve.batching.collate import pad
from tensorserve.batching.policy import LengthAwarePolicy, Waiting
from tensorserve.repository.config import InputSpec


def steps(waiting: int) -> dict[str, Callable[[], object]]:
    rng = np.random.default_rng(0)
    grid = np.ones((16, 16))
    lengths = [int(n) for n in rng.integers(8, 129, waiting)]
    policy = LengthAwarePolicy()
    policy.cost.coefficients = (5e-3, 1e-9, 1e-7)  # a flat cost with a little per element
    queue = Waiting(lengths)
    inputs = [
        InputSpec(name="input_ids", dtype="int64", shape=[-1]),
        InputSpec(name="attention_mask", dtype="int64", shape=[-1]),
    ]
    items = [{"input_ids": np.arange(n), "attention_mask": np.ones(n, np.int64)} for n in lengths]

    def python_loop() -> int:
        total = 0
        for i in range(300):
            total += i
        return total

    return {
        "numpy argmax 16x16": lambda: np.argmax(grid),
        "python loop of 300": python_loop,
        f"policy choice among {waiting}": lambda: policy.select(queue, 64),
        f"pad {waiting} items (2 features)": lambda: pad(items, inputs),
    }


def thread_cpu_us(step: Callable[[], object], gap_s: float, calls: int) -> float:
    """The median thread CPU of one call, each after sleeping ``gap_s``."""
    spent = []
    for _ in range(calls):
        if gap_s:
            time.sleep(gap_s)
        started = time.thread_time()
        step()
        spent.append(time.thread_time() - started)
    return 1e6 * sorted(spent)[len(spent) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--waiting", type=int, default=24)
    parser.add_argument("--gaps", type=float, nargs="+", default=[1.0, 6.0], help="ms")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    gaps = [0.0, *args.gaps]
    rows = []
    print(
        "| step | " + " | ".join("hot us" if not g else f"after {g:g} ms us" for g in gaps) + " |"
    )
    print("| --- |" + " ---: |" * len(gaps))
    for name, step in steps(args.waiting).items():
        step()  # imports, caches
        costs = [thread_cpu_us(step, gap / 1000, args.calls) for gap in gaps]
        rows.append({"step": name, "us": dict(zip([str(g) for g in gaps], costs))})
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in costs) + " |", flush=True)
    if args.output is not None:
        meta = {"waiting": args.waiting, "gaps_ms": gaps, "date": time.strftime("%F %T")}
        args.output.write_text(json.dumps({"settings": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
