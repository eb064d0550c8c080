"""The load generator: closed loop (N workers, each sends, waits, sends
again) or open loop (Poisson arrivals at a target rate, whatever the server
does), over a pool of pre-encoded requests.

One measured point is: warm-up at the same load, drain, read the model's
counters, run for ``duration`` seconds, drain, read the counters again. Only
requests started inside the window count; their latencies, the items they
carried and the counters' difference make the ``PointResult``. Throughput is
items completed over the window including its drain, so it is what the
server sustained, not what the client offered.

Open-loop latency is measured from each request's scheduled arrival time,
not from when the client got round to sending it, so a client that falls
behind shows up as latency (no coordinated omission). How far behind it
fell is reported too (``late_ms``), and the garbage collector is paused for
an open-loop phase: its full passes over thousands of live tasks stalled
this generator for 60 ms at p99 (2,000 requests/s, 2-core VM, 2026-11-24),
which the latencies then blamed on the server; paused, 2 ms.

A refusal (HTTP 503, gRPC UNAVAILABLE: the server shedding load, to be
retried later) is counted apart from errors, with how fast it came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tensorserve_bench.summaries import percentiles_ms
from tensorserve_bench.targets import BatchingDelta, RequestFailed, Target

Progress = Callable[[float, str], None]  # (seconds of the plan done since last call, status)
MAX_ERROR_SAMPLES = 5


@dataclass(frozen=True)
class PreparedRequest:
    payload: Any  # what the target sends: bytes for HTTP, a list of items in-process
    items: int


@dataclass
class PointResult:
    """One point of a sweep. Latencies in milliseconds."""

    mode: str  # "closed" | "open"
    concurrency: int | None  # closed loop: workers
    rate: float | None  # open loop: offered requests per second
    variant: str
    duration_s: float  # requested
    elapsed_s: float  # measured window, drain included
    requests: int
    items: int
    errors: int
    dropped: int  # open loop: arrivals not sent because max_outstanding were in flight
    items_per_s: float
    requests_per_s: float
    latency_ms: dict[str, float]  # mean, p50, p90, p99, max
    batches: int
    avg_batch_size: float
    padding_efficiency: float | None
    padding_efficiency_exact: bool
    batch_size_histogram: dict[str, int]  # bucket upper bound -> batches executed
    error_samples: list[str] = field(default_factory=list)
    # CPU seconds this process used over the window: the load generator's own
    # cost over HTTP; in-process it includes the batcher and the model.
    client_cpu_s: float = 0.0
    avg_batch_ms: float | None = None  # the model's own time per batch (server counters)
    # CPU seconds the server's process tree used over the window, from targets
    # that started the server (--serve, the peers); None otherwise.
    server_cpu_s: float | None = None
    refused: int = 0  # answered "retry later" (HTTP 503 / gRPC UNAVAILABLE); not in errors
    refusal_latency_ms: dict[str, float] = field(default_factory=dict)  # mean, p50, p90, p99, max
    # Open loop: how late the generator sent after each scheduled arrival.
    late_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PointResult:
        return cls(**data)

    @property
    def x(self) -> float:
        """The sweep's axis: concurrency (closed) or offered rate (open)."""
        value = self.concurrency if self.mode == "closed" else self.rate
        return float(value or 0)


class _Recorder:
    """Outcomes of the requests of one phase; plain appends, no locks (one loop)."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.items = 0
        self.errors = 0
        self.dropped = 0
        self.samples: list[str] = []
        self.refusals: list[float] = []
        self.late: list[float] = []

    def ok(self, seconds: float, items: int) -> None:
        self.latencies.append(seconds)
        self.items += items

    def fail(self, exc: Exception, seconds: float) -> None:
        if isinstance(exc, RequestFailed) and exc.refused:
            self.refusals.append(seconds)
            return
        self.errors += 1
        if len(self.samples) < MAX_ERROR_SAMPLES:
            self.samples.append(f"{type(exc).__name__}: {exc}"[:300])


async def _send(
    target: Target, request: PreparedRequest, started: float, recorder: _Recorder
) -> None:
    try:
        await target.send(request.payload)
    except Exception as exc:  # noqa: BLE001 - any failure is that request's error, not the run's
        recorder.fail(exc, time.perf_counter() - started)
    else:
        recorder.ok(time.perf_counter() - started, request.items)


async def closed_loop(
    target: Target,
    pool: Sequence[PreparedRequest],
    concurrency: int,
    seconds: float,
    recorder: _Recorder,
) -> None:
    """``concurrency`` workers, each with one request in flight, until ``seconds`` pass."""
    stop_at = time.perf_counter() + seconds
    order = itertools.count()
    size = len(pool)

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            await _send(target, pool[next(order) % size], time.perf_counter(), recorder)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    target: Target,
    pool: Sequence[PreparedRequest],
    rate: float,
    seconds: float,
    recorder: _Recorder,
    *,
    rng: np.random.Generator,
    max_outstanding: int = 1024,
) -> None:
    """Poisson arrivals at ``rate`` requests/s for ``seconds``; then wait for all."""
    with _gc_paused():
        start = time.perf_counter()
        stop_at = start + seconds
        in_flight: set[asyncio.Task[None]] = set()
        scheduled = start
        for index in itertools.count():
            scheduled += float(rng.exponential(1.0 / rate))
            if scheduled >= stop_at:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(in_flight) >= max_outstanding:
                recorder.dropped += 1
                continue
            recorder.late.append(time.perf_counter() - scheduled)
            task = asyncio.create_task(_send(target, pool[index % len(pool)], scheduled, recorder))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection inside: the phase's cyclic garbage waits for the
    end (seconds of requests: bounded). Left as it was found."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


async def _phase(
    target: Target,
    pool: Sequence[PreparedRequest],
    recorder: _Recorder,
    seconds: float,
    *,
    mode: str,
    concurrency: int,
    rate: float | None,
    rng: np.random.Generator,
    max_outstanding: int,
) -> None:
    if mode == "closed":
        await closed_loop(target, pool, concurrency, seconds, recorder)
    else:
        assert rate is not None
        await open_loop(
            target, pool, rate, seconds, recorder, rng=rng, max_outstanding=max_outstanding
        )


async def run_point(
    target: Target,
    pool: Sequence[PreparedRequest],
    *,
    mode: str = "closed",
    concurrency: int = 1,
    rate: float | None = None,
    duration: float = 10.0,
    warmup: float = 2.0,
    variant: str = "default",
    seed: int = 0,
    max_outstanding: int = 1024,
    progress: Progress | None = None,
) -> PointResult:
    """Measure one load level against an opened ``target``.

    ``mode="closed"`` keeps ``concurrency`` requests in flight; ``mode="open"``
    offers ``rate`` requests per second (Poisson), at most ``max_outstanding``
    in flight. ``progress`` is called a few times a second with the seconds of
    the planned ``warmup + duration`` done since its last call.
    """
    if mode not in ("closed", "open"):
        raise ValueError(f"mode must be 'closed' or 'open', not {mode!r}")
    if mode == "open" and not (rate and rate > 0):
        raise ValueError("open loop needs a positive rate (requests per second)")
    if concurrency < 1 or duration <= 0 or warmup < 0 or not pool:
        raise ValueError("need concurrency >= 1, duration > 0, warmup >= 0 and a non-empty pool")
    rng = np.random.default_rng(seed)
    label = f"c={concurrency}" if mode == "closed" else f"rate={rate:g}/s"

    async def phase(recorder: _Recorder, seconds: float) -> None:
        await _phase(
            target,
            pool,
            recorder,
            seconds,
            mode=mode,
            concurrency=concurrency,
            rate=rate,
            rng=rng,
            max_outstanding=max_outstanding,
        )

    async with _Ticker(progress, warmup + duration, f"{variant} {label}") as ticker:
        if warmup > 0:
            await phase(_Recorder(), warmup)
        # Both phases drain before the counters are read, so the window's
        # batches are exactly those of the measured requests.
        before = await target.counters()
        ticker.recorder = recorder = _Recorder()
        cpu_started = time.process_time()
        started = time.perf_counter()
        await phase(recorder, duration)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        after = await target.counters()
    delta = BatchingDelta.between(before, after)
    return PointResult(
        mode=mode,
        concurrency=concurrency if mode == "closed" else None,
        rate=float(rate) if mode == "open" and rate else None,
        variant=variant,
        duration_s=duration,
        elapsed_s=elapsed,
        requests=len(recorder.latencies),
        items=recorder.items,
        errors=recorder.errors,
        dropped=recorder.dropped,
        items_per_s=recorder.items / elapsed if elapsed > 0 else 0.0,
        requests_per_s=len(recorder.latencies) / elapsed if elapsed > 0 else 0.0,
        latency_ms=percentiles_ms(recorder.latencies),
        batches=delta.batches,
        avg_batch_size=delta.avg_batch_size,
        padding_efficiency=delta.padding_efficiency,
        padding_efficiency_exact=delta.padding_efficiency_exact,
        batch_size_histogram=delta.histogram,
        error_samples=recorder.samples,
        client_cpu_s=cpu,
        avg_batch_ms=delta.avg_batch_ms,
        server_cpu_s=delta.server_cpu_s,
        refused=len(recorder.refusals),
        refusal_latency_ms=percentiles_ms(recorder.refusals),
        late_ms=percentiles_ms(recorder.late) if mode == "open" else {},
    )


class _Ticker:
    """Reports progress a few times a second while a point runs, and tops the
    bar up to the point's planned length when it ends (drains overrun it)."""

    INTERVAL = 0.25

    def __init__(self, progress: Progress | None, planned: float, label: str) -> None:
        self.progress = progress
        self.planned = planned
        self.label = label
        self.done = 0.0
        self.recorder: _Recorder | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Ticker:  # noqa: PYI034 - private, never subclassed
        if self.progress is not None:
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is None or self.progress is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._advance(self.planned - self.done)

    def _advance(self, seconds: float) -> None:
        assert self.progress is not None
        seconds = max(0.0, min(seconds, self.planned - self.done))
        self.done += seconds
        if self.recorder is None:
            self.progress(seconds, f"{self.label} warm-up")
        else:
            self.progress(seconds, f"{self.label} {self.recorder.items} items")

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.INTERVAL)
            now = time.perf_counter()
            self._advance(now - last)
            last = now
