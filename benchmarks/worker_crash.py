#!/usr/bin/env python3
"""What a worker crash costs a model (``isolation = "process"``): the time from
the worker's death (SIGKILL) until a request sent right after it is answered,
with and without the standby worker (a swap), and with and without the worker
template (a fork of a loaded process, or a new process that loads the model).

    python benchmarks/worker_crash.py [--rounds 5] [--out benchmarks/results/worker_crash.json]

"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

import numpy as np
import psutil
from tensorserve_bench.repositories import write_xy_model
from tensorserve_bench.results import save

from tensorserve import ServedModel

MODEL = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2
"""
CONFIG = """
max_batch_size = 8
isolation = "process"
device = "cpu"
[faults]
standby_worker = {standby}
worker_template = {template}
"""


def _standby_ready(model: ServedModel) -> bool:
    standby = model.executor.standby  # type: ignore[attr-defined]
    return standby is None or standby.ready is not None


def measure(standby: bool, template: bool, rounds: int) -> dict[str, object]:
    item = {"x": np.ones((3, 4), np.float32)}
    unavailable, loads = [], []
    with tempfile.TemporaryDirectory() as repo:
        settings = CONFIG.format(standby=str(standby).lower(), template=str(template).lower())
        write_xy_model(repo, "m", MODEL, settings)
        with ServedModel.from_repository(repo, "m") as model:
            for _ in range(rounds):
                started = time.monotonic()
                while not _standby_ready(model):
                    time.sleep(0.01)
                if standby:
                    loads.append(time.monotonic() - started)
                model.infer_sync(item)
                pid = model.executor.workers[0].pid  # type: ignore[attr-defined]
                died = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                psutil.Process(pid).wait(30)  # it is dead (our child, or the template's)
                answer = model.infer_sync(item, timeout=120)
                unavailable.append(time.perf_counter() - died)
                assert answer["y"][0, 0] == 2.0
    return {
        "standby": standby,
        "template": template,
        "unavailable_ms": [round(1000 * s, 1) for s in unavailable],
        "median_unavailable_ms": round(1000 * statistics.median(unavailable), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/worker_crash.json")
    args = parser.parse_args()
    results = [measure(standby, template, args.rounds)
               for standby, template in ((True, True), (False, True), (True, False), (False, False))]
    print(f"{'standby':<8} {'template':<9} {'median ms':>10}  each round (ms): worker killed -> "
          f"next request answered")
    for r in results:
        print(f"{r['standby']!s:<8} {r['template']!s:<9} {r['median_unavailable_ms']:>10}  "
              f"{r['unavailable_ms']}")
    save(args.out, {"rounds": args.rounds, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
