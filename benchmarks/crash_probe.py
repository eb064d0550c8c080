#!/usr/bin/env python3
"""Crash probe: what a caller whose item kills the worker costs everyone else,
measured the way an operator would try it (issue #37). One command:

    python benchmarks/crash_probe.py [--seconds 30] [--rounds 1]

A flat-cost model (100 ms a forward of up to 16 items, whatever the batch:
a GPU-like model), ``isolation = "process"``, eager dispatch, served by
``python -m tensorserve serve`` in a child process. 16 closed-loop callers
each send one short item after another (y = 2x checked); with the killer,
one more caller sends an item that makes the model call ``os._exit``. Two
killers:

    waiting (the default)     send, wait for the 500, sleep ``--killer-pause-s``
                              (1 s), repeat: one search at a time (issue #37)
    --killer-every-s 1.0      send one every second on a timer, whatever is
                              answered: searches overlap, suspects of several
                              crashes meet in one queue (issue #51)

Each round runs
``--seconds`` clean, then as long with the killer, and prints per load:

    good/s, good failed, killer 500s, worker restarts (/metrics), batches and
    their mean size (stats), recoveries by kind, and the retry splits the
    server logged ("a batch of 9 failed; running it again as 4 + 5")

plus, with the killer, how long each killer took to be answered (the whole
culprit search) and the good items answered per second inside those
searches and outside them. The ratio (good/s with the killer over clean)
is what the scheduler must keep at or above 50% (docs/reliability.md,
"Crash recovery under steady traffic"): the exit status is 1 below ``--goal``
or if any good request failed. ``--rows A B`` and
``--max-queue-delay-ms`` reproduce benchmarks/soak.py's load (items of 4-31
rows, a 2 ms delay) on the same harness.

Self-contained on purpose: it imports nothing of the server but starts it as
an operator would, so it keeps measuring whatever the batcher becomes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np

MODEL_NAME = "probe"
KILL_MARKER = 7.0  # an item whose first value is 7 kills the worker running it
MODEL_PY = """
import os
import time

import torch


class Model(torch.nn.Module):
    def forward(self, x):
        if (x[:, 0, 0] == 7).any():
            os._exit(7)  # the worker dies: a segfault, the OOM killer, a CUDA abort
        time.sleep(0.1)  # a flat 100 ms per forward, whatever the batch (a GPU)
        return x * 2
"""
CONFIG = """
max_batch_size = 16
isolation = "process"
device = "cpu"
[dynamic_batching]
dispatch = "eager"
{delay}
[faults]
worker_template = {template}
[warmup]
enabled = false
[[input]]
name = "x"
dtype = "float32"
shape = [-1, 4]
[[output]]
name = "y"
dtype = "float32"
shape = [-1, 4]
"""
ROUTE = f"/v2/models/{MODEL_NAME}/infer"
HEADERS = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
CALLERS = 16
# Good throughput with the killer, as a share of the clean run's, that the
# scheduler must keep (issue #37; docs/reliability.md).
GOAL_RATIO = 0.5
ANSWER_TIMEOUT_S = 60.0  # a good request unanswered this long counts as hung
START_TIMEOUT_S = 120.0
# The server's log line for a recovered batch (batching/results.py).
RETRY_LINE = re.compile(
    r"a batch of (\d+) failed .*; running it again as ([\d +]+|-)(?:; (\d+) back to the queue)?$"
)
# How a dead worker was replaced (runtime/isolated.py): a swap for the loaded
# standby, or a new worker started while the callers wait.
SWAP_LINE = "the standby worker"
START_LINE = "starting a new worker process"


# ---------------------------------------------------------------- pure parts
def body(x: np.ndarray) -> bytes:
    """The native msgpack body of one item (docs/protocol.md)."""
    tensor = {"dtype": "float32", "shape": list(x.shape), "data": x.tobytes()}
    return bytes(msgpack.packb({"items": [{"x": tensor}]}))


def answer_is_right(content: bytes, x: np.ndarray) -> bool:
    output = msgpack.unpackb(content)["outputs"][0]["y"]
    y = np.frombuffer(output["data"], np.float32).reshape(output["shape"])
    return y.shape == x.shape and bool(np.array_equal(y, x * 2))


def retry_splits(log_lines: list[str]) -> list[str]:
    """``"9 -> 4 + 5"`` for each recovered batch the server logged."""
    found = (RETRY_LINE.search(line.rstrip()) for line in log_lines)
    return [f"{m.group(1)} -> {m.group(2).strip()}" + (f" (+{m.group(3)} back)" if m.group(3) else "")
            for m in found if m]


def worker_restarts(metrics_text: str) -> int:
    for line in metrics_text.splitlines():
        if line.startswith("tensorserve_worker_restarts_total") and MODEL_NAME in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server counted between two reads of /stats."""
    batches = after["total_batches"] - before["total_batches"]
    items = after["batch_items"] - before["batch_items"]
    sizes = {
        bound: count - before["batch_size_histogram"].get(bound, 0)
        for bound, count in after["batch_size_histogram"].items()
    }
    recoveries = {
        kind: count - before["recoveries"].get(kind, 0)
        for kind, count in after["recoveries"].items()
    }
    return {
        "batches": batches,
        "mean_batch_size": items / batches if batches else 0.0,
        "batch_sizes": {k: v for k, v in sizes.items() if v},  # histogram bucket bound: batches
        "recoveries": {k: v for k, v in recoveries.items() if v},
        # since the server started: the most times one item was sent again
        # because a batch ahead of it killed its worker (recovery.MAX_RERUNS)
        "most_reruns": after.get("most_reruns", 0),
    }


def merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping windows as one (killers on a timer overlap)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def in_windows(times: list[float], windows: list[tuple[float, float]]) -> int:
    return sum(1 for t in times if any(start <= t <= end for start, end in windows))


# ---------------------------------------------------------------- the load
@dataclass
class Tally:
    good_done: list[float] = field(default_factory=list)  # monotonic time of each right answer
    good_failed: Counter[str] = field(default_factory=Counter)
    killers: list[tuple[float, float, int]] = field(default_factory=list)  # sent, answered, status


async def good_caller(session: aiohttp.ClientSession, url: str, seed: int, rows: tuple[int, int],
                      until: float, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    while time.monotonic() < until:
        x = rng.uniform(20, 100, size=(int(rng.integers(rows[0], rows[1] + 1)), 4))
        x = x.astype(np.float32)
        try:
            async with session.post(url + ROUTE, data=body(x), headers=HEADERS) as response:
                content = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            tally.good_failed[type(exc).__name__] += 1
            continue
        if status != 200:
            tally.good_failed[str(status)] += 1
        elif answer_is_right(content, x):
            tally.good_done.append(time.monotonic())
        else:
            tally.good_failed["200 wrong rows"] += 1


async def kill_once(session: aiohttp.ClientSession, url: str, x: np.ndarray, tally: Tally) -> None:
    sent = time.monotonic()
    try:
        async with session.post(url + ROUTE, data=body(x), headers=HEADERS) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        status = 0
    tally.killers.append((sent, time.monotonic(), status))


async def killer(session: aiohttp.ClientSession, url: str, rows: int, pause_s: float,
                 every_s: float | None, until: float, tally: Tally) -> None:
    """Waiting (``every_s`` None): send, wait for the answer, sleep ``pause_s``.
    On a timer: send every ``every_s`` whatever is answered, so killers overlap
    whenever a search takes longer than ``every_s``."""
    x = np.full((rows, 4), 50.0, np.float32)
    x[0, 0] = KILL_MARKER
    if every_s is None:
        while time.monotonic() < until:
            await kill_once(session, url, x, tally)
            await asyncio.sleep(pause_s)
        return
    sent: list[asyncio.Task[None]] = []
    next_at = time.monotonic()
    while next_at < until:
        sent.append(asyncio.create_task(kill_once(session, url, x, tally)))
        next_at += every_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.gather(*sent)


async def load(url: str, seconds: float, rows: tuple[int, int], with_killer: bool,
               pause_s: float, every_s: float | None) -> tuple[Tally, float]:
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.monotonic()
        until = started + seconds
        work = [good_caller(session, url, seed, rows, until, tally) for seed in range(CALLERS)]
        if with_killer:
            work.append(killer(session, url, rows[0], pause_s, every_s, until, tally))
        await asyncio.gather(*work)
        return tally, time.monotonic() - started


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return bytes(response.read())


def write_repository(root: Path, max_queue_delay_ms: float | None, template: bool) -> None:
    folder = root / MODEL_NAME
    (folder / "1").mkdir(parents=True)
    delay = "" if max_queue_delay_ms is None else f"max_queue_delay_ms = {max_queue_delay_ms}"
    config = CONFIG.format(delay=delay, template=str(template).lower())
    (folder / "config.toml").write_text(textwrap.dedent(config))
    (folder / "1" / "model.py").write_text(textwrap.dedent(MODEL_PY))


def start_server(repository: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tensorserve", "serve", "--model-repository", str(repository),
               "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "-1",
               "--log-level", "WARNING", "--no-access-log"]
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}):\n{log.read_text()}")
        try:
            get(f"http://127.0.0.1:{port}/v2/models/{MODEL_NAME}/ready")
            return server
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    stop_server(server)
    raise SystemExit(f"the server was not ready within {START_TIMEOUT_S:.0f} s")


def stop_server(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's session (its workers too), SIGKILL if it lingers."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- one load, measured
def measure(url: str, log: Path, args: argparse.Namespace, with_killer: bool) -> dict[str, Any]:
    stats_url = f"{url}/v2/models/{MODEL_NAME}/stats"
    stats_before = json.loads(get(stats_url))["batching"]
    restarts_before = worker_restarts(get(f"{url}/metrics").decode())
    log_lines_before = len(log.read_text().splitlines())
    tally, seconds = asyncio.run(load(url, args.seconds, tuple(args.rows), with_killer,
                                      args.killer_pause_s, args.killer_every_s))
    stats = stats_delta(stats_before, json.loads(get(stats_url))["batching"])
    restarts = worker_restarts(get(f"{url}/metrics").decode()) - restarts_before
    new_lines = log.read_text().splitlines()[log_lines_before:]
    splits = retry_splits(new_lines)
    result: dict[str, Any] = {
        "killer": with_killer, "seconds": round(seconds, 2),
        "good": len(tally.good_done), "good_per_s": round(len(tally.good_done) / seconds, 1),
        "good_failed": dict(tally.good_failed), "worker_restarts": restarts,
        "standby_swaps": sum(SWAP_LINE in line for line in new_lines),
        "workers_started_while_waiting": sum(START_LINE in line for line in new_lines),
        **stats, "retry_splits": splits,
    }  # fmt: skip
    if with_killer:
        answers = [(sent, answered) for sent, answered, _ in tally.killers]
        windows = merged(answers)
        in_search_s = sum(end - start for start, end in windows)
        good_in = in_windows(tally.good_done, windows)
        result |= {
            "killer_statuses": dict(Counter(str(status) for _, _, status in tally.killers)),
            "killer_answer_s": [round(end - start, 2) for start, end in answers],
            "share_of_time_in_search": round(in_search_s / seconds, 2),
            "good_per_s_in_search": round(good_in / in_search_s, 1) if in_search_s else None,
            "good_per_s_outside": round((len(tally.good_done) - good_in)
                                        / max(seconds - in_search_s, 1e-9), 1),
        }  # fmt: skip
    return result


def print_table(rounds: list[dict[str, Any]]) -> None:
    print(f"{'round':>5} {'clean/s':>8} {'killer/s':>8} {'ratio':>6} {'failed':>6} "
          f"{'500s':>5} {'restarts':>8} {'search s (median)':>17} {'in search/s':>11} "
          f"{'outside/s':>9}  batches clean -> killer (mean size)")
    for i, r in enumerate(rounds, 1):
        clean, mixed = r["clean"], r["with_killer"]
        failed = sum(clean["good_failed"].values()) + sum(mixed["good_failed"].values())
        answers = mixed["killer_answer_s"]
        search = f"{statistics.median(answers):.2f}" if answers else "-"
        print(f"{i:>5} {clean['good_per_s']:>8.1f} {mixed['good_per_s']:>8.1f} "
              f"{100 * r['ratio']:>5.0f}% {failed:>6} {mixed['killer_statuses'].get('500', 0):>5} "
              f"{mixed['worker_restarts']:>8} {search:>17} {mixed['good_per_s_in_search']!s:>11} "
              f"{mixed['good_per_s_outside']:>9}  {clean['batches']} ({clean['mean_batch_size']:.1f})"
              f" -> {mixed['batches']} ({mixed['mean_batch_size']:.1f})")
        print(f"{'':>5} restarts: {mixed['standby_swaps']} standby swaps, "
              f"{mixed['workers_started_while_waiting']} new workers started while callers waited; "
              f"recoveries {mixed['recoveries']}; most reruns of one item {mixed['most_reruns']}")
        splits = Counter(mixed["retry_splits"]).most_common()
        print(f"{'':>5} retries (batch -> parts: times): "
              + ", ".join(f"{split}: {times}" for split, times in splits))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each load")
    parser.add_argument("--rounds", type=int, default=1, help="clean + killer pairs, alternating")
    parser.add_argument("--rows", type=int, nargs=2, default=[4, 4], metavar=("MIN", "MAX"),
                        help="rows of 4 floats per good item (soak.py: 4 31)")
    parser.add_argument("--max-queue-delay-ms", type=float, default=None,
                        help="config's max_queue_delay_ms (unset: its default; soak.py: 2)")
    parser.add_argument("--killer-pause-s", type=float, default=1.0,
                        help="the killer's sleep after each 500 (waiting mode, the default)")
    parser.add_argument("--killer-every-s", type=float, default=None,
                        help="send a killer every this many seconds, not waiting for answers "
                             "(issue #51's load: 1.0)")
    parser.add_argument("--worker-template", action=argparse.BooleanOptionalAction, default=True,
                        help="[faults] worker_template (off: every new worker loads the model)")
    parser.add_argument("--goal", type=float, default=GOAL_RATIO,
                        help="least ratio (with the killer / clean) that passes")
    parser.add_argument("--out", default="benchmarks/results/crash_probe.json")
    parser.add_argument("--server-log", default=None,
                        help="keep the server's log here (its lines carry times: the phases "
                             "of each search)")
    args = parser.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository, log = Path(tmp, "repository"), Path(tmp, "server.log")
        write_repository(repository, args.max_queue_delay_ms, args.worker_template)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(repository, port, log)
        try:
            time.sleep(3)  # the standby worker loads in the background
            for _ in range(args.rounds):
                clean = measure(url, log, args, with_killer=False)
                mixed = measure(url, log, args, with_killer=True)
                ratio = mixed["good_per_s"] / clean["good_per_s"] if clean["good_per_s"] else 0.0
                rounds.append({"clean": clean, "with_killer": mixed, "ratio": round(ratio, 3)})
        finally:
            stop_server(server)
            if args.server_log:
                Path(args.server_log).write_text(log.read_text())
    print_table(rounds)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "callers": CALLERS, "seconds": args.seconds, "rows": args.rows,
        "max_queue_delay_ms": args.max_queue_delay_ms, "worker_template": args.worker_template,
        "goal_ratio": args.goal,
        "killer_pause_s": args.killer_pause_s, "killer_every_s": args.killer_every_s,
        "rounds": rounds,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    failed = any(sum(r[k]["good_failed"].values()) for r in rounds for k in ("clean", "with_killer"))
    worst = min(r["ratio"] for r in rounds)
    print(f"worst ratio {100 * worst:.0f}% (goal >= {100 * args.goal:.0f}%); good requests failed: "
          f"{'some' if failed else 'none'}; saved {args.out}")
    return 1 if failed or worst < args.goal else 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
