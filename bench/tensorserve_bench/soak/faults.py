"""The fault soak: steady callers of good items against a real server, with
and without one bad request every ``bad_every_s`` mixed in (the kinds of
``requests.FAULT_KINDS``).

    result = run("thread", seconds=20)     # benchmarks/soak.py prints and saves it
    assert not failures(result)

Per load (``without_bad``, ``with_bad``): good sent / correct / failed (by
status) / lost / hung, good items per second, and the statuses each kind of
bad request got. ``correct`` is checked (y = 2x, every row its caller's
own); ``lost`` is a connection that broke or a request with no response;
``hung`` is no answer within ``HUNG_AFTER_S``. The invariant
(docs/reliability.md): 0 lost, 0 hung, 0 good items failed; the goal beside
it: good throughput with the bad traffic at least 80% of the same load
without it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tensorserve_bench.rawhttp import RawHttpPool
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.soak.model import NAME, ROUTE, write_soak_model
from tensorserve_bench.soak.requests import (
    FAULT_KINDS,
    MSGPACK,
    THREAD_KINDS,
    answered_correctly,
    fault_body,
    good_body,
    good_item,
    status_of,
)

HUNG_AFTER_S = 30.0
CALLERS = 16


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
        }  # fmt: skip


async def _good_caller(url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    pool = RawHttpPool(url)
    try:
        while time.monotonic() < until:
            x = good_item(rng)
            tally.sent += 1
            request = pool.request(ROUTE, good_body(x), MSGPACK)
            try:
                response = await asyncio.wait_for(pool.exchange(request), HUNG_AFTER_S)
            except asyncio.TimeoutError:
                tally.hung += 1
                pool = RawHttpPool(url)
                continue
            except (OSError, EOFError, asyncio.IncompleteReadError):
                tally.lost += 1
                pool = RawHttpPool(url)
                continue
            if response.status != 200:
                tally.failed[status_of(response.status, response.body)] += 1
            elif answered_correctly(response.body, x):
                tally.correct += 1
            else:
                tally.failed["200 wrong rows"] += 1
    finally:
        await pool.close()


async def _bad_caller(
    url: str, kinds: tuple[str, ...], until: float, tally: Tally, every_s: float
) -> None:
    rng = random.Random(99)
    pool = RawHttpPool(url)
    turn = 0
    try:
        while time.monotonic() < until - 1:
            kind = kinds[turn % len(kinds)]
            turn += 1
            request = pool.request(ROUTE, fault_body(kind, rng), MSGPACK)
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
                    codes[status_of(response.status, response.body)] += 1
                except asyncio.TimeoutError:
                    codes["hung"] += 1
                    tally.hung += 1
                except (OSError, EOFError, asyncio.IncompleteReadError):
                    codes["lost"] += 1
                    tally.lost += 1
                    pool = RawHttpPool(url)
            await asyncio.sleep(every_s)
    finally:
        await pool.close()


async def load(
    url: str,
    seconds: float,
    kinds: tuple[str, ...] | None,
    *,
    callers: int = CALLERS,
    bad_every_s: float = 1.0,
) -> dict[str, Any]:
    """``callers`` good callers for ``seconds``; with ``kinds``, a bad caller
    beside them sending those kinds in turn, one every ``bad_every_s``
    (stopping a second before the good ones)."""
    tally = Tally()
    # The first body imports the server's codec (seconds on a busy machine):
    # before the clock, or the first caller's import eats a short run.
    good_body(good_item(random.Random(0)))
    started = time.monotonic()
    until = started + seconds
    work = [_good_caller(url, seed, until, tally) for seed in range(callers)]
    if kinds:
        work.append(_bad_caller(url, kinds, until, tally, bad_every_s))
    await asyncio.gather(*work)
    return tally.as_dict(time.monotonic() - started)


def run(
    isolation: str,
    seconds: float,
    only: list[str] | None = None,
    *,
    callers: int = CALLERS,
    bad_every_s: float = 1.0,
    cost: str = "cpu",
) -> dict[str, Any]:
    """One server with the soak model in ``isolation`` whose forward costs
    ``cost`` (a key of ``model.COSTS``); the same load without, then with, the
    bad requests (``only`` these kinds, if given)."""
    with tempfile.TemporaryDirectory() as repo:
        write_soak_model(repo, isolation=isolation, cost=cost)
        server = ServerProcess(repo, ("--log-level", "ERROR"), sample_interval=0.1).start()
        try:
            kinds = tuple(FAULT_KINDS) if isolation == "process" else THREAD_KINDS
            kinds = tuple(k for k in kinds if only is None or k in only)
            if isolation == "process":  # let the standby worker load before measuring
                time.sleep(5)
            options: dict[str, Any] = {"callers": callers, "bad_every_s": bad_every_s}
            clean = asyncio.run(load(server.url, seconds, None, **options))
            mixed = asyncio.run(load(server.url, seconds, kinds, **options))
            ready = _ready(server.url)
            recoveries = _recoveries(server.url)
            peak_rss = server.peak_rss_bytes
        finally:
            server.stop()
    return {
        "isolation": isolation, "cost": cost, "without_bad": clean, "with_bad": mixed,
        "ratio": mixed["good_per_s"] / clean["good_per_s"] if clean["good_per_s"] else 0.0,
        "ready_after": ready, "peak_rss_mb": peak_rss / 2**20, "recoveries": recoveries,
    }  # fmt: skip


def failures(result: dict[str, Any]) -> dict[str, Any]:
    """What broke the invariant in one ``run``'s result (empty: nothing):
    good requests lost, hung or failed, in either load."""
    broken = {}
    for load_name in ("without_bad", "with_bad"):
        counts = result[load_name]
        found = {k: counts[k] for k in ("lost", "hung", "good_failed") if counts[k]}
        if found:
            broken[load_name] = found
    return broken


def _recoveries(url: str) -> dict[str, int]:
    """The failed batches the server recovered, by kind (both loads)."""
    with urllib.request.urlopen(f"{url}/v2/models/{NAME}/stats", timeout=5) as response:
        return dict(json.load(response)["batching"]["recoveries"])


def _ready(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
