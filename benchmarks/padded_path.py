#!/usr/bin/env python3
"""The padded path's own CPU cost, tree against tree: the pure steps a padded
batch goes through on the scheduler's loop (the policy choosing it, padding,
un-padding), timed in-process with the clock's best of many runs, which a
busy machine disturbs far less than a served benchmark. Each tree (a
checkout, e.g. ``git archive <commit> | tar -x -C /tmp/base``) runs in a
process of its own, with PYTHONPATH set to it, by turns:

    python benchmarks/padded_path.py --tree /tmp/base .    # ~1 minute

Steps (the tagger's inputs, one-item requests, lengths uniform 8..128):
select the next batch of 32 from 64 waiting (length-aware, a budget of 1024
tokens; FIFO, the same), pad 32 items, un-pad their logits. Prints microseconds
per call (best of ``--repeats`` rounds of ``--number`` calls) and saves
``benchmarks/results/padded_path.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "padded_path.json"

# Runs inside each tree: prints {step: best microseconds per call}.
PROBE = r"""
import json, sys, timeit
import numpy as np
from tensorserve.batching.collate import Collator
from tensorserve.batching.policy import Waiting, make_policy
from tensorserve.repository.config import parse_config

number, repeats = int(sys.argv[1]), int(sys.argv[2])
config = parse_config({
    "input": [{"name": "input_ids", "dtype": "int64", "shape": [-1], "max_length": 512},
              {"name": "attention_mask", "dtype": "int64", "shape": [-1], "max_length": 512}],
    "output": [{"name": "logits", "dtype": "float32", "shape": [-1, 9],
                "unpad_like": "input_ids"}],
}, "tagger")
rng = np.random.default_rng(0)
items = [{"input_ids": rng.integers(1, 4096, n), "attention_mask": np.ones(n, np.int64)}
         for n in rng.integers(8, 129, 32)]
collator = Collator(config)
batch = collator.pad(items)
logits = {"logits": np.zeros((32, batch.longest, 9), np.float32)}
waiting = Waiting([int(n) for n in rng.integers(8, 129, 64)])
length_aware, fifo = make_policy("length_aware", 1024), make_policy("fifo", 1024)
steps = {
    "select length_aware (64 waiting)": lambda: length_aware.select(waiting, 32),
    "select fifo (64 waiting)": lambda: fifo.select(waiting, 32),
    "pad 32 items": lambda: collator.pad(items),
    "unpad 32 rows": lambda: collator.unpad(logits, batch),
}
best = {name: min(timeit.repeat(step, number=number, repeat=repeats)) / number * 1e6
        for name, step in steps.items()}
print(json.dumps(best))
"""


def probe(tree: Path, number: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(number), str(repeats)],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    best: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, nargs="+", default=[ROOT])
    parser.add_argument("--rounds", type=int, default=3, help="turns of every tree")
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    best: dict[str, dict[str, float]] = {str(tree): {} for tree in args.tree}
    for _ in range(args.rounds):
        for tree in args.tree:
            for step, us in probe(tree, args.number, args.repeats).items():
                mine = best[str(tree)]
                mine[step] = min(us, mine.get(step, us))
    steps = list(next(iter(best.values())))
    print(f"{'step (us a call, best)':34}" + "".join(f"{t!s:>22}" for t in args.tree))
    for step in steps:
        print(f"{step:34}" + "".join(f"{best[str(t)][step]:22.2f}" for t in args.tree))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    result = {
        "command": "python benchmarks/padded_path.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{os.cpu_count()} CPUs",
        "load_average": os.getloadavg()[0],
        "best_us": best,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
