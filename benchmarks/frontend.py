#!/usr/bin/env python3
"""The server's front-end ceiling, loaded by wrk (a C client) instead of our
Python load generator, which on a small machine takes the cores it measures.

    python benchmarks/frontend.py                                   # ~5 minutes
    python benchmarks/frontend.py --duration 5 --warmup 2 --repeats 1
    python benchmarks/frontend.py --tree /tmp/before . --repeats 3 --cases flat
    python benchmarks/frontend.py --frontends 1 2 --cases flat --output /tmp/f.json
    # -> benchmarks/results/frontend.json unless --output says otherwise

Cases (one item per request, lengths uniform 8..128, the same 256 items on
both protocols: KServe v2 JSON and native msgpack, POST /v2/models/{m}/infer):

zeros   a toy that returns zeros (no compute): what the server costs per
        request, around a model that costs nothing.            c = 64
flat    a toy that sleeps a flat 5 ms per batch of up to 64 items (a GPU,
        roughly: no CPU, GIL released). It allows 64 / 5 ms = 12,800
        items/s; "of model" is the share of that the server delivers.
                                                               c = 64, 256
tagger  the bundled tagger of the tree's own model_repository/.  c = 32, 64
        "of model" is its items/s over its offline ceiling (length-sorted
        batches of 8 with no server, benchmarks/offline_ceiling.py), measured
        from the same tree just before its server starts.

Each case runs on a fresh server per source tree (``--tree``: a checkout such
as a git worktree of an older commit, served with PYTHONPATH and cwd set to
it); the trees take turns within each repeat, so a busy moment of the machine
costs them alike. Each (protocol, c) gets a ``--warmup`` wrk run, then a
``--duration`` one; the server tree's CPU seconds are read just before and
after it. The table shows medians over ``--repeats``; the JSON has every run.

Front ends (``serve --frontends N``): ``--frontends 1 2`` serves each
tree under each N in turn, as rows of their own (a "server" is a tree and an
N). N = 1 passes no flag, so a tree without it serves as it always did (the
environment pins TENSORSERVE_FRONTENDS=1, which such a tree ignores); N >= 2
passes ``--frontends N``, and a tree whose ``serve`` has no such flag is
refused before any server starts. CPU is read from /proc
(tensorserve_bench.proctree) and split by role: the server's own process
("scheduler"; with N = 1 the whole one-process server), its front-end
processes, its other children (model workers) and the total. "total vs N=1"
is a row's total CPU per request over its tree's one-process server's.

The front ends' figures, one command each (on the 2-core machine):

    # (a) scheduler CPU a request, flat at c=256 with 2 front ends, both
    #     protocols (goal <= 30 us), and the total against one process (<= 1.2x)
    python benchmarks/frontend.py --frontends 1 2 --cases flat --flat-c 256 \
        --repeats 3 --duration 8 --warmup 2 --output benchmarks/results/frontends_cpu.json
    # (b) --frontends 1 against the tree before the feature: items/s at the
    #     usual points, a lone caller's p50 at zeros c=1 (the model costs
    #     nothing there). The tree run second has lost c=1 in both orders
    #     before: run it again with --tree . /tmp/base to see the order's share.
    git worktree add --detach /tmp/base COMMIT_BEFORE_THE_FEATURE
    python benchmarks/frontend.py --tree /tmp/base . --frontends 1 --cases zeros flat \
        --zeros-c 1 64 --flat-c 256 --repeats 3 --duration 6 --warmup 2 \
        --output benchmarks/results/frontends_one_vs_base.json
    # (c) on a 16-core GPU machine: --frontends 1 2 4 8 --cases flat --flat-c 512
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from tensorserve_bench.lengths import uniform
from tensorserve_bench.proctree import FrontendsMissing, wait_for_frontends
from tensorserve_bench.repositories import write_flat_model, write_zeros_model
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess, tree_path
from tensorserve_bench.summaries import medians_by
from tensorserve_bench.wrk import (
    find_wrk,
    measure,
    run_wrk,
    write_model_scripts,
    wrk_version,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "frontend.json"
# wrk sends one Content-Type and no other header per script: KServe v2 binary,
# whose requests each carry their header's length, is not among them.
PROTOCOLS = ["json", "msgpack"]
BODIES = 256  # distinct requests per protocol, sent in turn
LENGTHS = (8, 128)
MAX_BATCH_SIZE = 64


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    concurrency: list[int]
    # Writes the model into a temporary repository; None: the tree's model_repository/.
    write: Callable[[Path], Path] | None
    allows_items_s: float | None  # what the model itself allows, if it has a ceiling


def build_cases(args: argparse.Namespace) -> list[Case]:
    every = {
        "zeros": Case("zeros", "zeros", args.zeros_c, write_zeros_model, None),
        "flat": Case(
            "flat", "flat", args.flat_c,
            lambda repo: write_flat_model(repo, flat_ms=args.flat_ms, device=args.flat_device),
            MAX_BATCH_SIZE / (args.flat_ms / 1000),
        ),
        "tagger": Case("tagger", "tagger", args.tagger_c, None, None),
    }  # fmt: skip
    return [every[name] for name in args.cases]


def tree_label(tree: Path) -> str:
    return "." if tree.resolve() == ROOT else str(tree)


# ---------------------------------------------------------------------- one server
@contextmanager
def serve(
    case: Case, tree: Path, frontends: int, work: Path, args: argparse.Namespace
) -> Iterator[ServerProcess]:
    """A server of ``tree`` for ``case``'s model with ``frontends`` front-end
    processes (1: no flag, the one-process server), stopped on the way out."""
    if case.write is not None:
        repository = work / f"repo-{case.name}"
        if not repository.exists():
            case.write(repository)
    else:
        repository = tree / "model_repository"
        if not (repository / case.model / "config.toml").exists():
            raise SystemExit(f"{tree}: no {case.model} in {repository}")
    flags = ["--isolation", args.isolation] if args.isolation else []
    flags += ["--frontends", str(frontends)] if frontends > 1 else []
    flags += [flag for value in args.server_arg for flag in shlex.split(value)]
    # N = 1 is the one-process server even where this shell exports another
    # count (an older tree ignores the variable).
    env = {"PYTHONPATH": tree_path(tree)} | (
        {"TENSORSERVE_FRONTENDS": "1"} if frontends == 1 else {}
    )
    server = ServerProcess(
        str(repository.resolve()), flags, env=env, cwd=tree,
        log=work / f"server-{case.name}-{frontends}.log",
    )  # fmt: skip
    server.start()
    try:
        if frontends > 1:
            assert server.process is not None
            try:
                wait_for_frontends(server.process.pid, frontends)
            except FrontendsMissing as missing:
                raise SystemExit(f"--frontends {frontends}: {missing}{server.log_tail()}") from None
        yield server
    finally:
        server.stop()


def require_frontends_flag(trees: list[Path], frontends: list[int]) -> None:
    """Refuse, before any server starts, a tree whose ``serve`` has no
    ``--frontends`` when some N >= 2 is asked for."""
    if max(frontends) < 2:
        return
    for tree in trees:
        done = subprocess.run(
            [sys.executable, "-m", "tensorserve", "serve", "--help"], cwd=tree,
            env={**os.environ, "PYTHONPATH": tree_path(tree)}, capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        if done.returncode != 0 or "--frontends" not in done.stdout:
            raise SystemExit(
                f"tree {tree_label(tree)}: its `tensorserve serve` has no --frontends (asked for "
                f"--frontends {' '.join(map(str, frontends))}): serve it with --frontends 1 only"
                + (f"\n{done.stderr.strip()}" if done.returncode != 0 else "")
            )


def offline_ceiling(tree: Path, model: str, seconds: float) -> float:
    """The model's items/s with no server (benchmarks/offline_ceiling.py:
    length-sorted batches of 8, every CPU), from ``tree``'s own package."""
    script = ROOT / "benchmarks" / "offline_ceiling.py"
    done = subprocess.run(
        [sys.executable, str(script), "--model", model, "--seconds", str(seconds),
         "--repository", str(tree / "model_repository")],
        cwd=tree, env={**os.environ, "PYTHONPATH": tree_path(tree)}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    ceiling = float(json.loads(done.stdout.splitlines()[-1])["sorted_8_items_s"])
    print(f"  {model} offline (sorted batches of 8): {ceiling:.0f} items/s", flush=True)
    return ceiling


def batch_totals(url: str, model: str) -> tuple[int, int, int] | None:
    """Batches, items and the model's nanoseconds so far, from Triton's
    statistics (``batch_stats``: per batch size; a GPU's time from its events;
    zeros where a tree's server reports none; None where they cannot be read)."""
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=10) as reply:
            stats = json.load(reply).get("model_stats") or [{}]
    except (OSError, ValueError):  # a server that died mid-row: its row says so, not this
        return None
    batch_stats = stats[0].get("batch_stats", [])
    batches = sum(b["compute_infer"]["count"] for b in batch_stats)
    items = sum(b["batch_size"] * b["compute_infer"]["count"] for b in batch_stats)
    return batches, items, sum(b["compute_infer"]["ns"] for b in batch_stats)


def model_figures(
    before: tuple[int, int, int] | None, after: tuple[int, int, int] | None
) -> dict[str, float | None]:
    """The window's mean batch and the model's milliseconds a batch."""
    if before is None or after is None or after[0] <= before[0]:
        return {"mean_batch": None, "batch_ms": None}
    batches, items, ns = (a - b for a, b in zip(after, before))
    return {"mean_batch": items / batches, "batch_ms": ns / batches / 1e6}


def run_case(
    case: Case, tree: Path, frontends: int, args: argparse.Namespace, work: Path, repeat: int
) -> list[dict[str, Any]]:
    rows = []
    offline = offline_ceiling(tree, case.model, args.duration) if case.name == "tagger" else None
    with serve(case, tree, frontends, work, args) as server:
        scripts = write_model_scripts(
            server.url, case.model, args.protocols, work / "bodies",
            count=BODIES, lengths=uniform(*LENGTHS), seed=args.seed,
        )  # fmt: skip
        for protocol in args.protocols:
            for connections in case.concurrency:
                url = f"{server.url}/v2/models/{case.model}/infer"
                if args.warmup > 0:  # apart, so that the model's figures cover the window
                    run_wrk(
                        url, scripts[protocol], connections, args.warmup, timeout_s=args.timeout
                    )
                before = batch_totals(server.url, case.model)
                window = measure(
                    server, url, scripts[protocol],
                    connections=connections, duration=args.duration, warmup=0,
                    timeout_s=args.timeout,
                )  # fmt: skip
                result, roles = window.result, window.roles
                assert roles is not None  # measure was given the server
                items_s = result.ok_per_s  # one item per request
                row = {
                    "case": case.name, "model": case.model, "tree": tree_label(tree),
                    "frontends": frontends, "protocol": protocol, "c": connections,
                    "repeat": repeat, "requests": result.requests,
                    "duration_s": result.duration_s,
                    "req_s": result.requests_per_s, "items_s": items_s,
                    "allows_items_s": case.allows_items_s,
                    "of_model": items_s / case.allows_items_s if case.allows_items_s else None,
                    "offline_items_s": offline,
                    **model_figures(before, batch_totals(server.url, case.model)),
                    "of_offline": items_s / offline if offline else None,
                    # The tree by psutil, reaped children included (as in older results).
                    "server_cpu_s": window.server_cpu_s,
                    "server_cpu_us_per_request": window.server_cpu_us_per_request,
                    **roles.as_row(result.requests),  # by role, from /proc
                    "wrk_cpu_us_per_request": window.wrk_cpu_us_per_request,
                    "non_2xx": result.non_2xx, "socket_errors": result.socket_errors,
                    **{f"{p}_ms": v for p, v in result.latency_ms.items()},
                }  # fmt: skip
                rows.append(row)
                exited = f"  ({roles.exited} processes exited)" if roles.exited else ""
                print(
                    f"  {case.name:7} {tree_label(tree):12} N={frontends:<2} {protocol:8} "
                    f"c={connections:<4} {result.requests_per_s:8.0f} req/s  cpu us/req: "
                    f"scheduler {row['scheduler_cpu_us_per_request'] or 0:4.0f} "
                    f"total {row['total_cpu_us_per_request'] or 0:4.0f}  "
                    f"p99 {row.get('p99_ms', float('nan')):7.2f} ms  "
                    f"batch {row['mean_batch'] or 0:4.1f} items {row['batch_ms'] or 0:5.2f} ms  "
                    f"errors {result.errors}{exited}",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------------- report
KEY = ("case", "tree", "frontends", "protocol", "c")
MEDIANS = ("req_s", "items_s", "of_model", "of_offline", "mean_batch", "batch_ms",
           "server_cpu_us_per_request",
           "scheduler_cpu_us_per_request", "frontend_cpu_us_per_request",
           "workers_cpu_us_per_request", "total_cpu_us_per_request",
           "wrk_cpu_us_per_request", "p50_ms", "p90_ms", "p99_ms")  # fmt: skip


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the repeats per (case, tree, frontends, protocol, c);
    errors summed; the total CPU a request over the same tree's N = 1 one's."""
    summary = medians_by(rows, KEY, MEDIANS)
    for entry in summary:
        group = [r for r in rows if all(r[k] == entry[k] for k in KEY)]
        entry["non_2xx"] = sum(r["non_2xx"] for r in group)
        entry["socket_errors"] = sum(sum(r["socket_errors"].values()) for r in group)
    one_process = {
        tuple(e[k] for k in KEY if k != "frontends"): e["total_cpu_us_per_request"]
        for e in summary
        if e["frontends"] == 1
    }
    for entry in summary:
        base = one_process.get(tuple(entry[k] for k in KEY if k != "frontends"))
        total = entry["total_cpu_us_per_request"]
        entry["total_cpu_vs_one_process"] = total / base if total and base else None
    return summary


COLUMNS = [  # header, right-aligned, the summary's field, digits
    ("case", False, "case", None), ("tree", False, "tree", None), ("N", True, "frontends", None),
    ("protocol", False, "protocol", None), ("c", True, "c", None), ("req/s", True, "req_s", 0),
    ("items/s", True, "items_s", 0), ("of model", True, "of_model", None),
    ("mean batch", True, "mean_batch", 1), ("batch ms", True, "batch_ms", 2),
    ("scheduler CPU us/req", True, "scheduler_cpu_us_per_request", 0),
    ("total CPU us/req", True, "total_cpu_us_per_request", 0),
    ("total vs N=1", True, "total_cpu_vs_one_process", 2),
    ("wrk CPU us/req", True, "wrk_cpu_us_per_request", 1), ("p50 ms", True, "p50_ms", 2),
    ("p99 ms", True, "p99_ms", 2), ("non-2xx", True, "non_2xx", None),
    ("socket errors", True, "socket_errors", None),
]  # fmt: skip


def format_table(summary: list[dict[str, Any]]) -> str:
    def cell(entry: dict[str, Any], field: str, digits: int | None) -> str:
        value = entry[field]
        if field == "of_model":  # a share of the model's ceiling, or of the offline one
            if entry.get("of_offline") is not None:
                return f"{entry['of_offline']:.2f}x offline"
            return "-" if value is None else f"{100 * value:.0f}%"
        if value is None:
            return "-"
        return str(value) if digits is None else f"{value:,.{digits}f}"

    lines = [
        "| " + " | ".join(header for header, *_ in COLUMNS) + " |",
        "| " + " | ".join("---:" if right else "---" for _, right, *_ in COLUMNS) + " |",
    ]
    for entry in summary:
        cells = [cell(entry, field, digits) for _, _, field, digits in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def frontend_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a count of front-end processes, 1 or more, not {text!r}")
    return int(text)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """How each server runs and is loaded (``serve`` reads them; frontends_ab.py shares them)."""
    parser.add_argument("--timeout", type=int, default=10, help="wrk's per-request timeout, s")
    parser.add_argument(
        "--isolation", choices=["auto", "thread", "process"], default=None,
        help="the server's --isolation (default: pass nothing, the server's own)",
    )  # fmt: skip
    parser.add_argument(
        "--server-arg", action="append", default=[],
        help="more serve flags, shell-split (repeatable): --server-arg='--max-queue-delay-ms 2'",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the items' seed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cases = ["zeros", "flat", "tagger"]
    parser.add_argument("--cases", nargs="+", choices=cases, default=cases)
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=PROTOCOLS)
    parser.add_argument("--zeros-c", nargs="+", type=int, default=[64], help="zeros: connections")
    parser.add_argument(
        "--flat-c", nargs="+", type=int, default=[64, 256], help="flat: connections"
    )
    parser.add_argument(
        "--tagger-c", nargs="+", type=int, default=[32, 64], help="tagger: connections"
    )
    parser.add_argument("--flat-ms", type=float, default=5.0, help="flat: milliseconds per batch")
    parser.add_argument(
        "--flat-device", choices=["cpu", "cuda"], default="cpu",
        help="flat: a sleep on the host (cpu), or the GPU kept busy (cuda: a GPU machine)",
    )  # fmt: skip
    parser.add_argument("--duration", type=int, default=10, help="measured seconds per run (whole)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up seconds per run (0: none)")
    parser.add_argument("--repeats", type=int, default=1)
    add_server_arguments(parser)
    parser.add_argument(
        "--tree", nargs="+", type=Path, default=[ROOT],
        help="source trees to serve from, in turn (default: this one)",
    )  # fmt: skip
    parser.add_argument(
        "--frontends", nargs="+", type=frontend_count, default=[1],
        help="serve each tree with each count of front-end processes in turn "
        "(1: the one-process server, no flag passed; N >= 2: --frontends N)",
    )  # fmt: skip
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help="the JSON (smoke runs: somewhere in /tmp)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    find_wrk()  # fail before starting any server
    require_frontends_flag([tree.resolve() for tree in args.tree], args.frontends)
    cases = build_cases(args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frontend-") as tmp:
        for repeat in range(args.repeats):
            for case in cases:
                # Each server (a tree, a count of front ends) in turn.
                for (index, tree), frontends in product(enumerate(args.tree), args.frontends):
                    print(
                        f"repeat {repeat + 1}/{args.repeats}: {case.name} on "
                        f"{tree_label(tree)}, --frontends {frontends}",
                        flush=True,
                    )
                    work = Path(tmp, f"tree{index}")
                    rows += run_case(case, tree.resolve(), frontends, args, work, repeat)
    summary = summarise(rows)
    print("\n" + format_table(summary))
    save(args.output, {
        "command": " ".join(["python", *sys.argv]),
        "wrk": wrk_version(),
        "settings": {
            "duration_s": args.duration, "warmup_s": args.warmup, "repeats": args.repeats,
            "isolation": args.isolation or "server default", "server_args": args.server_arg,
            "bodies": BODIES, "lengths": f"uniform {LENGTHS[0]}..{LENGTHS[1]}", "seed": args.seed,
            "flat_ms": args.flat_ms, "flat_device": args.flat_device,
            "trees": [tree_label(t) for t in args.tree], "frontends": args.frontends,
        },
        "summary": summary,
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
