#!/usr/bin/env python3
"""Triton's perf_analyzer against tensorserve's bundled tagger, over HTTP and
gRPC, with its server-side breakdown (queue, compute input / infer / output,
which it reads from the statistics extension). One command:

    python benchmarks/perf_analyzer.py [--concurrency 8,32] [--window-ms 4000]

Installs perf_analyzer first when needed (scripts/install_perf_analyzer.sh:
tritonclient 2.50.0's wheel in a venv of its own). Starts one server of the
bundled repository as shipped and measures each protocol at each concurrency
with the same variable-length ``--input-data`` (one-item requests of 8..128
tokens, seeded, each entry with its own shape). Each point is three windows
of ``--window-ms`` averaged (perf_analyzer's stability check is left wide
open: on a shared 2-core machine no three windows agree within 10%, and a
point that never "stabilises" would say nothing). perf_analyzer sends binary
tensors over HTTP (Triton's binary extension): the project's own load
generator's counterpart is ``tensorserve bench tagger --protocol binary``.

Prints a table and saves benchmarks/results/perf_analyzer.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "scripts" / "install_perf_analyzer.sh"
RESULTS = ROOT / "benchmarks" / "results" / "perf_analyzer.json"
LENGTHS = (8, 128)  # tokens, uniform, both ends included
ENTRIES = 64  # distinct requests perf_analyzer cycles through
# perf_analyzer's CSV (-f) columns, in µs, and our names for them.
CSV_US = {
    "Server Queue": "queue_us",
    "Server Compute Input": "compute_input_us",
    "Server Compute Infer": "compute_infer_us",
    "Server Compute Output": "compute_output_us",
    "p50 latency": "client_p50_us",
    "p99 latency": "client_p99_us",
}
# The "Server:" lines of its report (counts, and the request latency it splits).
SERVER_LINES = {
    "inference_count": r"Inference count: (\d+)",
    "execution_count": r"Execution count: (\d+)",
    "success_count": r"Successful request count: (\d+)",
    "server_request_us": r"Avg request latency: (\d+) usec",
    "overhead_us": r"\(overhead (\d+) usec",
}


def install() -> dict[str, str]:
    """perf_analyzer's path and the environment that runs it."""
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"installing perf_analyzer failed:\n{done.stderr}")
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    library_path = os.pathsep.join(
        p for p in (paths["LD_LIBRARY_PATH"], os.environ.get("LD_LIBRARY_PATH")) if p
    )
    return {"binary": paths["PERF_ANALYZER"], "LD_LIBRARY_PATH": library_path}


def write_input_data(path: Path, seed: int = 0) -> list[int]:
    """``--input-data`` for the tagger: ENTRIES one-item requests of LENGTHS
    tokens, each entry with its own shape. Returns the lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(LENGTHS[0], LENGTHS[1], size=ENTRIES, endpoint=True).tolist()
    entries = [
        {
            "input_ids": {"content": rng.integers(1, 4096, n).tolist(), "shape": [n]},
            "attention_mask": {"content": [1] * n, "shape": [n]},
        }
        for n in lengths
    ]
    path.write_text(json.dumps({"data": entries}))
    return lengths


def measure(
    pa: dict[str, str], protocol: str, url: str, concurrency: int, data: Path, window_ms: int,
    folder: Path,
) -> dict[str, Any]:
    """One point: perf_analyzer's client and server figures."""
    csv_path = folder / f"{protocol}_{concurrency}.csv"
    command = [
        pa["binary"], "-m", "tagger", "-i", protocol, "-u", url, "--input-data", str(data),
        "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
        "--max-trials", "3", "--stability-percentage", "999", "-f", str(csv_path),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, check=False,
        env={**os.environ, "LD_LIBRARY_PATH": pa["LD_LIBRARY_PATH"]},
    )  # fmt: skip
    output = done.stdout + done.stderr
    if done.returncode or "error" in output.lower():
        sys.exit(f"perf_analyzer {protocol} c={concurrency} failed ({done.returncode}):\n{output}")
    with csv_path.open() as f:
        row = next(csv.DictReader(f))
    point: dict[str, Any] = {
        "protocol": protocol,
        "concurrency": concurrency,
        "infer_per_s": float(row["Inferences/Second"]),
        **{ours: int(row[theirs]) for theirs, ours in CSV_US.items()},
    }
    client_avg = re.search(r"Avg latency: (\d+) usec", output[output.index("Client:"):])
    point["client_avg_us"] = int(client_avg.group(1)) if client_avg else None
    server = output[output.index("Server:"):]
    for key, pattern in SERVER_LINES.items():
        found = re.search(pattern, server)
        point[key] = int(found.group(1)) if found else None
    if point["execution_count"]:
        point["avg_batch_size"] = round(point["inference_count"] / point["execution_count"], 2)
    return point


def commit() -> str | None:
    """The measured tree's commit (None outside a git checkout)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=False)  # fmt: skip
    return done.stdout.strip() or None


def table(points: list[dict[str, Any]]) -> str:
    head = (
        f"{'protocol':8} {'c':>3} {'infer/s':>8} {'p50 ms':>7} {'p99 ms':>7} | server: "
        f"{'request':>8} {'overhead':>8} {'queue':>7} {'input':>6} {'infer':>7} {'output':>6} "
        f"{'batch':>5}  (µs; batch: items per execution)"
    )
    lines = [head]
    for p in points:
        lines.append(
            f"{p['protocol']:8} {p['concurrency']:>3} {p['infer_per_s']:>8.1f} "
            f"{p['client_p50_us'] / 1000:>7.1f} {p['client_p99_us'] / 1000:>7.1f} | "
            f"{'':7} {p['server_request_us']:>8} {p['overhead_us']:>8} {p['queue_us']:>7} "
            f"{p['compute_input_us']:>6} {p['compute_infer_us']:>7} {p['compute_output_us']:>6} "
            f"{p.get('avg_batch_size', 0):>5}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="8,32", help="comma-separated (default 8,32)")
    parser.add_argument("--window-ms", type=int, default=4000, help="each of 3 windows a point")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    pa = install()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = folder / "tagger.json"
        lengths = write_input_data(data)
        server = ServerProcess(str(ROOT / "model_repository")).start()
        try:
            for protocol in args.protocols.split(","):
                url = server.url.removeprefix("http://") if protocol == "http" else server.grpc_address
                for concurrency in concurrencies:
                    point = measure(pa, protocol, url, concurrency, data, args.window_ms, folder)
                    print(f"{protocol} c={concurrency}: {point['infer_per_s']:.1f} infer/s",
                          flush=True)
                    points.append(point)
        finally:
            server.stop()
    print(table(points))
    save(args.output, {
        "command": " ".join(["python benchmarks/perf_analyzer.py", *sys.argv[1:]]),
        "commit": commit(),
        "perf_analyzer": "tritonclient 2.50.0 wheel, bin/perf_analyzer",
        "model": "tagger (bundled repository as shipped)",
        "input_data": f"{ENTRIES} one-item requests, {LENGTHS[0]}..{LENGTHS[1]} tokens "
                      f"(mean {float(np.mean(lengths)):.1f}), each with its own shape",
        "window_ms": args.window_ms,
        "windows_per_point": 3,
        "points": points,
    })  # fmt: skip


if __name__ == "__main__":
    main()
