#!/usr/bin/env python3
"""High-priority latency under a saturating low-priority flood, with and
without priority levels: a model that costs 4 ms a batch (of up to 8), 64
callers flooding it at priority 2, one caller at priority 1 every 20 ms.

    python benchmarks/priority.py [--seconds 8] [--out benchmarks/results/priority.json]

Prints p50/p99 of each class's latency (ms) and the flood's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import torch
from tensorserve_bench.results import save

from tensorserve import ServedModel
from tensorserve.percentiles import percentile

FLOOD_CALLERS = 64


def _model(levels: int) -> ServedModel:
    def fn(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)  # the model's cost: the flood saturates it
        return x * 2

    return ServedModel.from_function(
        fn,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        max_batch_size=8,
        dynamic_batching={"priority_levels": levels, "max_queue_size": 100_000},
    )


async def _run(levels: int, seconds: float) -> dict[str, object]:
    item = {"x": np.ones(16, np.float32)}
    high: list[float] = []
    low: list[float] = []
    async with _model(levels) as model:
        until = time.monotonic() + seconds

        async def flood() -> None:
            while time.monotonic() < until:
                started = time.perf_counter()
                await model.infer_many([item], priority=2 if levels else None)
                low.append(time.perf_counter() - started)

        async def urgent() -> None:
            await asyncio.sleep(1.0)  # the flood has built its queue
            while time.monotonic() < until:
                started = time.perf_counter()
                await model.infer_many([item], priority=1 if levels else None)
                high.append(time.perf_counter() - started)
                await asyncio.sleep(0.02)

        await asyncio.gather(urgent(), *(flood() for _ in range(FLOOD_CALLERS)))
    return {
        "priority_levels": levels,
        "high_p50_ms": round(1000 * percentile(high, 50), 2),
        "high_p99_ms": round(1000 * percentile(high, 99), 2),
        "low_p50_ms": round(1000 * percentile(low, 50), 2),
        "low_p99_ms": round(1000 * percentile(low, 99), 2),
        "flood_items_per_s": round(len(low) / seconds, 1),
        "high_requests": len(high),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", default="benchmarks/results/priority.json")
    args = parser.parse_args()
    results = [asyncio.run(_run(levels, args.seconds)) for levels in (0, 2)]
    print(f"{'levels':<7} {'high p50':>9} {'high p99':>9} {'low p50':>8} {'low p99':>8} {'flood/s':>8}")
    for r in results:
        print(f"{r['priority_levels']:<7} {r['high_p50_ms']:>9} {r['high_p99_ms']:>9} "
              f"{r['low_p50_ms']:>8} {r['low_p99_ms']:>8} {r['flood_items_per_s']:>8}")
    save(args.out, {"flood_callers": FLOOD_CALLERS, "seconds": args.seconds, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
