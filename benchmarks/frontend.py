#!/usr/bin/env python3
"""The server's front-end ceiling, loaded by wrk (a C client) instead of our
Python load generator, which on a small machine takes the cores it measures.

    python benchmarks/frontend.py                                   # ~5 minutes
    python benchmarks/frontend.py --duration 5 --warmup 2 --repeats 1
    python benchmarks/frontend.py --tree /tmp/before . --repeats 3 --cases flat
    # -> benchmarks/results/frontend.json

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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorserve_bench.items import ItemFactory, vocab_limit
from tensorserve_bench.lengths import uniform
from tensorserve_bench.repositories import write_flat_model, write_zeros_model
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import medians_by
from tensorserve_bench.targets import HttpTarget
from tensorserve_bench.wrk import find_wrk, measure, write_script, wrk_version

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
            lambda repo: write_flat_model(repo, flat_ms=args.flat_ms),
            MAX_BATCH_SIZE / (args.flat_ms / 1000),
        ),
        "tagger": Case("tagger", "tagger", args.tagger_c, None, None),
    }  # fmt: skip
    return [every[name] for name in args.cases]


def tree_label(tree: Path) -> str:
    return "." if tree.resolve() == ROOT else str(tree)


# ---------------------------------------------------------------------- one server
@contextmanager
def serve(case: Case, tree: Path, work: Path, args: argparse.Namespace) -> Iterator[ServerProcess]:
    """A server of ``tree`` for ``case``'s model, stopped on the way out."""
    if case.write is not None:
        repository = work / f"repo-{case.name}"
        if not repository.exists():
            case.write(repository)
    else:
        repository = tree / "model_repository"
        if not (repository / case.model / "config.toml").exists():
            raise SystemExit(f"{tree}: no {case.model} in {repository}")
    flags = ["--isolation", args.isolation] if args.isolation else []
    flags += [flag for value in args.server_arg for flag in shlex.split(value)]
    server = ServerProcess(
        str(repository.resolve()), flags,
        env={"PYTHONPATH": str(tree)}, cwd=tree, log=work / f"server-{case.name}.log",
    )  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


def offline_ceiling(tree: Path, model: str, seconds: float) -> float:
    """The model's items/s with no server (benchmarks/offline_ceiling.py:
    length-sorted batches of 8, every CPU), from ``tree``'s own package."""
    script = ROOT / "benchmarks" / "offline_ceiling.py"
    done = subprocess.run(
        [sys.executable, str(script), "--model", model, "--seconds", str(seconds),
         "--repository", str(tree / "model_repository")],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    ceiling = float(json.loads(done.stdout.splitlines()[-1])["sorted_8_items_s"])
    print(f"  {model} offline (sorted batches of 8): {ceiling:.0f} items/s", flush=True)
    return ceiling


def write_scripts(
    url: str, model: str, protocols: list[str], folder: Path, seed: int
) -> dict[str, Path]:
    """Per protocol, a wrk script over ``BODIES`` one-item requests: the same
    items (from the model's inputs, as the server describes them) on each."""

    async def bodies(protocol: str) -> tuple[str, str, list[bytes]]:
        target = HttpTarget(url, model, protocol=protocol)
        await target.open()  # discovers the inputs and parameters
        try:
            factory = ItemFactory(
                target.specs, uniform(*LENGTHS), seed=seed,
                id_range=(1, vocab_limit(target.parameters, 1000)),
            )  # fmt: skip
            items, _ = factory.make(BODIES)
            return (
                target.infer_path,
                target.content_type,
                [target.encode_body([i])[0] for i in items],
            )
        finally:
            await target.aclose()

    scripts = {}
    for protocol in protocols:
        path, content_type, encoded = asyncio.run(bodies(protocol))
        scripts[protocol] = write_script(
            folder / f"{model}-{protocol}", path, content_type, encoded
        )
    return scripts


def run_case(
    case: Case, tree: Path, args: argparse.Namespace, work: Path, repeat: int
) -> list[dict[str, Any]]:
    rows = []
    offline = offline_ceiling(tree, case.model, args.duration) if case.name == "tagger" else None
    with serve(case, tree, work, args) as server:
        scripts = write_scripts(server.url, case.model, args.protocols, work / "bodies", args.seed)
        for protocol in args.protocols:
            for connections in case.concurrency:
                window = measure(
                    server, f"{server.url}/v2/models/{case.model}/infer", scripts[protocol],
                    connections=connections, duration=args.duration, warmup=args.warmup,
                    timeout_s=args.timeout,
                )  # fmt: skip
                result = window.result
                items_s = result.ok_per_s  # one item per request
                row = {
                    "case": case.name, "model": case.model, "tree": tree_label(tree),
                    "protocol": protocol, "c": connections, "repeat": repeat,
                    "requests": result.requests, "duration_s": result.duration_s,
                    "req_s": result.requests_per_s, "items_s": items_s,
                    "allows_items_s": case.allows_items_s,
                    "of_model": items_s / case.allows_items_s if case.allows_items_s else None,
                    "offline_items_s": offline,
                    "of_offline": items_s / offline if offline else None,
                    "server_cpu_s": window.server_cpu_s,
                    "server_cpu_us_per_request": window.server_cpu_us_per_request,
                    "wrk_cpu_us_per_request": window.wrk_cpu_us_per_request,
                    "non_2xx": result.non_2xx, "socket_errors": result.socket_errors,
                    **{f"{p}_ms": v for p, v in result.latency_ms.items()},
                }  # fmt: skip
                rows.append(row)
                print(
                    f"  {case.name:7} {tree_label(tree):12} {protocol:8} c={connections:<4} "
                    f"{result.requests_per_s:8.0f} req/s  "
                    f"cpu {row['server_cpu_us_per_request'] or 0:6.0f} us/req  "
                    f"p99 {row.get('p99_ms', float('nan')):7.2f} ms  "
                    f"errors {result.errors}",
                    flush=True,
                )
    return rows


# ---------------------------------------------------------------------- report
KEY = ("case", "tree", "protocol", "c")
MEDIANS = ("req_s", "items_s", "of_model", "of_offline", "server_cpu_us_per_request",
           "wrk_cpu_us_per_request", "p50_ms", "p90_ms", "p99_ms")  # fmt: skip


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the repeats per (case, tree, protocol, c); errors summed."""
    summary = medians_by(rows, KEY, MEDIANS)
    for entry in summary:
        group = [r for r in rows if all(r[k] == entry[k] for k in KEY)]
        entry["non_2xx"] = sum(r["non_2xx"] for r in group)
        entry["socket_errors"] = sum(sum(r["socket_errors"].values()) for r in group)
    return summary


def format_table(summary: list[dict[str, Any]]) -> str:
    def num(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = [
        (
            "| case | tree | protocol | c | req/s | items/s | of model | server CPU us/req "
            "| wrk CPU us/req | p50 ms | p99 ms | non-2xx | socket errors |"
        ),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        share = "-" if s["of_model"] is None else f"{100 * s['of_model']:.0f}%"
        if s.get("of_offline") is not None:
            share = f"{s['of_offline']:.2f}x offline"
        lines.append(
            f"| {s['case']} | {s['tree']} | {s['protocol']} | {s['c']} | {num(s['req_s'])} "
            f"| {num(s['items_s'])} | {share} | {num(s['server_cpu_us_per_request'])} "
            f"| {num(s['wrk_cpu_us_per_request'], 1)} | {num(s['p50_ms'], 2)} "
            f"| {num(s['p99_ms'], 2)} | {s['non_2xx']} | {s['socket_errors']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=["zeros", "flat", "tagger"],
        default=["zeros", "flat", "tagger"],
    )
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=PROTOCOLS)
    parser.add_argument("--zeros-c", nargs="+", type=int, default=[64], help="zeros: connections")
    parser.add_argument(
        "--flat-c", nargs="+", type=int, default=[64, 256], help="flat: connections"
    )
    parser.add_argument(
        "--tagger-c", nargs="+", type=int, default=[32, 64], help="tagger: connections"
    )
    parser.add_argument("--flat-ms", type=float, default=5.0, help="flat: milliseconds per batch")
    parser.add_argument("--duration", type=int, default=10, help="measured seconds per run (whole)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up seconds per run (0: none)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=10, help="wrk's per-request timeout, s")
    parser.add_argument(
        "--isolation",
        choices=["auto", "thread", "process"],
        default=None,
        help="the server's --isolation (default: pass nothing, the server's own)",
    )
    parser.add_argument(
        "--tree",
        nargs="+",
        type=Path,
        default=[ROOT],
        help="source trees to serve from, in turn (default: this one)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="more serve flags, shell-split (repeatable): --server-arg='--max-queue-delay-ms 2'",
    )
    parser.add_argument("--seed", type=int, default=0, help="the items' seed")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    find_wrk()  # fail before starting any server
    cases = build_cases(args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frontend-") as tmp:
        for repeat in range(args.repeats):
            for case in cases:
                for index, tree in enumerate(args.tree):
                    work = Path(tmp, f"tree{index}")
                    print(
                        f"repeat {repeat + 1}/{args.repeats}: {case.name} on {tree_label(tree)}",
                        flush=True,
                    )
                    rows += run_case(case, tree.resolve(), args, work, repeat)
    summary = summarise(rows)
    print("\n" + format_table(summary))
    save(args.output, {
        "command": " ".join(["python", *sys.argv]),
        "wrk": wrk_version(),
        "settings": {
            "duration_s": args.duration, "warmup_s": args.warmup, "repeats": args.repeats,
            "isolation": args.isolation or "server default", "server_args": args.server_arg,
            "bodies": BODIES, "lengths": f"uniform {LENGTHS[0]}..{LENGTHS[1]}", "seed": args.seed,
            "flat_ms": args.flat_ms, "trees": [tree_label(t) for t in args.tree],
        },
        "summary": summary,
        "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
