#!/usr/bin/env python3
"""Latency targets under open-loop (Poisson) arrivals, per bundled model:
each as shipped, with ``target_p99_ms``, and with the best fixed setting a
user could hand-tune for the same p99 (a queue bounded to what drains within
it), at half of capacity, at capacity and at 1.5x. One command, about two
minutes a model:

    python benchmarks/latency_target.py [--models tagger ...] [--target-ms 150] [--seconds 8]
    python benchmarks/latency_target.py --models tagger --tree ../before   # another commit's server

Capacity is a model's items/s as shipped with 32 closed-loop callers. Each
point offers one-item requests (8..128 tokens, or pixels a side) at a
Poisson rate through the shared load generator (tensorserve_bench.loadgen:
latency from each request's scheduled arrival, refusals apart, the
generator's own lateness reported); the variants alternate at each load so
their ratios come from one run. Saves benchmarks/results/latency_target.json
and docs/img/latency_target.png.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any

from tensorserve_bench.items import ItemFactory
from tensorserve_bench.lengths import uniform
from tensorserve_bench.loadgen import PointResult, PreparedRequest, run_point
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.targets import HttpTarget

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache" / "latency_target"
MODELS = ("tagger", "attention_tagger", "gru_tagger", "embedder", "image_filter")
LOADS = (0.5, 1.0, 1.5)
VARIANTS = {"default": "", "target": "_target", "queue-bounded": "_queue"}
# Refusals are the point here: one warning line each would be the run's own load.
QUIET = ("--log-level", "ERROR")


def write_variants(model: str, target_ms: float, queue_size: int | None) -> Path:
    """The model as shipped, one with a target, and (once capacity is known)
    one with its queue bounded to ``queue_size``: three models, one server."""
    source = ROOT / "model_repository" / model
    lines = {"": "", "_target": f"target_p99_ms = {target_ms!r}\n"}
    if queue_size is not None:
        lines["_queue"] = f"max_queue_size = {queue_size}\n"
    shutil.rmtree(CACHE, ignore_errors=True)
    for suffix, line in lines.items():
        dest = CACHE / f"{model}{suffix}"
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
        config = dest / "config.toml"
        config.write_text(config.read_text().replace("[dynamic_batching]\n", f"[dynamic_batching]\n{line}"))
    return CACHE


async def opened(url: str, model: str, count: int = 512) -> tuple[HttpTarget, list[PreparedRequest]]:
    target = HttpTarget(url, model, timeout=120.0)
    await target.open()
    factory = ItemFactory(target.specs, uniform(8, 128), seed=7, id_range=(1, 4096))
    items, _ = factory.make(count)
    return target, [PreparedRequest(target.encode([item]), 1) for item in items]


async def capacity(url: str, model: str, seconds: float) -> float:
    """Items/s of the model as shipped with 32 closed-loop callers."""
    target, pool = await opened(url, model)
    try:
        point = await run_point(target, pool, concurrency=32, duration=seconds, warmup=2.0)
        return point.items_per_s
    finally:
        await target.aclose()


def row_of(model: str, variant: str, load: float, point: PointResult) -> dict[str, Any]:
    sent = point.requests + point.refused + point.errors
    return {
        "model": model, "variant": variant, "load": load, "offered_per_s": point.rate,
        "served_per_s": point.items_per_s, "p50_ms": point.latency_ms["p50"],
        "p99_ms": point.latency_ms["p99"], "refused_pct": 100 * point.refused / max(1, sent),
        "refusal_p99_ms": point.refusal_latency_ms["p99"], "errors": point.errors,
        "dropped": point.dropped, "late_p99_ms": point.late_ms["p99"],
        "avg_batch_size": point.avg_batch_size,
    }  # fmt: skip


async def sweep(url: str, model: str, rate: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    targets = {variant: await opened(url, model + suffix) for variant, suffix in VARIANTS.items()}
    rows = []
    try:
        for index, load in enumerate(LOADS):
            order = list(targets) if index % 2 == 0 else list(reversed(targets))
            for variant in order:
                target, pool = targets[variant]
                point = await run_point(target, pool, mode="open", rate=load * rate,
                                        duration=args.seconds, warmup=2.0, seed=index)
                rows.append(row_of(model, variant, load, point))
                print_row(rows[-1])
    finally:
        for target, _ in targets.values():
            await target.aclose()
    return rows


HEADER = (f"{'model':<17} {'variant':<14} {'load':>4} {'offered/s':>9} {'served/s':>9} "
          f"{'p50 ms':>7} {'p99 ms':>8} {'refused':>7} {'refusal p99':>11} {'late p99':>8}")


def print_row(row: dict[str, Any]) -> None:
    print(f"{row['model']:<17} {row['variant']:<14} {row['load']:>4.1f} {row['offered_per_s']:>9.1f} "
          f"{row['served_per_s']:>9.1f} {row['p50_ms']:>7.1f} {row['p99_ms']:>8.1f} "
          f"{row['refused_pct']:>6.1f}% {row['refusal_p99_ms']:>8.1f} ms {row['late_p99_ms']:>5.1f} ms",
          flush=True)


def plot(rows: list[dict[str, Any]], capacities: dict[str, float], target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(capacities)
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (latency, served), model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        for variant in VARIANTS:
            points = [r for r in mine if r["variant"] == variant]
            loads = [r["load"] for r in points]
            latency.plot(loads, [r["p99_ms"] for r in points], marker="o", label=variant)
            served.plot(loads, [r["served_per_s"] for r in points], marker="o", label=variant)
        latency.axhline(target_ms, color="grey", linestyle="--", label=f"target {target_ms:g} ms")
        served.axhline(capacities[model], color="grey", linestyle="--", label="capacity")
        latency.set(title=model, xlabel="offered load (x capacity)", ylabel="p99 of the served (ms)",
                    yscale="log")
        served.set(title=model, xlabel="offered load (x capacity)", ylabel="items/s served")
        for axis in (latency, served):
            axis.legend(fontsize="small")
    fig.suptitle("open-loop Poisson arrivals, with and without a latency target")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def serve(repository: Path, tree: str | None) -> ServerProcess:
    """The server of this tree, or of ``tree`` (a worktree of another commit)."""
    where = {"env": {"PYTHONPATH": tree}, "cwd": tree} if tree else {}
    return ServerProcess(str(repository), QUIET, **where).start()  # type: ignore[arg-type]


def measure(model: str, args: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    server = serve(write_variants(model, args.target_ms, None), args.tree)
    try:
        rate = asyncio.run(capacity(server.url, model, args.seconds))
    finally:
        server.stop()
    # The hand-tuned queue: what drains within the target at capacity (items
    # queued beyond it would be late anyway), less the batch that may be running.
    queue_size = max(1, int(rate * args.target_ms / 1000) - 32)
    print(f"{model}: capacity {rate:.1f} items/s; queue-bounded variant: max_queue_size = {queue_size}")
    server = serve(write_variants(model, args.target_ms, queue_size), args.tree)
    try:
        return rate, asyncio.run(sweep(server.url, model, rate, args))
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--target-ms", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each point")
    parser.add_argument("--tree", help="serve this source tree (a worktree of another commit), "
                        "measured with this tree's load generator")
    parser.add_argument("--out", default="benchmarks/results/latency_target.json")
    parser.add_argument("--png", default="docs/img/latency_target.png")
    args = parser.parse_args()

    print(HEADER)
    capacities, rows = {}, []
    for model in args.models:
        capacities[model], measured = measure(model, args)
        rows += measured
    save(args.out, {"target_p99_ms": args.target_ms, "capacity_items_per_s": capacities,
                    "seconds": args.seconds, "rows": rows})
    plot(rows, capacities, args.target_ms, ROOT / args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
