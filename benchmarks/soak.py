#!/usr/bin/env python3
"""Fault soak: 16 steady callers of good items against a real server, with
and without one bad request per second mixed in — a poisoned item, an item
whose padded batch runs out of memory, one too large to fit even alone, a
deadline that cannot be met, a caller that leaves, and (process isolation)
an item that kills its worker. One command, about two minutes:

    python benchmarks/soak.py [--seconds 20] [--out benchmarks/results/soak.json]

``--cost flat`` serves a GPU-like model instead (a flat 100 ms per forward
whatever the batch size), where running a crashed batch's items again one at
a time would cost a whole forward per item:

    python benchmarks/soak.py --cost flat --isolation process --kinds worker_kill

For each isolation (thread, process) it runs the same load twice, without
and with the bad traffic, and prints per run:

    good sent / correct / failed (by status) / lost / hung, good items per second
    bad sent, by kind, and the statuses they got

``correct`` is checked (y = 2x, every row its caller's own); ``lost`` is a
connection that broke or a request with no response; ``hung`` is no answer
within HUNG_AFTER_S. The goals (docs/reliability.md): 0 lost, 0 hung, 0 good
items failed, and good throughput with the bad traffic at least 80% of the
same run without it. The scenario is ``tensorserve_bench.soak``; the test
suite runs a short one (tests/bench/test_soak.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tensorserve_bench import soak
from tensorserve_bench.results import save


def _print(results: list[dict[str, Any]]) -> None:
    print(f"{'isolation':<9} {'cost':<4} {'bad':<4} {'sent':>6} {'correct':>7} {'failed':>6} {'lost':>4} "
          f"{'hung':>4} {'good/s':>7}  bad requests (kind: statuses)")
    for result in results:
        for label, run_ in (("no", result["without_bad"]), ("yes", result["with_bad"])):
            failed = sum(run_["good_failed"].values())
            bad = "; ".join(f"{k}: {dict(v)}" for k, v in run_["bad"].items()) or "-"
            print(f"{result['isolation']:<9} {result['cost']:<4} {label:<4} {run_['good_sent']:>6} "
                  f"{run_['good_correct']:>7} {failed:>6} {run_['lost']:>4} {run_['hung']:>4} "
                  f"{run_['good_per_s']:>7.1f}  {bad}")
        print(f"{'':<14} good throughput with bad traffic: {100 * result['ratio']:.0f}% of without; "
              f"ready afterwards: {result['ready_after']}; peak RSS {result['peak_rss_mb']:.0f} MB; "
              f"recoveries {result['recoveries']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument("--isolation", choices=["thread", "process", "both"], default="both")
    parser.add_argument("--kinds", nargs="+", choices=soak.BAD_KINDS_PROCESS,
                        help="only these kinds of bad request (default: all that apply)")
    parser.add_argument("--cost", choices=sorted(soak.COSTS), default="cpu",
                        help="what a forward costs: cpu (per row) or flat (100 ms per batch)")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    modes = ["thread", "process"] if args.isolation == "both" else [args.isolation]
    results = [soak.run(mode, args.seconds, args.kinds, cost=args.cost) for mode in modes]
    _print(results)
    save(args.out, {"callers": soak.CALLERS, "seconds": args.seconds, "kinds": args.kinds or "all",
                    "cost": args.cost,
                    "results": results})
    return 1 if any(soak.failures(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
