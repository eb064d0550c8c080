#!/usr/bin/env python3
"""Two trees' scheduler processes side by side, under the same moments of
the machine: both servers up at once (``serve --frontends N``, the flat
GPU-like model), wrk loading one and then the other in short segments whose
order alternates, so that a slow spell of the VM (30% and more over minutes
on the 2-core machine) lands on both trees alike.

    python benchmarks/frontends_ab.py --tree /tmp/base .           # ~3 minutes
    python benchmarks/frontends_ab.py --tree /tmp/base . --protocols msgpack \
        --segments 16 --seconds 5 --isolation thread
    # -> benchmarks/results/frontends_ab.json unless --output says otherwise

``benchmarks/frontend.py --tree A B`` serves one tree at a time, a run
of ~10 s each, so a repeat's two figures are a minute apart; here they are
seconds apart. Each segment is read from /proc as there (the scheduler
process, its front ends, the total), and what counts is each pair's ratio,
B over A: the table shows their median and range per protocol beside each
tree's medians. The first segment of each protocol follows a ``--warmup``
run on each server. The server not under load idles meanwhile (its timers
only): its CPU is read over its own segments alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from frontend import (
    BODIES,
    LENGTHS,
    MAX_BATCH_SIZE,
    PROTOCOLS,
    Case,
    add_server_arguments,
    frontend_count,
    require_frontends_flag,
    serve,
    tree_label,
)
from tensorserve_bench.lengths import uniform
from tensorserve_bench.repositories import write_flat_model
from tensorserve_bench.results import save
from tensorserve_bench.wrk import find_wrk, measure, write_model_scripts, wrk_version

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "frontends_ab.json"
FIGURES = ("scheduler_cpu_us_per_request", "total_cpu_us_per_request", "req_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", nargs=2, type=Path, required=True, metavar=("A", "B"))
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=PROTOCOLS)
    parser.add_argument("--c", type=int, default=256, help="wrk's connections")
    parser.add_argument("--flat-ms", type=float, default=5.0, help="milliseconds per batch")
    parser.add_argument("--frontends", type=frontend_count, default=2)
    parser.add_argument("--segments", type=int, default=10, help="pairs of runs per protocol")
    parser.add_argument("--seconds", type=int, default=4, help="one tree's run in a pair")
    parser.add_argument("--warmup", type=int, default=2, help="seconds, before each protocol")
    add_server_arguments(parser)
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def summarise(rows: list[dict[str, Any]], trees: list[str]) -> list[dict[str, Any]]:
    """Per protocol: each tree's medians, and the median and range of B / A
    over the pairs."""
    summary = []
    for protocol in dict.fromkeys(r["protocol"] for r in rows):
        pairs: dict[int, dict[str, dict[str, Any]]] = {}
        for row in rows:
            if row["protocol"] == protocol:
                pairs.setdefault(row["segment"], {})[row["tree"]] = row
        entry: dict[str, Any] = {"protocol": protocol, "pairs": len(pairs)}
        for figure in FIGURES:
            a = [p[trees[0]][figure] for p in pairs.values()]
            b = [p[trees[1]][figure] for p in pairs.values()]
            ratios = [y / x for x, y in zip(a, b) if x and y]
            entry[figure] = {
                "a": statistics.median(a), "b": statistics.median(b),
                "ratio": statistics.median(ratios) if ratios else None,
                "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            }  # fmt: skip
        entry["errors"] = sum(
            r["non_2xx"] + r["socket_errors"] for r in rows if r["protocol"] == protocol
        )
        summary.append(entry)
    return summary


def format_table(summary: list[dict[str, Any]], trees: list[str]) -> str:
    lines = [
        f"| protocol | figure | A: {trees[0]} | B: {trees[1]} | B / A, median of pairs | range |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for entry in summary:
        for figure in FIGURES:
            f = entry[figure]
            ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
            span = "-" if f["ratio"] is None else f"{f['ratio_min']:.2f}-{f['ratio_max']:.2f}"
            lines.append(
                f"| {entry['protocol']} | {figure} | {f['a']:,.1f} | {f['b']:,.1f} | {ratio} "
                f"| {span} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    find_wrk()  # fail before starting any server
    trees = [tree.resolve() for tree in args.tree]
    require_frontends_flag(trees, [args.frontends])
    labels = [tree_label(tree) for tree in trees]
    if labels[0] == labels[1]:
        labels = [f"A {labels[0]}", f"B {labels[1]}"]  # one tree against itself: the noise
    case = Case(
        "flat", "flat", [args.c], lambda repo: write_flat_model(repo, flat_ms=args.flat_ms),
        MAX_BATCH_SIZE / (args.flat_ms / 1000),
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frontends-ab-") as tmp, ExitStack() as stack:
        works = [Path(tmp, f"tree{i}") for i in range(2)]
        servers = [
            stack.enter_context(serve(case, tree, args.frontends, work, args))
            for tree, work in zip(trees, works)
        ]
        items = {"count": BODIES, "lengths": uniform(*LENGTHS), "seed": args.seed}
        scripts = [
            write_model_scripts(server.url, "flat", args.protocols, work / "bodies", **items)
            for server, work in zip(servers, works)
        ]
        for protocol in args.protocols:
            for segment in range(args.segments):
                for i in (0, 1) if segment % 2 == 0 else (1, 0):
                    window = measure(
                        servers[i], f"{servers[i].url}/v2/models/flat/infer",
                        scripts[i][protocol], connections=args.c, duration=args.seconds,
                        warmup=args.warmup if segment == 0 else 0, timeout_s=args.timeout,
                    )  # fmt: skip
                    result, roles = window.result, window.roles
                    assert roles is not None  # measure was given the server
                    row = {
                        "protocol": protocol, "segment": segment, "tree": labels[i],
                        "requests": result.requests, "req_s": result.requests_per_s,
                        **roles.as_row(result.requests),
                        "non_2xx": result.non_2xx,
                        "socket_errors": sum(result.socket_errors.values()),
                        **{f"{p}_ms": v for p, v in result.latency_ms.items()},
                    }  # fmt: skip
                    rows.append(row)
                    print(
                        f"  {protocol:8} pair {segment + 1:>2}/{args.segments} {labels[i]:14} "
                        f"{result.requests_per_s:8.0f} req/s  scheduler "
                        f"{row['scheduler_cpu_us_per_request'] or 0:5.1f} us/req",
                        flush=True,
                    )
    summary = summarise(rows, labels)
    print("\n" + format_table(summary, labels))
    save(args.output, {
        "command": " ".join(["python", *sys.argv]),
        "wrk": wrk_version(),
        "settings": {
            "trees": labels, "c": args.c, "flat_ms": args.flat_ms, "frontends": args.frontends,
            "segments": args.segments, "seconds": args.seconds, "warmup_s": args.warmup,
            "isolation": args.isolation or "server default", "server_args": args.server_arg,
            "bodies": BODIES, "lengths": f"uniform {LENGTHS[0]}..{LENGTHS[1]}", "seed": args.seed,
        },
        "summary": summary,
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
