#!/usr/bin/env python3
"""Overload soak: a real server on loopback under a flood, callers that leave,
deadlines that expire, oversized, malformed and trickled bodies, and a
SIGTERM in the middle of a flood. One command, about a minute and a half:

    python benchmarks/soak_overload.py [--out benchmarks/results/soak_overload.json]

Every request is classified by what its client saw:

    answered correctly   200 with the right output (y = 2x, checked)
    refused <status>     a well-formed refusal, by status and error code
    lost                 the connection broke, or closed without a response,
                         on a request the client did not abandon itself
    hung                 no response within HUNG_AFTER_S
    wrong                200 with a wrong output, or a 5xx for a malformed body

plus ``left`` (the client closed its connection on purpose) and, after the
SIGTERM's drain delay, ``not accepted`` (connection refused: the listening
socket is closed, as it should be once load balancers have stopped sending).
Prints a table and the peak RSS of the server and its worker processes
(sampled every 50 ms), and saves everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from tensorserve_bench.protocols import decode_error
from tensorserve_bench.rawhttp import RawHttpPool
from tensorserve_bench.repositories import write_xy_model
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess

MODEL = """
import time
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.002)  # a model that costs something: queues form under a flood
        return x * 2
"""
CONFIG = """
max_batch_size = 16
isolation = "process"
[dynamic_batching]
max_queue_delay_ms = 1.0
max_queue_size = 64
"""
MAX_REQUEST_BYTES = 1 << 16
BODY_TIMEOUT_S = 2.0
DRAIN_DELAY_S = 2.0
SHUTDOWN_GRACE_S = 5.0
HUNG_AFTER_S = 30.0
ROUTE = "/v2/models/echo/infer"
MSGPACK = "application/msgpack"


@dataclass
class Scenario:
    name: str
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())


def good_body(rng: random.Random, **parameters: Any) -> tuple[bytes, np.ndarray]:
    x = np.asarray(
        [[rng.uniform(-9, 9) for _ in range(4)] for _ in range(rng.randint(1, 24))], np.float32
    )
    message: dict[str, Any] = {"items": [{"x": x.tolist()}]}
    if parameters:
        message["parameters"] = parameters
    return msgpack.packb(message), x


def classify(status: int, body: bytes, expected: np.ndarray | None) -> str:
    if status == 200:
        if expected is None:
            return "wrong: 200 for a malformed body"
        y = msgpack.unpackb(body)["outputs"][0]["y"]
        got = np.frombuffer(y["data"], dtype=y["dtype"]).reshape(y["shape"])
        return "answered correctly" if np.array_equal(got, expected * 2) else "wrong: output"
    code = (decode_error(body) or {}).get("code", "?")  # the native protocol's errors, or JSON
    if status >= 500 and expected is None and status != 503:
        return f"wrong: {status} {code} for a malformed body"
    return f"refused {status} {code}"


async def exchange(
    pool: RawHttpPool, request: bytes, expected: np.ndarray | None
) -> tuple[str, bool]:
    """(outcome, whether the server closed the connection after answering)."""
    try:
        response = await asyncio.wait_for(pool.exchange(request), HUNG_AFTER_S)
    except asyncio.TimeoutError:
        return "hung", True
    except ConnectionRefusedError:
        return "not accepted (connection refused)", True
    except (ConnectionError, asyncio.IncompleteReadError, OSError):
        return "lost", True
    closes = response.headers.get("connection", "").lower() == "close"
    return classify(response.status, response.body, expected), closes


async def flood(
    url: str,
    scenario: Scenario,
    total: int,
    concurrency: int,
    make: Callable[[random.Random], tuple[bytes, np.ndarray | None]],
    content_type: str = MSGPACK,
    headers: dict[str, str] | None = None,
    removed: asyncio.Event | None = None,
) -> None:
    """``total`` requests from ``concurrency`` callers, each on its own
    keep-alive connection. With ``removed`` (a load balancer took the server
    out of rotation), a caller whose connection the server closed sends no more."""
    counter = iter(range(total))

    async def caller(seed: int) -> None:
        rng = random.Random(seed)
        pool = RawHttpPool(url)
        try:
            for _ in counter:
                body, expected = make(rng)
                request = pool.request(ROUTE, body, content_type, headers)
                outcome, closes = await exchange(pool, request, expected)
                scenario.outcomes[outcome] += 1
                if outcome.startswith("not accepted"):
                    return  # the server is gone: a load balancer sends elsewhere now
                if closes and removed is not None and removed.is_set():
                    return  # its next connection goes to another replica
                if outcome in ("lost", "hung"):
                    await pool.close()  # a fresh connection for the next one
                    pool = RawHttpPool(url)
        finally:
            await pool.close()

    await asyncio.gather(*(caller(seed) for seed in range(concurrency)))


async def leave(url: str, scenario: Scenario, total: int, concurrency: int) -> None:
    """Callers that send a request and close the connection before the answer."""
    host, port = RawHttpPool(url).host, RawHttpPool(url).port
    semaphore = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> None:
        async with semaphore:
            body, _ = good_body(random.Random(seed))
            _, writer = await asyncio.open_connection(host, port)
            writer.write(RawHttpPool(url).request(ROUTE, body, MSGPACK))
            await writer.drain()
            await asyncio.sleep(random.Random(seed).uniform(0, 0.005))
            writer.close()
            scenario.outcomes["left (closed by the client)"] += 1

    await asyncio.gather(*(one(seed) for seed in range(total)))


async def trickle(url: str, scenario: Scenario, total: int) -> None:
    """Bodies sent a byte every 100 ms: 408 after BODY_TIMEOUT_S."""
    pool = RawHttpPool(url)

    async def one(seed: int) -> None:
        body, _ = good_body(random.Random(seed))
        reader, writer = await asyncio.open_connection(pool.host, pool.port)
        request = pool.request(ROUTE, body, MSGPACK)
        head_end = request.index(b"\r\n\r\n") + 4
        writer.write(request[:head_end])

        async def drip() -> None:
            for byte in request[head_end:]:
                await asyncio.sleep(0.1)
                writer.write(bytes([byte]))

        dripping = asyncio.create_task(drip())
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HUNG_AFTER_S)
            status = int(head[9:12])
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            scenario.outcomes[classify(status, await reader.readexactly(length), None)] += 1
        except asyncio.TimeoutError:
            scenario.outcomes["hung"] += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            scenario.outcomes["lost"] += 1
        finally:
            dripping.cancel()
            writer.close()

    await asyncio.gather(*(one(seed) for seed in range(total)))


def malformed(rng: random.Random) -> tuple[bytes, None]:
    """A plausible native body with one thing wrong (or not msgpack at all)."""
    x = [[1.0, 2.0, 3.0, 4.0]]
    not_a_timeout: list[Any] = [True, -1, 0, 2**63, 1e300, float("nan"), float("inf"), "5", [5]]
    not_an_id: list[Any] = [True, 5, [], {}, b"id"]
    typed = {"dtype": "float32", "shape": [1, 4], "data": np.ones((1, 4), np.float32).tobytes()}
    junk: list[Any] = [
        None, True, -1, 2**63, 1e300, float("nan"), float("inf"), "x", [], {}, ["float32"],
        {"float32": 1}, [[1, 2], [3]], b"\x00" * 7,
    ]  # fmt: skip
    variants: list[Any] = [
        {"items": rng.choice(junk)},
        {"items": [rng.choice(junk)]},
        {"items": [{"x": rng.choice(junk)}]},
        {"items": [{"x": {**typed, "dtype": rng.choice(junk)}}]},
        {"items": [{"x": {**typed, "shape": rng.choice(junk)}}]},
        {"items": [{"x": {**typed, "shape": [rng.randint(0, 2**40), 4]}}]},
        {"items": [{"x": {**typed, "data": rng.choice(junk)}}]},
        {"items": [{"x": x, "extra": x}]},
        {"items": [{"x": [[1, 2, 3, 4, 5]]}]},
        {"items": [{"x": x}], "parameters": {"timeout_ms": rng.choice(not_a_timeout)}},
        {"items": [{"x": x}], "id": rng.choice(not_an_id)},
        rng.choice(junk),
    ]
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), None
    return msgpack.packb(rng.choice(variants)), None


def malformed_oip(rng: random.Random) -> tuple[bytes, None]:
    junk: list[Any] = [None, True, -1, 1e300, "FP32 ", [], {}, ["FP32"], {"FP32": 1}, [[1], [2, 3]]]
    good = {"name": "x", "datatype": "FP32", "shape": [1, 1, 4], "data": [1, 2, 3, 4]}
    key = rng.choice(["name", "datatype", "shape", "data"])
    variants: list[Any] = [
        {"inputs": [{**good, key: rng.choice(junk)}]},
        {"inputs": rng.choice(junk)},
        {"inputs": [good], "parameters": {"timeout": rng.choice(junk[1:])}},
        {"inputs": [good], "outputs": [{"name": rng.choice(junk)}]},
    ]
    return json.dumps(rng.choice(variants)).encode(), None


async def load_balancer(url: str, removed: asyncio.Event, every: float = 0.1) -> None:
    """Probes readiness like a load balancer; sets ``removed`` at the first 503."""
    pool = RawHttpPool(url)
    probe = pool.get_request("/v2/health/ready")
    try:
        while True:
            try:
                if (await pool.exchange(probe)).status != 200:
                    break
            except OSError:
                pool = RawHttpPool(url)
            await asyncio.sleep(every)
    finally:
        removed.set()
        await pool.close()


async def sigterm_in_a_flood(
    server: ServerProcess, scenario: Scenario, behind_a_load_balancer: bool
) -> dict[str, Any]:
    """A steady flood; SIGTERM after a second; it runs on through the drain
    delay and the close. Behind a load balancer (readiness probed every
    100 ms), callers stop opening connections to the server once it is out
    of rotation; without one they reconnect until refused. Returns how the
    server ended."""
    assert server.process is not None
    removed = asyncio.Event() if behind_a_load_balancer else None
    probing = asyncio.create_task(load_balancer(server.url, removed)) if removed else None
    flooding = asyncio.create_task(
        flood(server.url, scenario, 100_000, 32, good_body, removed=removed)
    )
    await asyncio.sleep(1.0)  # the flood is under way
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    returncode = await asyncio.to_thread(server.process.wait, DRAIN_DELAY_S + SHUTDOWN_GRACE_S + 30)
    exited_after = time.monotonic() - signalled
    await asyncio.sleep(0.5)
    for task in (flooding, probing):
        if task is not None:
            task.cancel()
    await asyncio.gather(*(t for t in (flooding, probing) if t), return_exceptions=True)
    return {"returncode": returncode, "exited_after_s": round(exited_after, 2)}


def start_server(repository: Path) -> ServerProcess:
    return ServerProcess(
        str(repository),
        [
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--body-timeout-s", str(BODY_TIMEOUT_S),
            "--drain-delay-s", str(DRAIN_DELAY_S),
            "--shutdown-grace-s", str(SHUTDOWN_GRACE_S),
        ],
        new_session=True,
        sample_interval=0.05,
    ).start()  # fmt: skip


async def soak(repository: Path) -> dict[str, Any]:
    scenarios: list[Scenario] = []

    async def run(name: str, work: Callable[[Scenario], Awaitable[Any]]) -> Any:
        scenario = Scenario(name)
        started = time.monotonic()
        result = await work(scenario)
        scenario.seconds = time.monotonic() - started
        scenarios.append(scenario)
        print(f"  {name}: {dict(scenario.outcomes)}", file=sys.stderr)
        return result

    server = await asyncio.to_thread(start_server, repository)
    idle = server.usage()
    url = server.url
    try:
        await run("flood (c=256, queue 64)", lambda s: flood(url, s, 6000, 256, good_body))
        await run(
            "deadlines (timeout_ms 1-20, c=128)",
            lambda s: flood(
                url, s, 3000, 128,
                lambda rng: good_body(rng, timeout_ms=rng.choice([1, 2, 5, 10, 20])),
            ),
        )  # fmt: skip
        await run("callers that leave (c=128)", lambda s: leave(url, s, 2000, 128))
        oversized = b"\x00" * (MAX_REQUEST_BYTES + 1)
        await run(
            "oversized bodies",
            lambda s: flood(url, s, 50, 8, lambda rng: (oversized, None)),
        )
        await run("malformed native bodies", lambda s: flood(url, s, 2000, 16, malformed))
        await run(
            "malformed KServe v2 bodies",
            lambda s: flood(url, s, 1000, 16, malformed_oip, "application/json"),
        )
        await run("trickled bodies (1 byte / 100 ms)", lambda s: trickle(url, s, 16))
        await run("after all that: good requests", lambda s: flood(url, s, 500, 8, good_body))
        ended = await run(
            "SIGTERM during a flood (c=32), behind a load balancer",
            lambda s: sigterm_in_a_flood(server, s, behind_a_load_balancer=True),
        )
    finally:
        peak_rss = server.peak_rss_bytes
        stopped = await asyncio.to_thread(server.stop)
    bare = await asyncio.to_thread(start_server, repository)
    try:
        ended_bare = await run(
            "SIGTERM during a flood (c=32), clients reconnecting directly",
            lambda s: sigterm_in_a_flood(bare, s, behind_a_load_balancer=False),
        )
    finally:
        stopped_bare = await asyncio.to_thread(bare.stop)
    return {
        "scenarios": [
            {"name": s.name, "sent": s.sent, "seconds": round(s.seconds, 2), **s.outcomes}
            for s in scenarios
        ],
        "shutdown": ended,
        "shutdown_without_load_balancer": ended_bare,
        "leftover_processes": {**stopped.leftovers, **stopped_bare.leftovers},
        "processes": idle.processes,  # the server and its worker processes
        "idle_rss_mb": round(idle.rss_bytes / 2**20, 1),
        "peak_rss_mb": round(peak_rss / 2**20, 1),
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        (
            "| scenario | sent | answered correctly | refused (status code: count) "
            "| left / not accepted | lost | hung | wrong |"
        ),
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for s in results["scenarios"]:
        refused = ", ".join(
            f"{k.removeprefix('refused ')}: {v}"
            for k, v in sorted(s.items())
            if k.startswith("refused")
        )
        other = sum(v for k, v in s.items() if k.startswith(("left", "not accepted")))
        wrong = sum(v for k, v in s.items() if k.startswith("wrong"))
        rows.append(
            f"| {s['name']} | {s['sent']} | {s.get('answered correctly', 0)} | {refused or '-'} "
            f"| {other} | {s.get('lost', 0)} | {s.get('hung', 0)} | {wrong} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/soak_overload.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder)
        write_xy_model(repository, "echo", MODEL, CONFIG)
        started = time.monotonic()
        results = asyncio.run(soak(repository))
    results["wall_s"] = round(time.monotonic() - started, 1)
    print(table(results))
    print(
        f"\nserver + workers ({results['processes']} processes) RSS: "
        f"idle {results['idle_rss_mb']} MB, "
        f"peak {results['peak_rss_mb']} MB;"
        f" SIGTERM: exit status {results['shutdown']['returncode']} after "
        f"{results['shutdown']['exited_after_s']} s; leftover processes: "
        f"{len(results['leftover_processes'])}; {results['wall_s']} s in all"
    )
    save(args.out, results)


if __name__ == "__main__":
    main()
