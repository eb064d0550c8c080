#!/usr/bin/env python3
"""Padded against packed batches on the same weights (issue #54): the
bundled ``tagger`` (padded, with its attention mask) and
``examples/model_repository/packed_tagger`` (its weights, packed: no
padding) served side by side by one real server on loopback, as configured
(worker processes, the learnt budget), native msgpack, one item per request,
closed loop. Both layouts get the same items, in one run:

    python benchmarks/packed.py                   # ~3 minutes on a 2-core VM
    python benchmarks/packed.py --duration 4 --concurrency 64

Lengths: uniform 8..128 tokens, and a long tail 8..512 (log-uniform: half
the items under 64 tokens, a few near 512). Figures per layout, lengths and
concurrency: items/s, p50 and p99, errors, and the padding efficiency of the
batches that ran (real / padded elements, from the server's stats; packed:
1.0). Prints a table and the packed/padded ratio of items/s, and saves
everything to ``benchmarks/results/packed.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import percentiles_ms

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "packed.json"
LAYOUTS = {"padded": "tagger", "packed": "packed_tagger"}
MSGPACK = {"Content-Type": "application/msgpack"}


def lengths(kind: str, count: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform 8..128":
        return rng.integers(8, 129, count)
    return np.exp(rng.uniform(np.log(8), np.log(513), count)).astype(np.int64)  # long tail


def bodies(layout: str, items: list[np.ndarray]) -> list[bytes]:
    """One msgpack request per item: the padded tagger takes its mask too."""

    def tensor(array: np.ndarray) -> dict[str, Any]:
        return {"dtype": "int64", "shape": list(array.shape), "data": array.tobytes()}

    out = []
    for ids in items:
        item = {"input_ids": tensor(ids)}
        if layout == "padded":
            item["attention_mask"] = tensor(np.ones_like(ids))
        out.append(msgpack.packb({"items": [item]}))
    return out


def stats(url: str, model: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=30) as response:
        batching: dict[str, Any] = json.load(response)["batching"]
    return batching


async def closed_loop(
    url: str, model: str, requests: list[bytes], concurrency: int, warmup: float, duration: float
) -> dict[str, Any]:
    latencies: list[float] = []
    errors = 0
    started = time.perf_counter()
    measure_from, stop_at = started + warmup, started + warmup + duration

    async def caller(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal errors
        i = index
        while (now := time.perf_counter()) < stop_at:
            data = requests[i % len(requests)]
            i += concurrency
            sent = time.perf_counter()
            async with session.post(
                f"{url}/v2/models/{model}/infer", data=data, headers=MSGPACK
            ) as response:
                await response.read()
                ok = response.status == 200
            if now >= measure_from:
                if ok:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors += 1

    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(caller(i, session) for i in range(concurrency)))
    summary = percentiles_ms(latencies)
    return {
        "items": len(latencies),
        "errors": errors,
        "items_per_s": len(latencies) / duration,
        "p50_ms": summary["p50"],
        "p99_ms": summary["p99"],
    }


def repository(folder: Path) -> Path:
    """Both models in one repository: the tagger and its packed twin."""
    shutil.copytree(ROOT / "model_repository" / "tagger", folder / "tagger")
    shutil.copytree(
        ROOT / "examples" / "model_repository" / "packed_tagger", folder / "packed_tagger"
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--lengths", nargs="+", default=["uniform 8..128", "long tail 8..512"])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    pools = {
        kind: [rng.integers(1, 4096, n) for n in lengths(kind, 1024, rng)] for kind in args.lengths
    }
    load_before = os.getloadavg()[0]  # a shared machine: say how busy it was
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            str(repository(Path(tmp))), ["--grpc-port", "-1"], ready_timeout=240
        ).start()
        try:
            for kind, items in pools.items():
                for concurrency in args.concurrency:
                    for layout, model in LAYOUTS.items():  # same items, same run, by turns
                        before = stats(server.url, model)
                        run = asyncio.run(
                            closed_loop(
                                server.url,
                                model,
                                bodies(layout, items),
                                concurrency,
                                args.warmup,
                                args.duration,
                            )
                        )
                        after = stats(server.url, model)
                        real = after["real_elements"] - before["real_elements"]
                        padded = after["padded_elements"] - before["padded_elements"]
                        run.update(
                            layout=layout,
                            lengths=kind,
                            concurrency=concurrency,
                            padding_efficiency=real / padded if padded else float("nan"),
                            avg_batch_size=(after["batch_items"] - before["batch_items"])
                            / max(1, after["total_batches"] - before["total_batches"]),
                        )
                        runs.append(run)
                        print(
                            f"{layout:7} {kind:17} c={concurrency:<4} {run['items_per_s']:8.1f} "
                            f"items/s  p99 {run['p99_ms']:8.1f} ms  efficiency "
                            f"{run['padding_efficiency']:.2f}  errors {run['errors']}",
                            flush=True,
                        )
        finally:
            server.stop()
    print()
    print(
        f"{'lengths':17} {'c':>4} {'layout':7} {'items/s':>9} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'efficiency':>10} {'batch':>6} {'packed/padded':>13}"
    )
    by_key = {(r["lengths"], r["concurrency"], r["layout"]): r for r in runs}
    for run in runs:
        padded_run = by_key[(run["lengths"], run["concurrency"], "padded")]
        ratio = (
            f"{run['items_per_s'] / padded_run['items_per_s']:.2f}x"
            if run["layout"] == "packed" and padded_run["items_per_s"]
            else ""
        )
        print(
            f"{run['lengths']:17} {run['concurrency']:>4} {run['layout']:7} "
            f"{run['items_per_s']:9.1f} {run['p50_ms']:9.1f} {run['p99_ms']:9.1f} "
            f"{run['padding_efficiency']:10.2f} {run['avg_batch_size']:6.1f} {ratio:>13}"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    result = {
        "command": "python benchmarks/packed.py",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
