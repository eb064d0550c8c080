"""Per-request overhead of the HTTP libraries the Python client could use.

Sends the same small msgpack infer request (tagger, 8 tokens) to a running
tensorserve one request at a time with keep-alive, and reports the median
wall time per request and the client process's CPU time per request for:

    httpx.Client (sync)   httpx.AsyncClient   aiohttp.ClientSession
    aiohttp.ClientSession driven from a synchronous caller through one
    event loop running on a background thread (how a sync client on aiohttp
    must work: one loop for the client's lifetime, never one per call)

and, as a floor, ``http.client`` from the standard library. The CPU column is
what the library itself costs the client; the wall column includes the
server. This is how the client's one HTTP library was chosen (docs/client.md).

    python -m tensorserve serve &            # in another shell
    python benchmarks/client_transport.py --url http://127.0.0.1:8000

Results are printed as a table and saved as JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import platform
import statistics
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import msgpack
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
HEADERS = {"Content-Type": "application/msgpack"}


def small_body(tokens: int) -> bytes:
    ids = np.arange(1, tokens + 1, dtype=np.int64)
    item = {
        name: {"dtype": "int64", "shape": [tokens], "data": array.tobytes()}
        for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids)))
    }
    return msgpack.packb({"items": [item]})


def measure(send: Callable[[], None], n: int) -> dict[str, float]:
    for _ in range(max(20, n // 10)):  # warm up: connection, allocator, server caches
        send()
    walls = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        send()
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    return {
        "wall_median_us": statistics.median(walls) * 1e6,
        "wall_p90_us": float(np.percentile(walls, 90)) * 1e6,
        "cpu_per_request_us": cpu / n * 1e6,
    }


async def measure_async(send: Callable[[], Awaitable[None]], n: int) -> dict[str, float]:
    for _ in range(max(20, n // 10)):
        await send()
    walls = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await send()
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    return {
        "wall_median_us": statistics.median(walls) * 1e6,
        "wall_p90_us": float(np.percentile(walls, 90)) * 1e6,
        "cpu_per_request_us": cpu / n * 1e6,
    }


def run(url: str, path: str, body: bytes | None, n: int) -> dict[str, dict[str, float]]:
    method = "POST" if body is not None else "GET"
    results: dict[str, dict[str, float]] = {}

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port)

    def stdlib() -> None:
        conn.request(method, path, body=body, headers=HEADERS if body else {})
        response = conn.getresponse()
        response.read()
        assert response.status == 200, response.status

    results["http.client (stdlib floor)"] = measure(stdlib, n)
    conn.close()

    with httpx.Client(base_url=url) as client:

        def httpx_sync() -> None:
            r = client.request(method, path, content=body, headers=HEADERS if body else None)
            assert r.status_code == 200, r.status_code

        results["httpx.Client"] = measure(httpx_sync, n)

    async def async_libs() -> None:
        async with httpx.AsyncClient(base_url=url) as client:

            async def httpx_async() -> None:
                r = await client.request(
                    method, path, content=body, headers=HEADERS if body else None
                )
                assert r.status_code == 200, r.status_code

            results["httpx.AsyncClient"] = await measure_async(httpx_async, n)

        async with aiohttp.ClientSession(base_url=url) as session:

            async def aiohttp_async() -> None:
                async with session.request(
                    method, path, data=body, headers=HEADERS if body else None
                ) as r:
                    await r.read()
                    assert r.status == 200, r.status

            results["aiohttp.ClientSession"] = await measure_async(aiohttp_async, n)

    asyncio.run(async_libs())

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(base_url=url)

    session = asyncio.run_coroutine_threadsafe(open_session(), loop).result()

    async def request_once() -> None:
        async with session.request(method, path, data=body, headers=HEADERS if body else None) as r:
            await r.read()
            assert r.status == 200, r.status

    def aiohttp_bridge() -> None:
        asyncio.run_coroutine_threadsafe(request_once(), loop).result()

    results["aiohttp via loop thread (sync)"] = measure(aiohttp_bridge, n)
    asyncio.run_coroutine_threadsafe(session.close(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    if body is not None:
        results.update(run_tensorserve_client(url, path, body, n))
    return results


def run_tensorserve_client(url: str, path: str, body: bytes, n: int) -> dict[str, dict[str, float]]:
    """The shipped client on the same request: transport + codec + retry logic."""
    try:
        from tensorserve_client import AsyncClient, Client
    except ImportError:
        return {}
    model = path.split("/")[3]
    item = msgpack.unpackb(body)["items"][0]
    features = {
        k: np.frombuffer(v["data"], v["dtype"]).reshape(v["shape"]) for k, v in item.items()
    }
    results = {}
    with Client(url) as client:
        results["tensorserve_client.Client"] = measure(lambda: client.infer(model, features), n)

    async def run_async() -> None:
        async with AsyncClient(url) as client:

            async def once() -> None:
                await client.infer(model, features)

            results["tensorserve_client.AsyncClient"] = await measure_async(once, n)

    asyncio.run(run_async())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tagger")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("-n", type=int, default=2000, help="requests per library and endpoint")
    args = parser.parse_args()

    runs = {
        f"POST infer ({args.model}, {args.tokens} tokens)": (
            f"/v2/models/{args.model}/infer",
            small_body(args.tokens),
        ),
        "GET /v2/health/live": ("/v2/health/live", None),
    }
    report: dict[str, object] = {
        "url": args.url,
        "n": args.n,
        "python": platform.python_version(),
        "httpx": httpx.__version__,
        "aiohttp": aiohttp.__version__,
        "machine": platform.machine(),
        "results": {},
    }
    for title, (path, body) in runs.items():
        rows = run(args.url, path, body, args.n)
        report["results"][title] = rows  # type: ignore[index]
        print(f"\n{title}: {args.n} sequential requests, keep-alive")
        print(f"  {'library':<32} {'wall median':>12} {'wall p90':>10} {'client CPU':>11}")
        for name, row in rows.items():
            print(
                f"  {name:<32} {row['wall_median_us']:>10.0f}us {row['wall_p90_us']:>8.0f}us "
                f"{row['cpu_per_request_us']:>9.0f}us"
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "client_transport.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nsaved {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")


if __name__ == "__main__":
    main()
