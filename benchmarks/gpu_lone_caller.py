#!/usr/bin/env python3
"""Where one caller's CPU goes on a GPU, step by step, in one process:

    python benchmarks/gpu_lone_caller.py [--device cuda:0|cpu] [--out PATH] [--budget-s S]

At one caller on an H200, one thread of the server burned about as much CPU
per request as the batch's CUDA-event time (tagger 1.5 ms, the BERT-size
encoder 6.5-13.8 ms), with CUDA graphs and with event waits that sleep
(benchmarks/results/gpu_fill.json, busiest_threads). This probe finds which
thread and which step, without the HTTP front ends: each model is served in
a child process (``ServedModel.from_repository``, the server's own loading,
placement, collation and instance threads), warmed up, then sent one-item
requests one at a time, back to back and with a 2 ms gap (a server's loop
wakes cold between a lone caller's requests). It reports:

    per request   wall p50/p99, the process's CPU, and each thread's CPU
                  (/proc, by the names the server gives its threads:
                  tagger/0 launches, tagger/0c collects)
    per step      wall and the calling thread's CPU of pad and un-pad, the
                  executor's launch and collect, the copies to and from the
                  device, the event records, the forward (graphs or eager),
                  and the wait on the batch's event (a wait that spins shows
                  CPU ~ wall there)
    forward       graphs or eager, and the graphs each instance holds

and first, on CUDA, what each of torch's CUDA calls on that path costs this
host alone (``primitives``: an event, a pinned buffer, each copy, a kernel, a
graph replay, and three waits on 1 ms of GPU work: sleeping or spinning),
over variants, each in a child of its own (a CUDA context's flags are set
once, before it is created):

    shipped         the model's config as shipped
    eager           compile = "off"
    one_thread      one intra-op thread (the default is every CPU but one:
                    OpenMP's workers spin after each parallel region)
    blocking_sync   the device's primary context made with
                    CU_CTX_SCHED_BLOCKING_SYNC (the driver's scheduling flag:
                    every host wait on the device sleeps, not only an event's)

``--device cpu`` runs the shipped variant of a reduced set in seconds (the
test suite runs it). It prints one table and writes one JSON object with the
machine's facts: benchmarks/results/gpu_lone_caller.json (or ..._cpu.json).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tensorserve from this tree

from gpu_fill_served import busiest_threads, thread_cpu
from tensorserve_bench.items import ItemFactory, specs_from_config
from tensorserve_bench.lengths import uniform

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CU_CTX_SCHED_BLOCKING_SYNC = 0x04
GAP_S = 0.002  # between a lone caller's requests: the server's loop wakes cold


@dataclass(frozen=True)
class Run:
    """One child: a model under one variant."""

    model: str
    variant: str  # shipped | eager | one_thread | blocking_sync


# In order of what answers the question first, so a short budget keeps the most.
PRIMITIVES = "primitives"  # not a model: torch's CUDA calls one by one (``primitives``)
CUDA_RUNS = [
    Run(PRIMITIVES, "shipped"), Run(PRIMITIVES, "blocking_sync"),
    Run("tagger", "shipped"), Run("tagger", "blocking_sync"), Run("bert_encoder", "shipped"),
    Run("tagger", "eager"), Run("tagger", "one_thread"), Run("bert_encoder", "blocking_sync"),
    Run("embedder", "shipped"), Run("bert_encoder", "eager"), Run("embedder", "blocking_sync"),
]  # fmt: skip
CPU_RUNS = [Run("tagger", "shipped"), Run("bert_encoder", "shipped")]


# ----------------------------------------------------------------- per step
@dataclass
class Steps:
    """Wall and calling-thread CPU of each timed step, since ``reset``."""

    calls: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    on: bool = False

    def reset(self) -> None:
        self.calls = defaultdict(list)

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[name].append(
                    (time.perf_counter_ns() - wall, time.thread_time_ns() - cpu)
                )

        return wrapper

    def summary(self, requests: int) -> dict[str, dict[str, float]]:
        return {
            name: {
                "calls_per_request": round(len(calls) / requests, 2),
                "wall_us": round(float(np.mean([c[0] for c in calls])) / 1e3, 1),
                "cpu_us": round(float(np.mean([c[1] for c in calls])) / 1e3, 1),
            }
            for name, calls in sorted(self.calls.items())
        }


def instrument(steps: Steps, served: Any) -> None:
    """Time the server's own steps of a batch, as this child serves it."""
    import torch

    from tensorserve.runtime.device import DeviceContext
    from tensorserve.runtime.executor import ThreadExecutor
    from tensorserve.runtime.graphs import GraphedForward

    collator = type(served.batcher.collator)
    patches: list[tuple[Any, str, str]] = [
        (collator, "pad", "pad (loop)"), (collator, "unpad", "unpad (loop)"),
        (ThreadExecutor, "launch", "launch"), (ThreadExecutor, "collect", "collect"),
        (DeviceContext, "to_device", "launch: inputs to the device"),
        (DeviceContext, "to_host", "launch: outputs to the host"),
        (DeviceContext, "record", "launch: event record"),
        (GraphedForward, "__call__", "launch: forward (graphs)"),
        (GraphedForward, "_fill", "launch: graphs: the bucket's inputs filled"),
    ]  # fmt: skip
    if torch.cuda.is_available():
        patches.append((torch.cuda.Event, "synchronize", "collect: wait on the event"))
    for owner, attribute, name in patches:
        setattr(owner, attribute, steps.timed(name, getattr(owner, attribute)))
    executor = served.executor
    if isinstance(executor, ThreadExecutor):  # the module itself, eager or inside a capture
        executor.models = [steps.timed("launch: forward (module)", m) for m in executor.models]


def instrument_graphs(steps: Steps, served: Any) -> None:
    """Once every bucket the requests use is captured: time each replay, and
    the module wherever a graphed forward still calls it (eager: graphs off,
    or a bucket whose capture failed)."""
    from tensorserve.runtime.graphs import GraphedForward

    for forward in getattr(served.executor, "_forwards", {}).values():
        if isinstance(forward, GraphedForward):
            forward.model = steps.timed("launch: forward (module)", forward.model)
            forward.graphs = {
                bucket: (static, steps.timed("launch: graphs: replay", replay))
                for bucket, (static, replay) in forward.graphs.items()
            }


def forward_kind(served: Any) -> dict[str, Any]:
    from tensorserve.runtime.executor import ThreadExecutor
    from tensorserve.runtime.graphs import GraphedForward

    executor = served.executor
    if not isinstance(executor, ThreadExecutor):
        return {"forward": type(executor).__name__}
    forwards = getattr(executor, "_forwards", {})
    graphed = [f for f in forwards.values() if isinstance(f, GraphedForward)]
    if not graphed:
        return {"forward": "eager"}
    switch = graphed[0].switch
    return {"forward": "cuda graphs" if switch.on else f"eager ({switch.off_reason or 'auto chose eager'})",
            "graphs_held": [len(f.graphs) for f in graphed]}  # fmt: skip


# ----------------------------------------------------------------- a child
def blocking_sync(device_index: int) -> str | None:
    """The device's primary context scheduled to block, before anything creates
    it (the driver API: a flag the CUDA runtime's contexts then inherit). A
    sentence when it could not be set."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), device_index))):
            code = getattr(cuda, call)(*args)
            if code != 0:
                return f"{call} returned {code}"
        code = cuda.cuDevicePrimaryCtxSetFlags(device, CU_CTX_SCHED_BLOCKING_SYNC)
        return None if code == 0 else f"cuDevicePrimaryCtxSetFlags returned {code}"
    except (OSError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def primitives(device: str, repeats: int = 200) -> dict[str, dict[str, float]]:
    """What each CUDA call of a batch's path costs this host, alone: wall and
    thread CPU, in us a call. A wait on 1 ms of GPU work shows whether it
    sleeps (CPU << wall) or spins (CPU ~ wall): an event's, a stream's, and a
    blocking copy's (``.cpu()`` of a result)."""
    import torch

    dev = torch.device(device)
    stream = torch.cuda.Stream(dev)
    cycles = _cycles_per_ms(dev)
    host = torch.ones((1, 64), dtype=torch.int64).pin_memory()
    on_device = host.to(dev)
    out = torch.empty((1, 64), dtype=torch.int64, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        static = on_device.clone()
        for _ in range(3):
            static.add_(1)  # warm, outside the capture
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(20):
                static.add_(1)

    def sleep_then(wait: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            torch.cuda._sleep(cycles)
            return wait()

        return run

    def event_wait() -> None:
        torch.cuda._sleep(cycles)
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
        done.synchronize()

    calls: dict[str, Callable[[], Any]] = {
        "event: create and record (timing, blocking)": lambda: torch.cuda.Event(
            enable_timing=True, blocking=True
        ).record(stream),
        "pinned empty (1x64 int64)": lambda: torch.empty(
            (1, 64), dtype=torch.int64, pin_memory=True
        ),
        "copy up, pinned, non_blocking": lambda: host.to(dev, non_blocking=True),
        "copy down, into pinned, non_blocking": lambda: out.copy_(on_device, non_blocking=True),
        "one small kernel (add_)": lambda: on_device.add_(1),
        "graph replay (20 kernels)": graph.replay,
        "mem_get_info": lambda: torch.cuda.mem_get_info(dev),
        "wait 1 ms of GPU: blocking event": event_wait,
        "wait 1 ms of GPU: stream.synchronize": sleep_then(stream.synchronize),
        "wait 1 ms of GPU: .cpu() of a result": sleep_then(lambda: on_device.cpu()),
    }
    found: dict[str, dict[str, float]] = {}
    with torch.inference_mode(), torch.cuda.stream(stream):
        for name, call in calls.items():
            count = 20 if name.startswith("wait") else repeats
            call()
            stream.synchronize()
            waits = name.startswith("wait")
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(count):
                call()
            if waits:  # a wait's own time is the question: the last one counts
                stream.synchronize()
            wall, cpu = time.perf_counter_ns() - wall, time.thread_time_ns() - cpu
            stream.synchronize()  # any other call's queued GPU work is no host cost
            found[name] = {
                "wall_us": round(wall / count / 1e3, 1),
                "cpu_us": round(cpu / count / 1e3, 1),
            }
    return found


def _cycles_per_ms(dev: Any) -> int:
    """``torch.cuda._sleep`` cycles for about 1 ms on this GPU (timed once)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # lazy set-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 / max(start.elapsed_time(end), 1e-3))


def child(repository: Path, run: Run, device: str, requests: int) -> dict[str, Any]:
    result: dict[str, Any] = {"model": run.model, "variant": run.variant}
    if run.variant == "blocking_sync":
        import torch

        why = blocking_sync(torch.device(device).index or 0)
        if why is not None:
            return {**result, "error": f"could not set the scheduling flag: {why}"}
    if run.model == PRIMITIVES:
        return {**result, "calls": primitives(device)}
    from tensorserve.repository.loader import discover, read_config
    from tensorserve.serving.model import ServedModel

    # A thread on a CPU too (auto gives a CPU a worker process): the steps are timed here.
    overrides: dict[str, Any] = {"device": device, "isolation": "thread"}
    if run.variant == "eager":
        overrides["compile"] = "off"
    clock = time.monotonic()
    threads = 1 if run.variant == "one_thread" else None
    source = discover(repository)[run.model]
    served = ServedModel.from_source(
        source, None, read_config(source, overrides), intra_op_threads=threads
    ).start()
    try:
        served.warmup()
        result["ready_s"] = round(time.monotonic() - clock, 1)
        result.update(forward_kind(served))
        steps = Steps()
        instrument(steps, served)
        # Token ids below the vocabulary (the tagger's 4,096 ids are valid everywhere).
        factory = ItemFactory(specs_from_config(served.config.model_dump()), uniform(8, 128),
                              seed=2, id_range=(1, 4096))  # fmt: skip
        batch, _ = factory.make(64)
        for item in batch:  # each bucket's capture, and the wrappers' first calls
            served.infer_sync(item, timeout=60)
        instrument_graphs(steps, served)
        result["pacing"] = {}
        for pacing, gap in (("back to back", 0.0), (f"{GAP_S * 1e3:g} ms apart", GAP_S)):
            steps.reset()
            steps.on = True
            latencies = []
            before, cpu = thread_cpu([os.getpid()]), time.process_time()
            for i in range(requests):
                if gap:
                    time.sleep(gap)
                started = time.perf_counter()
                served.infer_sync(batch[i % len(batch)], timeout=60)
                latencies.append(time.perf_counter() - started)
            cpu, after = time.process_time() - cpu, thread_cpu([os.getpid()])
            steps.on = False
            # This thread is the caller, not the server: it is left out.
            caller = (os.getpid(), threading.get_native_id())
            after.pop(caller, None)
            threads = busiest_threads(before, after, requests, {}, top=6)
            result["pacing"][pacing] = {
                "requests": requests,
                "p50_us": round(float(np.percentile(latencies, 50)) * 1e6, 1),
                "p99_us": round(float(np.percentile(latencies, 99)) * 1e6, 1),
                "process_cpu_us_per_request": round(cpu / requests * 1e6, 1),
                "threads": [
                    {"thread": t["thread"], "cpu_us_per_request": t["cpu_us_per_request"]}
                    for t in threads
                ],
                "steps": steps.summary(requests),
                "batch_ms": served.stats.snapshot(0).get("avg_batch_duration_ms"),
            }
            served.stats.reset()
        result["graphs_held_after"] = forward_kind(served).get("graphs_held")
    finally:
        served.close()
    return result


# ----------------------------------------------------------------- the parent
def run_child(
    repository: Path, run: Run, device: str, requests: int, timeout: float
) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", run.model, "--variant", run.variant,
               "--repository", str(repository), "--device", device, "--requests", str(requests)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p)}  # fmt: skip
    try:
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {
            "model": run.model,
            "variant": run.variant,
            "error": f"timed out after {timeout:.0f} s",
        }
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"model": run.model, "variant": run.variant,
                "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}  # fmt: skip
    return dict(json.loads(lines[-1]))


def table(result: dict[str, Any]) -> str:
    rows = [f"lone caller, {result['device']} ({result['date']}, {result['commit'][:7]})"]
    for run in result["runs"]:
        head = f"\n{run['model']} / {run['variant']}"
        if "error" in run:
            rows.append(f"{head}: {run['error'][-300:]}")
            continue
        if "calls" in run:
            rows.append(f"{head} (us a call)")
            for name, c in run["calls"].items():
                rows.append(f"    {name:44s} wall {c['wall_us']:8.1f}  cpu {c['cpu_us']:8.1f}")
            continue
        rows.append(f"{head}: forward {run.get('forward')}, graphs {run.get('graphs_held', '-')}")
        for pacing, p in run["pacing"].items():
            threads = ", ".join(
                f"{t['thread']} {t['cpu_us_per_request']:.0f}" for t in p["threads"][:4]
            )
            rows.append(f"  {pacing}: p50 {p['p50_us']:.0f} us, process CPU {p['process_cpu_us_per_request']:.0f} "
                        f"us a request; batch {p['batch_ms']} ms; threads (us): {threads}")  # fmt: skip
            for name, s in p["steps"].items():
                rows.append(f"    {name:34s} x{s['calls_per_request']:<5} wall {s['wall_us']:8.1f}  "
                            f"cpu {s['cpu_us']:8.1f} us")  # fmt: skip
    return "\n".join(rows)


@contextlib.contextmanager
def repository_for(device: str, models: Sequence[str]) -> Iterator[Path]:
    from gpu_fill import PLANS, build_repository

    with tempfile.TemporaryDirectory(prefix="lone_caller_") as scratch:
        encoder = PLANS["cuda" if device.startswith("cuda") else "cpu"].encoder
        yield build_repository(Path(scratch), encoder, models)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget-s", type=float, default=85.0)
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="a pacing's requests (default: 300 on CUDA, 40 on a CPU)",
    )
    parser.add_argument("--commit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--repository", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    requests = args.requests or (300 if on_cuda else 40)
    if args.child:
        print(
            json.dumps(child(args.repository, Run(args.child, args.variant), args.device, requests))
        )
        return 0

    from gpu_check import machine, write_result

    out = args.out or HERE / "results" / (
        "gpu_lone_caller.json" if on_cuda else "gpu_lone_caller_cpu.json"
    )
    runs = CUDA_RUNS if on_cuda else CPU_RUNS
    result: dict[str, Any] = {
        **machine(args.device, args.commit),
        "runs": [],
        "partial": True,
        "command": "python benchmarks/gpu_lone_caller.py " + " ".join(argv or sys.argv[1:]),
    }
    started = time.monotonic()
    took: dict[bool, float] = {True: 15.0, False: 30.0}  # a run's time: primitives, a model
    models = sorted({r.model for r in runs} - {PRIMITIVES})
    with repository_for(args.device, models) as repository:
        for run in runs:
            left = args.budget_s - (time.monotonic() - started)
            expected = took[run.model == PRIMITIVES]
            if left < expected:  # not started to be cut: said as not run, no failure
                result.setdefault("not_run", []).append(f"{run.model}/{run.variant}")
                continue
            clock = time.monotonic()
            outcome = run_child(repository, run, args.device, requests, left)
            took[run.model == PRIMITIVES] = max(expected, time.monotonic() - clock)
            result["runs"].append(outcome)
            print(f"[lone_caller] {run.model}/{run.variant}: {outcome.get('error', 'measured')[:200]}",
                  file=sys.stderr, flush=True)  # fmt: skip
            write_result(out, result)
    result["partial"] = False
    result["seconds"] = round(time.monotonic() - started, 1)
    write_result(out, result)
    print(table(result))
    print(f"\nwritten: {os.path.relpath(out)}")
    return 1 if any("error" in r for r in result["runs"]) or not result["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
