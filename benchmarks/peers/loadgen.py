#!/usr/bin/env python3
"""Closed-loop load generator: N concurrent workers, ONE item per request.

Identical for every peer: the request stream is a seeded pool of items (token
lengths uniform in [8, 128]) that is encoded for the peer's protocol *before*
the clock starts; workers take the next pooled body from one shared cursor,
POST it, read the whole response and check the status.  Responses are not
decoded during the run (the correctness check in ``run.py`` decodes them), so
the client costs the same few microseconds per request for every peer.

Timeline: warm-up for ``--warmup`` s (not recorded), then measure for
``--duration`` s.  Throughput = successful requests completed inside the
window / window length; latencies are those of requests completed inside the
window.  At the end of the window workers stop issuing and in-flight requests
are drained (not counted).  The server's batch counters are snapshotted at
both window edges so the mean *executed* batch size covers the window only.

    python loadgen.py --url http://127.0.0.1:8000 --protocol msgpack \
        --concurrency 32 --warmup 3 --duration 15 --stats-url .../stats
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from protocols import PROTOCOLS, make_items

DEFAULT_POOL = 2048


def batch_counters(stats: Any) -> tuple[float | None, float | None, float | None]:
    """(batches, items, avg) from a stats document, whichever are present.

    Understands the peers' stats file ({"batches", "items"}) and tensorserve's
    ``GET /v2/models/<m>/stats`` JSON (``batching`` section).
    """
    if not isinstance(stats, dict):
        return None, None, None
    sections = [stats]
    b = stats.get("batching")
    if isinstance(b, dict):
        sections.insert(0, b)
    batches = items = avg = None
    for sec in sections:
        for key in ("batches", "total_batches", "num_batches", "executed_batches"):
            if batches is None and isinstance(sec.get(key), (int, float)):
                batches = float(sec[key])
        # tensorserve: batch_items = items that reached the model (total_items
        # also counts rejected ones)
        for key in ("batch_items", "items", "executed_items", "num_items", "total_items"):
            if items is None and isinstance(sec.get(key), (int, float)):
                items = float(sec[key])
        if avg is None and isinstance(sec.get("avg_batch_size"), (int, float)):
            avg = float(sec["avg_batch_size"])
    return batches, items, avg


def read_stats_files(pattern: str) -> Any:
    """Read one stats file, or sum several (a glob: one file per worker process)."""
    paths = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    docs = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
    if not docs:
        return None
    if len(docs) == 1:
        return docs[0]
    hist: dict[str, int] = {}
    for d in docs:
        for k, v in d.get("hist", {}).items():
            hist[k] = hist.get(k, 0) + v
    return {"batches": sum(d.get("batches", 0) for d in docs),
            "items": sum(d.get("items", 0) for d in docs),
            "hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "files": len(docs)}


class StatsSource:
    def __init__(self, url: str | None = None, path: str | None = None) -> None:
        self.url, self.path = url, path

    async def snapshot(self, session: aiohttp.ClientSession) -> Any:
        try:
            if self.url:
                async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return json.loads(await r.read())
            if self.path:
                return read_stats_files(self.path)
        except Exception as exc:  # stats are best-effort
            return {"error": repr(exc)}
        return None


def mean_batch(before: Any, after: Any) -> dict[str, Any]:
    b0, i0, _ = batch_counters(before)
    b1, i1, avg1 = batch_counters(after)
    out: dict[str, Any] = {"before": before, "after": after}
    if None not in (b0, i0, b1, i1) and b1 > b0:
        out.update(batches=b1 - b0, items=i1 - i0, mean=(i1 - i0) / (b1 - b0), how="window")
    elif avg1 is not None:
        out.update(mean=avg1, how="cumulative avg_batch_size")
    else:
        out.update(mean=None, how="unavailable")
    return out


async def run_load(url: str, protocol: str, concurrency: int, duration: float,
                   warmup: float = 3.0, pad_to: int | None = None, seed: int = 1234,
                   pool_size: int = DEFAULT_POOL, timeout: float = 30.0,
                   stats: StatsSource | None = None) -> dict[str, Any]:
    proto = PROTOCOLS[protocol]
    items = make_items(pool_size, seed=seed)
    target = url.rstrip("/") + proto.path
    # identity: no peer may spend CPU gzip-ing responses the others send raw
    base_headers = {"Content-Type": proto.content_type, "Accept-Encoding": "identity"}
    pool: list[tuple[bytes, dict[str, str]]] = []
    for ids in items:  # pre-encode everything before the clock starts
        body, extra = proto.encode(ids, pad_to)
        pool.append((body, {**base_headers, **extra} if extra else base_headers))

    cursor = 0
    latencies: list[float] = []
    ok = 0
    errors = 0
    errors_in_window = 0
    error_samples: dict[str, int] = {}
    # perf_counter, not loop.time(): uvloop's clock has millisecond resolution
    clock = time.perf_counter
    t_start = clock()
    t_m0 = t_start + warmup
    t_m1 = t_m0 + duration

    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency,
                                     force_close=False, enable_cleanup_closed=False)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout,
                                     skip_auto_headers=("User-Agent",)) as session:

        async def worker() -> None:
            nonlocal cursor, ok, errors, errors_in_window
            now = clock
            while True:
                t0 = now()
                if t0 >= t_m1:
                    return
                body, headers = pool[cursor % pool_size]
                cursor += 1
                err = None
                try:
                    async with session.post(target, data=body, headers=headers) as resp:
                        payload = await resp.read()
                        if resp.status != 200:
                            err = f"HTTP {resp.status}: {payload[:200]!r}"
                except Exception as exc:  # noqa: BLE001 - any failure is an error
                    err = f"{type(exc).__name__}: {exc}"[:240]
                t1 = now()
                in_window = t_m0 <= t1 <= t_m1
                if err is None:
                    if in_window:
                        ok += 1
                        latencies.append(t1 - t0)
                else:
                    errors += 1
                    if in_window:
                        errors_in_window += 1
                    if len(error_samples) < 5 or err in error_samples:
                        error_samples[err] = error_samples.get(err, 0) + 1
                    if t1 - t0 < 0.001:
                        await asyncio.sleep(0.001)  # don't spin on instant failures

        stats_before = stats_after = None

        async def snapshots() -> None:
            nonlocal stats_before, stats_after
            await asyncio.sleep(max(0.0, t_m0 - clock()))
            if stats:
                stats_before = await stats.snapshot(session)
            await asyncio.sleep(max(0.0, t_m1 - clock()))
            if stats:
                stats_after = await stats.snapshot(session)

        snap = asyncio.create_task(snapshots())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await snap

    lat_ms = np.asarray(latencies) * 1e3
    res: dict[str, Any] = {
        "protocol": protocol, "pad_to": pad_to, "concurrency": concurrency,
        "warmup_s": warmup, "duration_s": duration, "seed": seed,
        "ok": ok, "errors": errors_in_window, "errors_total": errors,
        "error_samples": error_samples,
        "items_per_s": ok / duration,
        "p50_ms": float(np.percentile(lat_ms, 50)) if ok else None,
        "p90_ms": float(np.percentile(lat_ms, 90)) if ok else None,
        "p99_ms": float(np.percentile(lat_ms, 99)) if ok else None,
        "mean_ms": float(lat_ms.mean()) if ok else None,
    }
    if stats:
        res["batch"] = mean_batch(stats_before, stats_after)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--protocol", choices=sorted(PROTOCOLS), required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--pad-to", type=int, default=None, help="client-side padding length")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--pool", type=int, default=DEFAULT_POOL)
    ap.add_argument("--stats-url", default=None)
    ap.add_argument("--stats-file", default=None)
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    try:  # cheaper client event loop where available (same for every peer)
        import uvloop  # type: ignore[import-not-found]
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    stats = None
    if args.stats_url or args.stats_file:
        stats = StatsSource(args.stats_url, args.stats_file)
    t = time.time()
    res = runner(run_load(args.url, args.protocol, args.concurrency, args.duration,
                               args.warmup, args.pad_to, args.seed, args.pool, stats=stats))
    res["wall_s"] = time.time() - t
    text = json.dumps(res, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
