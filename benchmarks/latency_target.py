#!/usr/bin/env python3
"""Latency targets under open-loop (Poisson) arrivals: the bundled tagger as
shipped, with ``target_p99_ms``, and with the best fixed setting a user could
hand-tune for the same p99 (a queue bounded to what drains within it), at
half of capacity, at capacity and at 1.5x. One command, about three minutes:

    python benchmarks/latency_target.py [--target-ms 150] [--seconds 10]

Capacity is the tagger's items/s as shipped with 32 closed-loop callers.
Each point offers one-item requests (8..128 tokens) at a Poisson rate; the
variants alternate at each load so their ratios come from one run. Per
point: items/s served, p50/p99 of the served (from each request's scheduled
arrival: a client that falls behind shows up as latency), the share refused
(503) and how fast refusals came back (p99). Saves
benchmarks/results/latency_target.json and docs/img/latency_target.png.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tensorserve.bench.items import ItemFactory
from tensorserve.bench.lengths import uniform
from tensorserve.bench.loadgen import run_point
from tensorserve.bench.percentiles import percentile
from tensorserve.bench.results import save
from tensorserve.bench.server import ServerProcess
from tensorserve.bench.targets import HttpTarget, RequestFailed

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache" / "latency_target"
LOADS = (0.5, 1.0, 1.5)
# Refusals are the point here: one warning line each would be the run's own load.
QUIET = ("--log-level", "ERROR")


def write_variants(target_ms: float, queue_size: int | None) -> Path:
    """The tagger as shipped, one with a target, and (once capacity is known)
    one with its queue bounded to ``queue_size``: three models, one server."""
    source = ROOT / "model_repository" / "tagger"
    variants = {"tagger": "", "tagger_target": f"target_p99_ms = {target_ms!r}\n"}
    if queue_size is not None:
        variants["tagger_queue"] = f"max_queue_size = {queue_size}\n"
    shutil.rmtree(CACHE, ignore_errors=True)
    for name, line in variants.items():
        dest = CACHE / name
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
        config = dest / "config.toml"
        config.write_text(config.read_text().replace("[dynamic_batching]\n", f"[dynamic_batching]\n{line}"))
    return CACHE


async def open_loop(target: HttpTarget, payloads: list[bytes], rate: float, seconds: float,
                    rng: np.random.Generator) -> dict[str, Any]:
    """Poisson arrivals at ``rate``/s for ``seconds``; each request's outcome
    and its latency from its scheduled arrival."""
    served: list[float] = []
    refused: list[float] = []
    other: list[str] = []

    async def send(payload: bytes, scheduled: float) -> None:
        try:
            await target.send(payload)
        except RequestFailed as exc:
            if "503" in str(exc):
                refused.append(time.perf_counter() - scheduled)
            else:
                other.append(str(exc)[:200])
        else:
            served.append(time.perf_counter() - scheduled)

    tasks = []
    start = scheduled = time.perf_counter()
    for index in range(10**9):
        scheduled += float(rng.exponential(1.0 / rate))
        if scheduled >= start + seconds:
            break
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        tasks.append(asyncio.create_task(send(payloads[index % len(payloads)], scheduled)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    sent = len(tasks)
    return {
        "offered_per_s": rate, "sent": sent, "served_per_s": len(served) / elapsed,
        "p50_ms": 1000 * percentile(served, 50), "p99_ms": 1000 * percentile(served, 99),
        "refused_pct": 100 * len(refused) / max(1, sent),
        "refusal_p99_ms": 1000 * percentile(refused, 99), "other_errors": len(other),
    }  # fmt: skip


async def capacity(url: str, payloads: list[bytes], seconds: float) -> float:
    """Items/s of the tagger as shipped with 32 closed-loop callers."""
    from tensorserve.bench.loadgen import PreparedRequest

    target = HttpTarget(url, "tagger")
    await target.open()
    try:
        pool = [PreparedRequest(p, 1) for p in payloads]
        point = await run_point(target, pool, concurrency=32, duration=seconds, warmup=2.0)
        return point.items_per_s
    finally:
        await target.aclose()


async def payloads_for(url: str, model: str, count: int = 512) -> tuple[HttpTarget, list[bytes]]:
    target = HttpTarget(url, model, timeout=120.0)
    await target.open()
    factory = ItemFactory(target.specs, uniform(8, 128), seed=7, id_range=(1, 4096))
    items, _ = factory.make(count)
    return target, [target.encode([item]) for item in items]


async def sweep(url: str, rate: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    models = {"default": "tagger", "target": "tagger_target", "queue-bounded": "tagger_queue"}
    opened = {name: await payloads_for(url, model) for name, model in models.items()}
    rows = []
    try:
        for index, load in enumerate(LOADS):
            order = list(models) if index % 2 == 0 else list(reversed(models))
            for variant in order:
                target, payloads = opened[variant]
                rng = np.random.default_rng(index)
                await open_loop(target, payloads, load * rate, 2.0, rng)  # warm, then measure
                row = await open_loop(target, payloads, load * rate, args.seconds, rng)
                rows.append({"variant": variant, "load": load, **row})
                print_row(rows[-1])
    finally:
        for target, _ in opened.values():
            await target.aclose()
    return rows


HEADER = (f"{'variant':<14} {'load':>5} {'offered/s':>9} {'served/s':>9} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'refused':>8} {'refusal p99':>11}")


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['variant']:<14} {row['load']:>5.1f} {row['offered_per_s']:>9.1f} "
          f"{row['served_per_s']:>9.1f} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} "
          f"{row['refused_pct']:>7.1f}% {row['refusal_p99_ms']:>9.1f} ms", flush=True)


def plot(rows: list[dict[str, Any]], capacity_per_s: float, target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, served) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        loads = [r["load"] for r in mine]
        latency.plot(loads, [r["p99_ms"] for r in mine], marker="o", label=variant)
        served.plot(loads, [r["served_per_s"] for r in mine], marker="o", label=variant)
    latency.axhline(target_ms, color="grey", linestyle="--", label=f"target {target_ms:g} ms")
    served.axhline(capacity_per_s, color="grey", linestyle="--", label="capacity")
    latency.set(xlabel="offered load (x capacity)", ylabel="p99 of the served (ms)", yscale="log")
    served.set(xlabel="offered load (x capacity)", ylabel="items/s served")
    for axes in (latency, served):
        axes.legend()
    fig.suptitle("tagger, open-loop Poisson arrivals, with and without a latency target")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-ms", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each point")
    parser.add_argument("--out", default="benchmarks/results/latency_target.json")
    parser.add_argument("--png", default="docs/img/latency_target.png")
    args = parser.parse_args()

    server = ServerProcess(str(write_variants(args.target_ms, None)), QUIET).start()
    try:
        _, payloads = asyncio.run(payloads_for(server.url, "tagger"))
        rate = asyncio.run(capacity(server.url, payloads, args.seconds))
    finally:
        server.stop()
    # The hand-tuned queue: what drains within the target at capacity (items
    # queued beyond it would be late anyway), less the batch that may be running.
    queue_size = max(1, int(rate * args.target_ms / 1000) - 32)
    print(f"capacity {rate:.1f} items/s; queue-bounded variant: max_queue_size = {queue_size}")
    print(HEADER)
    server = ServerProcess(str(write_variants(args.target_ms, queue_size)), QUIET).start()
    try:
        rows = asyncio.run(sweep(server.url, rate, args))
    finally:
        server.stop()
    save(args.out, {"target_p99_ms": args.target_ms, "capacity_items_per_s": rate,
                    "queue_bounded_max_queue_size": queue_size, "seconds": args.seconds,
                    "rows": rows})
    plot(rows, rate, args.target_ms, ROOT / args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
