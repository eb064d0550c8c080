#!/usr/bin/env python3
"""The soak: one toy model on a real server, good callers beside every kind
of bad request (tensorserve_bench.soak; the test suite runs a short fault
soak, tests/bench/test_soak.py). Two scenarios:

``--scenario faults`` (the default; about two minutes): 16 steady callers of
good items, with and without one bad request per second mixed in — a
poisoned item, an item whose padded batch runs out of memory, one too large
to fit even alone, a deadline that cannot be met, a caller that leaves, and
(process isolation) an item that kills its worker:

    python benchmarks/soak.py [--seconds 20] [--out benchmarks/results/soak.json]

``--cost flat`` serves a GPU-like model instead (a flat 100 ms per forward
whatever the batch size), where running a crashed batch's items again one at
a time would cost a whole forward per item:

    python benchmarks/soak.py --cost flat --isolation process --kinds worker_kill

For each isolation (thread, process) it runs the same load twice, without
and with the bad traffic, and prints per run: good sent / correct / failed
(by status) / lost / hung, good items per second, and the statuses each kind
of bad request got. The goals (docs/reliability.md): 0 lost, 0 hung, 0 good
items failed, and good throughput with the bad traffic at least 80% of the
same run without it.

``--scenario overload`` (about a minute and a half): a flood past the queue,
deadlines that expire, callers that leave, oversized, malformed and trickled
bodies, and a SIGTERM in the middle of a flood; a table of what every client
saw, and the peak RSS of the server and its worker processes:

    python benchmarks/soak.py --scenario overload [--out benchmarks/results/soak_overload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorserve_bench.results import save
from tensorserve_bench.soak import faults, overload
from tensorserve_bench.soak.model import COSTS
from tensorserve_bench.soak.requests import FAULT_KINDS

DEFAULT_OUT = {
    "faults": "benchmarks/results/soak.json",
    "overload": "benchmarks/results/soak_overload.json",
}


def _print_faults(results: list[dict[str, Any]]) -> None:
    print(f"{'isolation':<9} {'cost':<5} {'bad':<4} {'sent':>6} {'correct':>7} {'failed':>6} "
          f"{'lost':>4} {'hung':>4} {'good/s':>7}  bad requests (kind: statuses)")
    for result in results:
        for label, run_ in (("no", result["without_bad"]), ("yes", result["with_bad"])):
            failed = sum(run_["good_failed"].values())
            bad = "; ".join(f"{k}: {dict(v)}" for k, v in run_["bad"].items()) or "-"
            print(f"{result['isolation']:<9} {result['cost']:<5} {label:<4} {run_['good_sent']:>6} "
                  f"{run_['good_correct']:>7} {failed:>6} {run_['lost']:>4} {run_['hung']:>4} "
                  f"{run_['good_per_s']:>7.1f}  {bad}")
        print(f"{'':<15} good throughput with bad traffic: {100 * result['ratio']:.0f}% of without; "
              f"ready afterwards: {result['ready_after']}; peak RSS {result['peak_rss_mb']:.0f} MB; "
              f"recoveries {result['recoveries']}")


def run_faults(args: argparse.Namespace) -> int:
    modes = ["thread", "process"] if args.isolation == "both" else [args.isolation]
    results = [faults.run(mode, args.seconds, args.kinds, cost=args.cost) for mode in modes]
    _print_faults(results)
    save(args.out, {"callers": faults.CALLERS, "seconds": args.seconds,
                    "kinds": args.kinds or "all", "cost": args.cost, "results": results})
    return 1 if any(faults.failures(r) for r in results) else 0


def run_overload(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder)
        overload.write_model(repository)
        started = time.monotonic()
        results = asyncio.run(overload.soak(repository))
    results["wall_s"] = round(time.monotonic() - started, 1)
    print(overload.table(results))
    print(
        f"\nserver + workers ({results['processes']} processes) RSS: "
        f"idle {results['idle_rss_mb']} MB, peak {results['peak_rss_mb']} MB;"
        f" SIGTERM: exit status {results['shutdown']['returncode']} after "
        f"{results['shutdown']['exited_after_s']} s; leftover processes: "
        f"{len(results['leftover_processes'])}; {results['wall_s']} s in all"
    )
    save(args.out, results)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=["faults", "overload"], default="faults")
    faults_options = parser.add_argument_group("--scenario faults")
    faults_options.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    faults_options.add_argument("--isolation", choices=["thread", "process", "both"],
                                default="both")
    faults_options.add_argument("--kinds", nargs="+", choices=list(FAULT_KINDS),
                                help="only these kinds of bad request (default: all that apply)")
    faults_options.add_argument("--cost", choices=sorted(COSTS), default="cpu",
                                help="what a forward costs: cpu (per row), flat (100 ms per "
                                "batch) or light (2 ms)")
    parser.add_argument("--out", help="the JSON result (default: benchmarks/results/soak.json, "
                        "or soak_overload.json)")
    args = parser.parse_args()
    args.out = args.out or DEFAULT_OUT[args.scenario]
    return run_faults(args) if args.scenario == "faults" else run_overload(args)


if __name__ == "__main__":
    sys.exit(main())
