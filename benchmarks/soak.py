#!/usr/bin/env python3
"""Fault soak: 16 steady callers of good items against a real server, with
and without one bad request per second mixed in — a poisoned item, an item
whose padded batch runs out of memory, one too large to fit even alone, a
deadline that cannot be met, a caller that leaves, and (process isolation)
an item that kills its worker. One command, about two minutes:

    python benchmarks/soak.py [--seconds 20] [--out benchmarks/results/soak.json]

For each isolation (thread, process) it runs the same load twice, without
and with the bad traffic, and prints per run:

    good sent / correct / failed (by status) / lost / hung, good items per second
    bad sent, by kind, and the statuses they got

``correct`` is checked (y = 2x, every row its caller's own); ``lost`` is a
connection that broke or a request with no response; ``hung`` is no answer
within HUNG_AFTER_S. The goals (docs/reliability.md): 0 lost, 0 hung, 0 good
items failed, and good throughput with the bad traffic at least 80% of the
same run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from tensorserve.bench.rawhttp import RawHttpPool
from tensorserve.bench.repositories import write_xy_model
from tensorserve.bench.results import save
from tensorserve.bench.server import ServerProcess

# The model misbehaves on marker values in an item's first element. Its
# "memory" holds a padded batch of at most MEMORY_ELEMENTS elements.
MODEL = """
import os
import time
import torch

MEMORY_ELEMENTS = 4096


class Model(torch.nn.Module):
    def forward(self, x):
        first = x[:, 0, 0]
        if (first == 13).any():
            raise RuntimeError("poison value 13 in batch")
        if (first == 7).any():
            os._exit(7)  # kills the worker (process isolation only)
        if (first == 55).any():
            time.sleep(0.02)  # slow: the caller's 5 ms deadline passes
        if x.numel() > MEMORY_ELEMENTS:
            raise torch.OutOfMemoryError(f"tried to allocate {x.numel()} elements")
        time.sleep(0.001 + 0.00002 * x.shape[0])  # a model that costs something
        return x * 2
"""
CONFIG = """
max_batch_size = 16
isolation = "{isolation}"
[dynamic_batching]
max_queue_delay_ms = 2.0
"""
ROUTE = "/v2/models/soak/infer"
MSGPACK = "application/msgpack"
HUNG_AFTER_S = 30.0
CALLERS = 16
GOOD_LENGTHS = (4, 32)  # 16 items pad to at most 16 x 32 x 4 = 2048 elements: they fit
BAD_KINDS_THREAD = ("poison", "oom_split", "oom_alone", "deadline", "disconnect")
BAD_KINDS_PROCESS = (*BAD_KINDS_THREAD, "worker_kill")


def _body(x: np.ndarray, **extra: Any) -> bytes:
    tensor = {"dtype": "float32", "shape": list(x.shape), "data": x.tobytes()}
    return msgpack.packb({"items": [{"x": tensor}], **extra})


def _bad_item(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
    """The bad request's item and extra body fields."""
    x = rng.uniform(20, 100, size=(8, 4)).astype(np.float32)
    if kind == "poison":
        x[0, 0] = 13
    elif kind == "worker_kill":
        x[0, 0] = 7
    elif kind == "oom_split":  # fits alone (3200), not padded with company
        x = rng.uniform(20, 100, size=(800, 4)).astype(np.float32)
    elif kind == "oom_alone":  # 8000 elements: never fits
        x = rng.uniform(20, 100, size=(2000, 4)).astype(np.float32)
    elif kind == "deadline":
        x[0, 0] = 55
        return x, {"parameters": {"timeout_ms": 5}}
    return x, {}


@dataclass
class Tally:
    sent: int = 0
    correct: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    hung: int = 0
    bad: dict[str, collections.Counter[str]] = field(default_factory=dict)

    def as_dict(self, seconds: float) -> dict[str, Any]:
        return {
            "good_sent": self.sent, "good_correct": self.correct,
            "good_failed": dict(self.failed), "lost": self.lost, "hung": self.hung,
            "good_per_s": self.correct / seconds,
            "bad": {kind: dict(codes) for kind, codes in self.bad.items()},
        }


def _status(response: Any) -> str:
    code = ""
    try:
        code = msgpack.unpackb(response.body).get("code", "")
    except Exception:  # noqa: BLE001 - a body that is not ours: the status says enough
        pass
    return f"{response.status} {code}".strip()


async def _good_caller(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    pool = RawHttpPool(url)
    try:
        while time.monotonic() < until:
            x = rng.uniform(20, 100, size=(int(rng.integers(*GOOD_LENGTHS)), 4)).astype(np.float32)
            tally.sent += 1
            try:
                response = await asyncio.wait_for(
                    pool.exchange(pool.request(ROUTE, _body(x), MSGPACK)), HUNG_AFTER_S
                )
            except asyncio.TimeoutError:
                tally.hung += 1
                pool = RawHttpPool(url)
                continue
            except (OSError, EOFError, asyncio.IncompleteReadError):
                tally.lost += 1
                pool = RawHttpPool(url)
                continue
            if response.status != 200:
                tally.failed[_status(response)] += 1
                continue
            output = msgpack.unpackb(response.body)["outputs"][0]["y"]
            y = np.frombuffer(output["data"], np.float32).reshape(output["shape"])
            if y.shape == x.shape and np.array_equal(y, x * 2):
                tally.correct += 1
            else:
                tally.failed["200 wrong rows"] += 1
    finally:
        await pool.close()


async def _bad_caller(url: str, kinds: tuple[str, ...], until: float, tally: Tally) -> None:
    rng = np.random.default_rng(99)
    pool = RawHttpPool(url)
    turn = 0
    try:
        while time.monotonic() < until - 1:
            kind = kinds[turn % len(kinds)]
            turn += 1
            x, extra = _bad_item(kind, rng)
            request = pool.request(ROUTE, _body(x, **extra), MSGPACK)
            codes = tally.bad.setdefault(kind, collections.Counter())
            if kind == "disconnect":  # send it, then leave before the answer
                _, writer = await asyncio.open_connection(pool.host, pool.port)
                writer.write(request)
                await writer.drain()
                writer.close()
                codes["left"] += 1
            else:
                try:
                    response = await asyncio.wait_for(pool.exchange(request), HUNG_AFTER_S)
                    codes[_status(response)] += 1
                except asyncio.TimeoutError:
                    codes["hung"] += 1
                    tally.hung += 1
                except (OSError, EOFError, asyncio.IncompleteReadError):
                    codes["lost"] += 1
                    tally.lost += 1
                    pool = RawHttpPool(url)
            await asyncio.sleep(1.0)
    finally:
        await pool.close()


async def _load(url: str, seconds: float, kinds: tuple[str, ...] | None) -> dict[str, Any]:
    tally = Tally()
    started = time.monotonic()
    until = started + seconds
    callers = [_good_caller(url, seed, until, tally) for seed in range(CALLERS)]
    if kinds:
        callers.append(_bad_caller(url, kinds, until, tally))
    await asyncio.gather(*callers)
    return tally.as_dict(time.monotonic() - started)


def run(isolation: str, seconds: float, only: list[str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as repo:
        write_xy_model(repo, "soak", MODEL, CONFIG.format(isolation=isolation))
        server = ServerProcess(repo, ("--log-level", "ERROR"), sample_interval=0.1).start()
        try:
            kinds = BAD_KINDS_PROCESS if isolation == "process" else BAD_KINDS_THREAD
            kinds = tuple(k for k in kinds if only is None or k in only)
            if isolation == "process":  # let the standby worker load before measuring
                time.sleep(5)
            clean = asyncio.run(_load(server.url, seconds, None))
            mixed = asyncio.run(_load(server.url, seconds, kinds))
            ready = _ready(server.url)
            peak_rss = server.peak_rss_bytes
        finally:
            server.stop()
    return {
        "isolation": isolation, "without_bad": clean, "with_bad": mixed,
        "ratio": mixed["good_per_s"] / clean["good_per_s"] if clean["good_per_s"] else 0.0,
        "ready_after": ready, "peak_rss_mb": peak_rss / 2**20,
    }


def _ready(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _print(results: list[dict[str, Any]]) -> None:
    print(f"{'isolation':<9} {'bad':<4} {'sent':>6} {'correct':>7} {'failed':>6} {'lost':>4} "
          f"{'hung':>4} {'good/s':>7}  bad requests (kind: statuses)")
    for result in results:
        for label, run_ in (("no", result["without_bad"]), ("yes", result["with_bad"])):
            failed = sum(run_["good_failed"].values())
            bad = "; ".join(f"{k}: {dict(v)}" for k, v in run_["bad"].items()) or "-"
            print(f"{result['isolation']:<9} {label:<4} {run_['good_sent']:>6} "
                  f"{run_['good_correct']:>7} {failed:>6} {run_['lost']:>4} {run_['hung']:>4} "
                  f"{run_['good_per_s']:>7.1f}  {bad}")
        print(f"{'':<9} good throughput with bad traffic: {100 * result['ratio']:.0f}% of without; "
              f"ready afterwards: {result['ready_after']}; peak RSS {result['peak_rss_mb']:.0f} MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument("--isolation", choices=["thread", "process", "both"], default="both")
    parser.add_argument("--kinds", nargs="+", choices=BAD_KINDS_PROCESS,
                        help="only these kinds of bad request (default: all that apply)")
    parser.add_argument("--out", default="benchmarks/results/soak.json")
    args = parser.parse_args()
    modes = ["thread", "process"] if args.isolation == "both" else [args.isolation]
    results = [run(mode, args.seconds, args.kinds) for mode in modes]
    _print(results)
    save(args.out, {"callers": CALLERS, "seconds": args.seconds, "kinds": args.kinds or "all",
                    "results": results})
    bad = any(r["with_bad"]["lost"] or r["with_bad"]["hung"] or r["with_bad"]["good_failed"]
              for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
