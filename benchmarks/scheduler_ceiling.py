"""What the scheduler process of ``--frontends N`` costs per request when it,
not the front ends, is the bottleneck: as behind a GPU node's many front
ends, which this 2-core machine cannot run.

The scheduler process here is the real one (``build_plane``, the model's
scheduler, ``FrontEndHub``), serving the flat GPU-like model (5 ms a batch of
up to 64, in a thread). In place of the front-end processes, one driver
process speaks the front ends' protocol on a socket pair
(``frontends/protocol.py``): it sends already-encoded one-item requests,
keeps ``--outstanding`` in flight and sends the next ones as the replies
come, as many as one front-end loop iteration would. It decodes nothing
but the replies' headers, so most of the second core is left to it and
the scheduler process can run flat out. Its CPU per request is read from
/proc over the window.

    python benchmarks/scheduler_ceiling.py                      # this tree
    python benchmarks/scheduler_ceiling.py --tree /tmp/base .   # A/B, alternating

On a machine with idle gaps (the front ends cannot keep the scheduler
busy) each batch's work starts with cold caches and costs several times
more; docs/performance.md "Many cores" compares the two.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
LENGTHS = (8, 128)  # as benchmarks/frontend.py's items
ITEMS = 256


# ---------------------------------------------------------------------- the scheduler process
def scheduler(repository: str, fd: int, driver_pid: int, stats_path: str) -> None:
    """The scheduler process's side, as ``frontends/supervisor.py`` runs it,
    with one connection: the driver's."""
    from tensorserve.dataplane.assembly import build_plane, models_served
    from tensorserve.frontends.hub import FrontEndHub
    from tensorserve.http.server import tune_process
    from tensorserve.settings import Settings

    settings = Settings(
        model_repository=repository, isolation="thread", intra_op_threads=1, log_level="WARNING"
    )
    tune_process(settings)
    gc.collect()
    gc.freeze()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        plane, loop_lag = build_plane(settings, role="scheduler")
        hub = FrontEndHub(plane, loop)
        async with models_served(plane, loop_lag, wait_for_models=True):
            hub.start()
            hub.attach(socket.socket(fileno=fd), driver_pid)
            await stop.wait()
            hub.stop()
            batcher = plane.registry.ready_model("flat").batcher
            Path(stats_path).write_text(json.dumps(batcher.stats.snapshot(0)))

    asyncio.run(serve())


# ---------------------------------------------------------------------- the driver
def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """A process's CPU seconds, or one of its threads' (``tid``)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(
    args: argparse.Namespace,
    sock: socket.socket,
    pid: int,
    request_ids: bool,
    runs: bool,
    request_runs: bool = False,
) -> dict[str, Any]:
    from tensorserve.ipc import messages

    reader = messages.StreamReader()

    def receive() -> list[messages.Message]:
        select.select([sock], [], [])
        got = reader.feed(sock)
        return got or []

    table = None
    while table is None:  # the model table comes first, once the model is loaded
        for header, _ in receive():
            table = header.get("models") or table
    name, version, _, _, _, _, generation = next(e for e in table if e[0] == "flat")
    rng = np.random.default_rng(args.seed)
    items = []
    for _ in range(ITEMS):
        ids = rng.integers(1, 1000, size=int(rng.integers(LENGTHS[0], LENGTHS[1] + 1)))
        items.append([ids, np.ones_like(ids)])
    names = ["input_ids", "attention_mask"]
    next_id = 0

    def send(count: int) -> None:
        nonlocal next_id
        requests, tensors = [], []
        for _ in range(count):
            next_id += 1
            request = [next_id, name, str(version), generation, None, None, {}, names, 1, None]
            requests.append(request + [f"bench-{next_id}"] if request_ids else request)
            tensors += items[next_id % ITEMS]
        if request_runs:  # as the tree's front ends send them: plain requests as runs
            requests = [[[r[0] for r in requests], *requests[0][1:6], names, [r[10] for r in requests]]]
        buffers = (
            messages.frames_in_order({"infer": requests}, tensors)
            if runs
            else messages.frames({"infer": requests}, {str(i): t for i, t in enumerate(tensors)})
        )
        sock.sendall(b"".join(buffers))

    for start in range(0, args.outstanding, args.per_message):
        send(min(args.per_message, args.outstanding - start))
    answered, failed, marks = 0, 0, []
    began = time.monotonic()
    windows = (began + args.warmup, began + args.warmup + args.duration)
    while len(marks) < 2:
        now = time.monotonic()
        if now >= windows[len(marks)]:
            # The loop's thread is the process's first (its tid is its pid): the
            # rest is the model's thread and its wake-ups.
            marks.append(
                (now, answered, cpu_seconds(pid), time.process_time(), cpu_seconds(pid, pid))
            )
            continue
        for header, _ in receive():
            replies = header.get("replies", ())
            # A run of rows ([[rid, ...], names]) answers each of its requests.
            count = sum(len(r[0]) if type(r[0]) is list else 1 for r in replies)
            answered += count
            failed += sum(1 for reply in replies if reply[1] is None)
            if failed and args.stop_on_error:
                raise SystemExit(f"a request failed: {next(r for r in replies if r[1] is None)}")
            for start in range(0, count, args.per_message):
                send(min(args.per_message, count - start))
    (t0, n0, c0, d0, l0), (t1, n1, c1, d1, l1) = marks
    requests = n1 - n0
    return {
        "requests_per_s": requests / (t1 - t0),
        "scheduler_cpu_us_per_request": 1e6 * (c1 - c0) / max(1, requests),
        "loop_thread_cpu_us_per_request": 1e6 * (l1 - l0) / max(1, requests),
        "scheduler_cpu_share": (c1 - c0) / (t1 - t0),
        "driver_cpu_share": (d1 - d0) / (t1 - t0),
        "failed": failed,
    }


# ---------------------------------------------------------------------- one run, many
def one_run(tree: Path, repository: Path, args: argparse.Namespace) -> dict[str, Any]:
    ours, theirs = socket.socketpair()
    # The tree's tensorserve first; what this process's path adds after it
    # (tensorserve_bench.server.tree_path: /tmp/site on the GPU machine).
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    child = subprocess.Popen(
        [sys.executable, __file__, "--scheduler", str(repository), str(theirs.fileno()),
         str(os.getpid()), str(repository / "stats.json")],
        pass_fds=[theirs.fileno()], env=env, cwd=tree,
    )  # fmt: skip
    theirs.close()
    try:
        # A tree whose requests carry their caller's id (the 11th field) or not.
        protocol = (tree / "tensorserve" / "frontends" / "protocol.py").read_text()
        # And whose messages announce runs of arrays (ipc/messages.py) or not.
        runs = "def frames_in_order" in (tree / "tensorserve" / "ipc" / "messages.py").read_text()
        # And whose front ends send plain requests as runs (protocol.in_runs) or not.
        request_runs = "def in_runs" in protocol
        result = drive(
            args, ours, child.pid, "traceparent, request_id]" in protocol, runs, request_runs
        )
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
        ours.close()
    stats = json.loads((repository / "stats.json").read_text())
    return result | {
        "mean_batch": stats["avg_batch_size"],
        "batch_ms": stats["avg_batch_duration_ms"],
        # Of the padded positions, the share that held an item (length-aware batches pad least).
        "padding_efficiency": stats.get("padding_efficiency"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--outstanding", type=int, default=512, help="requests in flight")
    parser.add_argument("--per-message", type=int, default=16, help="requests per message")
    parser.add_argument("--flat-ms", type=float, default=5.0)
    parser.add_argument(
        "--flat-device", choices=["cpu", "cuda"], default="cpu",
        help="the flat model's sleep on the host (cpu), or the GPU kept busy (cuda)",
    )  # fmt: skip
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop-on-error", action="store_true", help="exit at the first error reply"
    )
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--scheduler", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scheduler:
        repository, fd, pid, stats = args.scheduler
        scheduler(repository, int(fd), int(pid), stats)
        return
    sys.path.insert(0, str(HERE.parent / "bench"))
    from tensorserve_bench.repositories import write_flat_model

    work = tempfile.TemporaryDirectory(prefix="scheduler-ceiling-")
    repository = write_flat_model(
        Path(work.name) / "repo", flat_ms=args.flat_ms, device=args.flat_device
    ).parent
    rows = []
    for repeat in range(args.repeats):
        for tree in args.tree:
            result = {
                "tree": str(tree),
                "repeat": repeat + 1,
                **one_run(tree.resolve(), repository, args),
            }
            rows.append(result)
            print(
                f"{tree!s:24s} {result['requests_per_s']:9,.0f} req/s  scheduler "
                f"{result['scheduler_cpu_us_per_request']:6.1f} us/req (its loop "
                f"{result['loop_thread_cpu_us_per_request']:5.1f})  "
                f"({100 * result['scheduler_cpu_share']:.0f}% of a core; driver "
                f"{100 * result['driver_cpu_share']:.0f}%)  batch {result['mean_batch']:.1f} items "
                f"{result['batch_ms']:.1f} ms  padding efficiency {result['padding_efficiency'] or 0:.2f}  "
                f"failed {result['failed']}",
                flush=True,
            )
    work.cleanup()
    if args.output is not None:
        meta = {"outstanding": args.outstanding, "per_message": args.per_message,
                "flat_ms": args.flat_ms, "flat_device": args.flat_device, "duration": args.duration, "date": time.strftime("%F %T")}  # fmt: skip
        args.output.write_text(json.dumps({"settings": meta, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
