"""The overload soak: a real server on loopback under a flood, callers that
leave, deadlines that expire, oversized, malformed and trickled bodies, and a
SIGTERM in the middle of a flood. About a minute and a half:

    results = asyncio.run(soak(repository))   # benchmarks/soak.py --scenario overload

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
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensorserve_bench.rawhttp import RawHttpPool
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.soak.model import ROUTE, write_soak_model
from tensorserve_bench.soak.requests import (
    MSGPACK,
    answered_correctly,
    good_body,
    good_item,
    malformed_native,
    malformed_oip,
    status_of,
)

MAX_REQUEST_BYTES = 1 << 16
BODY_TIMEOUT_S = 2.0
DRAIN_DELAY_S = 2.0
SHUTDOWN_GRACE_S = 5.0
HUNG_AFTER_S = 30.0
# A body and the item it carries (None: a body the server must refuse).
MakeBody = Callable[[random.Random], tuple[bytes, "np.ndarray | None"]]


def write_model(repository: Path) -> None:
    """The soak model in its worker process, a 2 ms forward, a queue of 64."""
    write_soak_model(
        repository, isolation="process", cost="light", max_queue_delay_ms=1.0, max_queue_size=64
    )


@dataclass
class Scenario:
    name: str
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: float = 0.0

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())


def good(rng: random.Random, **parameters: Any) -> tuple[bytes, np.ndarray]:
    x = good_item(rng)
    return good_body(x, **parameters), x


def classify(status: int, body: bytes, expected: np.ndarray | None) -> str:
    if status == 200:
        if expected is None:
            return "wrong: 200 for a malformed body"
        return "answered correctly" if answered_correctly(body, expected) else "wrong: output"
    if status >= 500 and expected is None and status != 503:
        return f"wrong: {status_of(status, body)} for a malformed body"
    return f"refused {status_of(status, body)}"


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
    make: MakeBody,
    content_type: str = MSGPACK,
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
                request = pool.request(ROUTE, body, content_type)
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
    pool = RawHttpPool(url)
    semaphore = asyncio.Semaphore(concurrency)

    async def one(seed: int) -> None:
        async with semaphore:
            rng = random.Random(seed)
            body, _ = good(rng)
            _, writer = await asyncio.open_connection(pool.host, pool.port)
            writer.write(pool.request(ROUTE, body, MSGPACK))
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.005))
            writer.close()
            scenario.outcomes["left (closed by the client)"] += 1

    await asyncio.gather(*(one(seed) for seed in range(total)))


async def trickle(url: str, scenario: Scenario, total: int) -> None:
    """Bodies sent a byte every 100 ms: 408 after BODY_TIMEOUT_S."""
    pool = RawHttpPool(url)

    async def one(seed: int) -> None:
        body, _ = good(random.Random(seed))
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
    flooding = asyncio.create_task(flood(server.url, scenario, 100_000, 32, good, removed=removed))
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
    """Every scenario against one server (the SIGTERM last), then a SIGTERM
    against a second one whose callers have no load balancer."""
    scenarios: list[Scenario] = []

    async def run(name: str, work: Callable[[Scenario], Awaitable[Any]]) -> Any:
        scenario = Scenario(name)
        started = time.monotonic()
        result = await work(scenario)
        scenario.seconds = time.monotonic() - started
        scenarios.append(scenario)
        print(f"  {name}: {dict(scenario.outcomes)}", file=sys.stderr)
        return result

    def with_deadline(rng: random.Random) -> tuple[bytes, np.ndarray]:
        return good(rng, timeout_ms=rng.choice([1, 2, 5, 10, 20]))

    def refused(make: Callable[[random.Random], bytes]) -> MakeBody:
        return lambda rng: (make(rng), None)

    oversized = b"\x00" * (MAX_REQUEST_BYTES + 1)
    server = await asyncio.to_thread(start_server, repository)
    idle = server.usage()
    url = server.url
    try:
        await run("flood (c=256, queue 64)", lambda s: flood(url, s, 6000, 256, good))
        await run(
            "deadlines (timeout_ms 1-20, c=128)", lambda s: flood(url, s, 3000, 128, with_deadline)
        )
        await run("callers that leave (c=128)", lambda s: leave(url, s, 2000, 128))
        await run(
            "oversized bodies", lambda s: flood(url, s, 50, 8, refused(lambda rng: oversized))
        )
        await run(
            "malformed native bodies", lambda s: flood(url, s, 2000, 16, refused(malformed_native))
        )
        await run(
            "malformed KServe v2 bodies",
            lambda s: flood(url, s, 1000, 16, refused(malformed_oip), "application/json"),
        )
        await run("trickled bodies (1 byte / 100 ms)", lambda s: trickle(url, s, 16))
        await run("after all that: good requests", lambda s: flood(url, s, 500, 8, good))
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
    """The scenarios as a markdown table (docs/reliability.md quotes it)."""
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
