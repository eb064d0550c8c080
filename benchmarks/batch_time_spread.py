#!/usr/bin/env python3
"""How much slower than "the slowest batch so far" a healthy model's batch
gets: the evidence behind the watchdog's factors (``STALL_FACTOR``, the
readiness "stalled" line, and ``AUTO_FACTOR``, the "auto" watchdog's kill
line, in tensorserve/batching/watchdog.py). One command:

    python benchmarks/batch_time_spread.py [--models tagger ...] [--seconds 20]

Each bundled model runs in this process (its own scheduler, as served) under
closed-loop callers of one-item requests of mixed lengths (8..128 tokens, or
pixels a side), first on a quiet host, then beside a noisy neighbour: one
process spinning per CPU (the container's quota shared) plus a caller-side
garbage collector churning objects. Every batch's seconds are divided by the
slowest batch seen before it, the figure the watchdog judges by; the noisy
phase is judged by what the quiet one taught (noise that arrives later is
the case that could trip a threshold). The first ``--settle`` batches after
warm-up are left out: the slowest-so-far starts at zero and grows as traffic
forms larger batches (the watchdog's floors, ``STALL_MIN_S`` and
``AUTO_MIN_S``, cover that start).

Prints a table and saves benchmarks/results/batch_time_spread.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tensorserve_bench.items import ItemFactory, specs_from_config
from tensorserve_bench.lengths import uniform
from tensorserve_bench.results import save

from tensorserve import ServedModel

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
MODELS = ("tagger", "attention_tagger", "gru_tagger", "embedder", "image_filter")


def spin(stop: Any) -> None:
    """A neighbour that wants a whole CPU."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def churn(stop: threading.Event) -> None:
    """Garbage for the collector: cycles, so full passes have work (in the
    model's own process, as a busy server's heap would)."""
    while not stop.is_set():
        junk = []
        for _ in range(20_000):
            node: list[Any] = []
            node.append(node)
            junk.append(node)
        del junk


def run_phase(
    model: ServedModel,
    items: list[dict[str, np.ndarray]],
    callers: int,
    seconds: float,
    settle: int,
    noisy: bool,
) -> list[float]:
    """Each batch's seconds over the slowest before it, past the settling batches."""
    scheduler = model.batcher.scheduler
    observe = scheduler.slowest.observe
    ratios: list[float] = []
    seen = 0

    def watched(batch_s: float) -> None:
        nonlocal seen
        before = scheduler.slowest.seconds()
        seen += 1
        if seen > settle and before > 0:
            ratios.append(batch_s / before)
        observe(batch_s)

    scheduler.slowest.observe = watched  # type: ignore[method-assign]
    if not noisy:  # the noise arrives later, judged by what the quiet time taught
        model.batcher.warmed_up()
    stop, neighbours = threading.Event(), []
    stop_spin = multiprocessing.Event()
    if noisy:
        neighbours = [
            multiprocessing.Process(target=spin, args=(stop_spin,), daemon=True)
            for _ in range(os.cpu_count() or 1)
        ]
        for process in neighbours:
            process.start()
        threading.Thread(target=churn, args=(stop,), daemon=True).start()
    deadline = time.monotonic() + seconds

    def caller(index: int) -> None:
        rng = np.random.default_rng(index)
        while time.monotonic() < deadline:
            model.submit_many([items[int(rng.integers(len(items)))]])[0].result(timeout=60)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    stop_spin.set()
    for process in neighbours:
        process.join(timeout=5)
    scheduler.slowest.observe = observe  # type: ignore[method-assign]
    return ratios


def summary(model: str, host: str, ratios: list[float]) -> dict[str, Any]:
    values = np.asarray(ratios) if ratios else np.asarray([0.0])
    return {
        "model": model, "host": host, "load_average": os.getloadavg()[0], "batches": len(ratios),
        "p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
        "p999": float(np.percentile(values, 99.9)), "max": float(values.max()),
        "over_2x": int((values > 2).sum()), "over_4x": int((values > 4).sum()),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--settle", type=int, default=50, help="batches left out after warm-up")
    parser.add_argument("--out", default="benchmarks/results/batch_time_spread.json")
    args = parser.parse_args()

    rows = []
    print(
        f"{'model':<17} {'host':<6} {'batches':>7} {'p50':>6} {'p99':>6} {'p99.9':>6} "
        f"{'max':>6} {'>2x':>5} {'>4x':>5}"
    )
    for name in args.models:
        with ServedModel.from_repository(REPOSITORY, name) as model:
            specs = specs_from_config(model.config.model_dump())
            items, _ = ItemFactory(specs, uniform(8, 128), seed=7, id_range=(1, 4096)).make(256)
            for host in ("quiet", "noisy"):
                noisy = host == "noisy"
                ratios = run_phase(
                    model, items, args.callers, args.seconds, 0 if noisy else args.settle, noisy
                )
                rows.append(summary(name, host, ratios))
                r = rows[-1]
                print(
                    f"{name:<17} {host:<6} {r['batches']:>7} {r['p50']:>6.2f} {r['p99']:>6.2f} "
                    f"{r['p999']:>6.2f} {r['max']:>6.2f} {r['over_2x']:>5} {r['over_4x']:>5}",
                    flush=True,
                )
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    save(
        args.out,
        {
            "command": " ".join(sys.argv),
            "commit": commit,
            "seconds": args.seconds,
            "callers": args.callers,
            "settle": args.settle,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
