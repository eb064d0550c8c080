#!/usr/bin/env python3
"""Prototype (issue #22, item 4): several HTTP front-end processes on one
port (SO_REUSEPORT) feeding one batcher process, against the one-process
server, both serving the GPU-like ``flat`` model, loaded by wrk.

    python benchmarks/frontends_prototype.py --duration 8 --repeats 2
    # -> benchmarks/results/frontends_prototype.json

Variants, taking turns within each repeat (the order reversed every other
repeat, so a busy moment of the machine costs them alike):

server      ``tensorserve serve --isolation thread``: one event loop does
            HTTP, codec, validation, queueing and batch forming.
prototype   N front ends (benchmarks/prototype_frontend_worker.py) decode
            and validate KServe v2 JSON, send the arrays over one Unix-socket
            connection each to the batcher process (one ServedModel), and
            encode its reply. A shared-memory ring is the design; a Unix
            socket stands in for it here.

One item per request (KServe v2 JSON, uniform 8..128 tokens, 256 bodies in
turn), c = 64 and 256. ``flat`` sleeps 5 ms per batch of up to 64 items:
it allows 12,800 items/s. CPU is every process of the variant (psutil, read
just before and after the measured window); "batcher CPU" is the batcher
process's alone. The table shows medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import psutil

from tensorserve.bench.items import ItemFactory, specs_from_config
from tensorserve.bench.lengths import uniform
from tensorserve.bench.percentiles import medians_by
from tensorserve.bench.protocols import json_body
from tensorserve.bench.repositories import write_flat_model
from tensorserve.bench.results import save
from tensorserve.bench.server import ServerProcess, free_port
from tensorserve.bench.wrk import find_wrk, run_wrk, write_script, wrk_version
from tensorserve.repository.loader import discover, read_config

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "frontends_prototype.json"
WORKER = HERE / "prototype_frontend_worker.py"
MODEL, MAX_BATCH, FLAT_MS, BODIES, LENGTHS = "flat", 64, 5.0, 256, (8, 128)
ALLOWS = MAX_BATCH / (FLAT_MS / 1000)  # 12,800 items/s


class Variant(Protocol):
    url: str

    def cpu_s(self) -> tuple[float, float | None]:
        """(CPU seconds of every process so far, of the batcher process alone or None)."""
        ...


class Prototype:
    """The batcher process and ``frontends`` front ends on one port; ``stop``
    ends every one of them, by pid (SIGTERM, then SIGKILL)."""

    def __init__(self, repository: Path, frontends: int, work: Path) -> None:
        self.repository, self.frontends, self.work = repository, frontends, work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []  # the batcher first
        self.measured: list[psutil.Process] = []

    def start(self) -> Prototype:
        tag = uuid.uuid4().hex[:8]  # several runs may share the work folder
        path = str(self.work / f"batcher-{tag}.sock")
        self._wait(*self._spawn(f"batcher-{tag}", "batcher", path))
        # Front ends only once the batcher listens; they start side by side.
        started = [
            self._spawn(f"frontend{i}-{tag}", "frontend", path, str(self.port))
            for i in range(self.frontends)
        ]
        for process, ready in started:
            self._wait(process, ready)
        return self

    def _spawn(
        self, name: str, kind: str, path: str, *extra: str
    ) -> tuple[subprocess.Popen[bytes], Path]:
        ready = self.work / f"{name}.ready"
        argv = [kind, str(self.repository), MODEL, path, str(ready), *extra]
        with open(self.work / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, str(WORKER), *argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent,
            )  # fmt: skip
        self.processes.append(process)
        self.measured.append(psutil.Process(process.pid))
        return process, ready

    def _wait(self, process: subprocess.Popen[bytes], ready: Path, limit_s: float = 120) -> None:
        deadline = time.monotonic() + limit_s
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                log = ready.with_suffix(".log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{ready.stem} did not start (exit {process.poll()}):\n{log}")
            time.sleep(0.05)

    def cpu_s(self) -> tuple[float, float | None]:
        seconds = [sum(p.cpu_times()[:4]) for p in self.measured]  # user, system, children
        return sum(seconds), seconds[0]

    def stop(self) -> None:
        for process in reversed(self.processes):  # front ends first: they hold the connections
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Server:
    """The one-process server as a ``Variant``."""

    def __init__(self, repository: Path, work: Path) -> None:
        log = work / f"server-{uuid.uuid4().hex[:8]}.log"
        self.process = ServerProcess(str(repository), ["--isolation", "thread"], log=log)
        self.url = self.process.url

    def cpu_s(self) -> tuple[float, float | None]:
        return self.process.usage().cpu_s, None


@contextmanager
def running(name: str, frontends: int, repository: Path, work: Path) -> Iterator[Variant]:
    if name == "server":
        server = Server(repository, work)
        server.process.start()  # stops whatever it started if it fails
        try:
            yield server
        finally:
            server.process.stop()
    else:
        prototype = Prototype(repository, frontends, work)
        try:
            yield prototype.start()
        finally:
            prototype.stop()  # also when start failed half-way


def check_answers(url: str, body: bytes) -> None:
    """One request answered right (a variant that failed fast would look fast)."""
    request = urllib.request.Request(
        f"{url}/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.loads(response.read())
    tokens = json.loads(body)["inputs"][0]["shape"]
    if reply["outputs"][0]["shape"] != [*tokens, 9]:
        raise RuntimeError(f"{url}: wrong reply {str(reply)[:200]}")


def measure(variant: Variant, script: Path, c: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.warmup:
        run_wrk(f"{variant.url}/v2/models/{MODEL}/infer", script, c, args.warmup)
    load = os.getloadavg()[0]  # the machine is shared: say how busy it was
    (cpu0, batcher0) = variant.cpu_s()
    result, wrk_cpu = run_wrk(f"{variant.url}/v2/models/{MODEL}/infer", script, c, args.duration)
    (cpu1, batcher1) = variant.cpu_s()
    per_request = 1e6 / result.requests if result.requests else float("nan")
    return {
        "c": c, "requests": result.requests, "items_s": result.ok_per_s,
        "of_model": result.ok_per_s / ALLOWS, "cpu_us_per_request": (cpu1 - cpu0) * per_request,
        "batcher_cpu_us_per_request": None if batcher0 is None or batcher1 is None
        else (batcher1 - batcher0) * per_request,
        "wrk_cpu_us_per_request": wrk_cpu * per_request,
        "p50_ms": result.latency_ms.get("p50"), "p99_ms": result.latency_ms.get("p99"),
        "errors": result.errors, "loadavg_1m_before": load,
    }  # fmt: skip


KEY = ("variant", "frontends", "c")
MEDIANS = ("items_s", "of_model", "cpu_us_per_request", "batcher_cpu_us_per_request",
           "wrk_cpu_us_per_request", "p50_ms", "p99_ms", "loadavg_1m_before")  # fmt: skip


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = medians_by(rows, KEY, MEDIANS)
    for entry in summary:
        entry["errors"] = sum(r["errors"] for r in rows if all(r[k] == entry[k] for k in KEY))
    return sorted(summary, key=lambda s: (s["c"], s["variant"] != "server", s["frontends"]))


def table(summary: list[dict[str, Any]]) -> str:
    def num(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = [
        (
            "| variant | front ends | c | items/s | of 12,800 | CPU us/req (all) "
            "| batcher CPU us/req | p50 ms | p99 ms | errors | load avg |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        lines.append(
            f"| {s['variant']} | {s['frontends']} | {s['c']} | {num(s['items_s'])} "
            f"| {100 * s['of_model']:.0f}% | {num(s['cpu_us_per_request'])} "
            f"| {num(s['batcher_cpu_us_per_request'])} | {num(s['p50_ms'], 1)} "
            f"| {num(s['p99_ms'], 1)} | {s['errors']} | {num(s['loadavg_1m_before'], 1)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=8, help="measured seconds per run")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up seconds per run (0: none)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--frontends", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--c", nargs="+", type=int, default=[64, 256], help="wrk connections")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    find_wrk()  # fail before starting anything
    variants = [("server", 1)] + [("prototype", n) for n in args.frontends]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frontends-") as tmp:
        work, repository = Path(tmp), Path(tmp, "repo")
        write_flat_model(repository, MODEL, MAX_BATCH, FLAT_MS)
        config = read_config(discover(repository)[MODEL])
        specs = specs_from_config(config.model_dump())
        items, _ = ItemFactory(specs, uniform(*LENGTHS), seed=0).make(BODIES)
        dtypes = {s.name: s.dtype for s in specs}
        bodies = [json_body([item], dtypes) for item in items]
        script = write_script(work / "bodies", f"/v2/models/{MODEL}/infer", "application/json",
                              bodies)  # fmt: skip
        for repeat in range(args.repeats):
            for name, frontends in variants if repeat % 2 == 0 else variants[::-1]:
                with running(name, frontends, repository, work) as variant:
                    check_answers(variant.url, bodies[0])
                    for c in args.c:
                        row = {"variant": name, "frontends": frontends, "repeat": repeat,
                               **measure(variant, script, c, args)}  # fmt: skip
                        rows.append(row)
                        print(f"  {name:9} N={frontends} c={c:<3} {row['items_s']:7.0f} items/s "
                              f"cpu {row['cpu_us_per_request']:4.0f} us/req "
                              f"p99 {row['p99_ms']} ms errors {row['errors']}", flush=True)  # fmt: skip
    summary = summarise(rows)
    print("\n" + table(summary))
    save(args.output, {
        "command": " ".join(["python", *sys.argv]), "wrk": wrk_version(),
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup,
                     "repeats": args.repeats, "flat_ms": FLAT_MS, "max_batch_size": MAX_BATCH,
                     "allows_items_s": ALLOWS, "bodies": BODIES, "lengths": list(LENGTHS),
                     "transport": "unix socket (stand-in for a shared-memory ring)"},
        "note": "2-core machine shared with another engineer's test runs (see load avg)",
        "summary": summary, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
