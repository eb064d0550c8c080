#!/usr/bin/env python3
"""gRPC beside HTTP: what one request costs the server (CPU) and takes
(latency at c = 1) over KServe v2 gRPC, KServe v2 JSON and native msgpack,
around a model that costs nothing (``write_zeros_model``).

    python benchmarks/grpc_frontend.py                        # ~1 minute
    python benchmarks/grpc_frontend.py --requests 300 --repeats 2
    # -> benchmarks/results/grpc_frontend.json

One server; the same one-item requests (lengths uniform 8..128) on each
protocol, sent one at a time by this process (gRPC through
``tensorserve_bench.grpc_target``, HTTP through ``RawHttpPool``: the cheapest
callers we have). The protocols take turns within each repeat, in a rotating
order, so a busy moment of the machine costs them alike. Server CPU is the
server tree's CPU seconds over the measured requests, per request; the
table shows medians over ``--repeats``, the JSON every run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorserve_bench.grpc_target import GrpcTarget
from tensorserve_bench.items import ItemFactory
from tensorserve_bench.lengths import uniform
from tensorserve_bench.repositories import write_zeros_model
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import medians_by
from tensorserve_bench.targets import HttpTarget

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "grpc_frontend.json"
PROTOCOLS = ["grpc", "json", "msgpack"]
LENGTHS = (8, 128)
BODIES = 256
FIELDS = ["cpu_us_per_request", "p50_us", "p99_us", "requests_s"]


def target_for(server: ServerProcess, protocol: str) -> HttpTarget:
    if protocol == "grpc":
        return GrpcTarget(server.url, server.grpc_address, "zeros")
    return HttpTarget(server.url, "zeros", protocol=protocol)


async def run_one(
    server: ServerProcess, protocol: str, requests: int, warmup: int, seed: int
) -> dict[str, Any]:
    target = target_for(server, protocol)
    await target.open()
    try:
        items, _ = ItemFactory(target.specs, uniform(*LENGTHS), seed=seed).make(BODIES)
        payloads = [target.encode([item]) for item in items]
        for i in range(warmup):
            await target.send(payloads[i % BODIES])
        latencies = []
        cpu_before = server.usage().cpu_s
        started = time.perf_counter()
        for i in range(requests):
            sent = time.perf_counter()
            await target.send(payloads[i % BODIES])
            latencies.append(time.perf_counter() - sent)
        elapsed = time.perf_counter() - started
        cpu = server.usage().cpu_s - cpu_before
    finally:
        await target.aclose()
    latencies.sort()
    return {
        "protocol": protocol,
        "requests": requests,
        "cpu_us_per_request": 1e6 * cpu / requests,
        "p50_us": 1e6 * statistics.median(latencies),
        "p99_us": 1e6 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "requests_s": requests / elapsed,
    }


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="measured per run")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    runs = []
    with tempfile.TemporaryDirectory() as work:
        repository = Path(work) / "repository"
        write_zeros_model(repository)
        server = ServerProcess(str(repository), log=Path(work) / "server.log")
        server.start()
        try:
            for repeat in range(args.repeats):
                order = PROTOCOLS[repeat % 3:] + PROTOCOLS[:repeat % 3]
                for protocol in order:
                    run = asyncio.run(
                        run_one(server, protocol, args.requests, args.warmup, args.seed)
                    )
                    runs.append({**run, "repeat": repeat})
                    print(f"  repeat {repeat} {protocol:8s} {run['cpu_us_per_request']:7.0f} µs "
                          f"CPU/request, p50 {run['p50_us']:6.0f} µs", flush=True)
        finally:
            server.stop()
    summary = medians_by(runs, ["protocol"], FIELDS)
    print("\n| protocol | server CPU / request | c=1 p50 | c=1 p99 | requests/s |")
    print("|---|---:|---:|---:|---:|")
    for row in summary:
        print(f"| {row['protocol']} | {row['cpu_us_per_request']:.0f} µs | {row['p50_us']:.0f} µs "
              f"| {row['p99_us']:.0f} µs | {row['requests_s']:.0f} |")
    save(args.out, {
        "benchmark": "grpc_frontend", "commit": commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": "zeros (write_zeros_model), one item per request, lengths uniform 8..128",
        "summary": summary, "runs": runs,
    })


if __name__ == "__main__":
    main()
