"""The served side of benchmarks/gpu_fill.py: one perf_analyzer run against
a running server, with what the server spent meanwhile.

    find_perf_analyzer  $PERF_ANALYZER (scripts/gpu_run.sh sets it), else
                        scripts/install_perf_analyzer.sh
    run_point           one model, protocol and concurrency: perf_analyzer's
                        items/s, p50, p99 and server breakdown; the GPU's
                        utilisation (NVML) and the server's CPU per request by
                        process role (/proc) over the whole run, and how
                        the server batched it (``server_counts``: mean
                        batch, padding efficiency, items a second of the
                        batches' own CUDA-event time)
    thread_cpu          CPU seconds of every thread of a process tree, by
                        name (/proc/<pid>/task): which thread burns a core
    pyspy_top           the busiest stacks of a server tree (py-spy record),
                        when py-spy is installed

perf_analyzer runs synchronously (one thread per caller) up to 16 callers
and asynchronously above (``--async --max-threads 16``): a thousand client
threads on the server's machine would measure the client.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_check_load import GpuSampler
from tensorserve_bench.proctree import sample_tree, split_cpu

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "scripts" / "install_perf_analyzer.sh"
SYNC_UP_TO = 16  # callers; above, --async with ASYNC_THREADS threads
ASYNC_THREADS = 16
CSV_US = {"p50 latency": "p50_us", "p99 latency": "p99_us", "Server Queue": "queue_us",
          "Server Compute Input": "compute_input_us", "Server Compute Infer": "compute_infer_us",
          "Server Compute Output": "compute_output_us"}  # fmt: skip


def find_perf_analyzer() -> dict[str, str]:
    """perf_analyzer's path and LD_LIBRARY_PATH: from the environment when
    ``PERF_ANALYZER`` is set (scripts/gpu_run.sh sets it and, for its
    libraries alone, ``PERF_ANALYZER_LIBRARY_PATH``), else installed by
    scripts/install_perf_analyzer.sh (a venv under benchmarks/.cache)."""
    binary = os.environ.get("PERF_ANALYZER")
    if binary:
        library_path = os.pathsep.join(p for p in (os.environ.get("PERF_ANALYZER_LIBRARY_PATH"),
                                                   os.environ.get("LD_LIBRARY_PATH")) if p)
        return {"binary": binary, "LD_LIBRARY_PATH": library_path}
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"installing perf_analyzer failed:\n{done.stderr[-2000:]}")
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    library_path = os.pathsep.join(
        p for p in (paths["LD_LIBRARY_PATH"], os.environ.get("LD_LIBRARY_PATH")) if p
    )
    return {"binary": paths["PERF_ANALYZER"], "LD_LIBRARY_PATH": library_path}


@dataclass(frozen=True)
class ServerCounts:
    """A model's counters as its stats endpoint gives them: successful
    requests (Triton's statistics extension) and tensorserve's batching
    counters (items batched, batches, their CUDA-event seconds, real and
    padded elements). Two reads a point apart give the point's own."""

    requests: int
    batches: int
    items: int
    batch_seconds: float
    real_elements: int
    padded_elements: int

    def since(self, before: ServerCounts) -> dict[str, float | None]:
        """The point's mean batch, the share of its padded positions that held
        an item (1 - padding), and the device's items a second of the batches'
        own time (CUDA events: a batch's host-side launch gaps count)."""
        batches, items = self.batches - before.batches, self.items - before.items
        padded = self.padded_elements - before.padded_elements
        seconds = self.batch_seconds - before.batch_seconds
        real = self.real_elements - before.real_elements
        return {
            "mean_batch": round(items / batches, 1) if batches else None,
            "padding_efficiency": round(real / padded, 3) if padded else None,
            "batch_items_per_s": round(items / seconds, 1) if seconds > 0 else None,
            "batch_seconds": round(seconds, 3),
        }


def server_counts(url: str, model: str) -> ServerCounts | None:
    """The model's counters now (None: the endpoint did not answer them)."""
    try:
        with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=10) as response:
            stats = json.load(response)
        batching = stats.get("batching", {})
        return ServerCounts(
            int(stats["model_stats"][0]["inference_stats"]["success"]["count"]),
            int(batching.get("total_batches", 0)), int(batching.get("batch_items", 0)),
            float(batching.get("batch_seconds", 0.0)), int(batching.get("real_elements", 0)),
            int(batching.get("padded_elements", 0)),
        )  # fmt: skip
    except (OSError, KeyError, IndexError, ValueError, TypeError):
        return None


# ----------------------------------------------------------------- threads and stacks
def thread_cpu(pids: Sequence[int], root: Path = Path("/proc")) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, user + system seconds) for every thread of ``pids``."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    found = {}
    for pid in pids:
        try:
            tasks = os.listdir(root / str(pid) / "task")
        except OSError:
            continue
        for tid in tasks:
            try:
                text = (root / str(pid) / "task" / tid / "stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 1 :].split()
            found[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return found


def busiest_threads(before: Mapping[tuple[int, int], tuple[str, float]],
                    after: Mapping[tuple[int, int], tuple[str, float]], requests: int,
                    roles: Mapping[int, str], top: int = 8) -> list[dict[str, Any]]:  # fmt: skip
    """The threads that spent the most CPU between two ``thread_cpu`` readings,
    in µs per request, with their process's role."""
    spent = []
    for key, (name, cpu) in after.items():
        delta = cpu - before.get(key, (name, 0.0))[1]
        if delta > 0:
            spent.append((delta, key, name))
    spent.sort(reverse=True)
    return [{"role": roles.get(pid, "?"), "pid": pid, "thread": name,
             "cpu_us_per_request": round(1e6 * delta / max(1, requests), 1)}
            for delta, (pid, _), name in spent[:top]]  # fmt: skip


def pyspy_top(pid: int, seconds: float, top: int = 12) -> list[str] | None:
    """The ``top`` busiest stacks (sample count first) of ``pid`` and its
    children over ``seconds``, by py-spy, native frames included where it
    can (a wait that spins inside the CUDA driver shows only there: py-spy
    then pauses the processes at each sample, so the run it watches is not
    one whose latency is reported); None when py-spy is not installed."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        return None
    out = Path(f"/tmp/gpu_fill_pyspy_{os.getpid()}.txt")
    failures = []
    for how in (["--native", "--rate", "100"], ["--nonblocking", "--rate", "250"]):
        done = subprocess.run(
            [pyspy, "record", "--pid", str(pid), "--subprocesses", *how, "--format", "raw",
             "--duration", str(max(1, round(seconds))),
             "--output", str(out)],
            capture_output=True, text=True, check=False, timeout=seconds + 30,
        )  # fmt: skip
        if done.returncode == 0 and out.is_file():
            break
        failures.append(f"py-spy {' '.join(how)} failed ({done.returncode}): "
                        f"{done.stderr.strip()[-200:]}")  # fmt: skip
    else:
        return failures
    counts: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            frames = stack.split(";")
            counts[";".join(frames[-6:])] += int(count)  # the innermost frames say what burns
    out.unlink()
    return failures + [f"{count} {stack}" for stack, count in counts.most_common(top)]


# ----------------------------------------------------------------- one point
def run_point(pa: Mapping[str, str], server: Any, model: str, protocol: str, concurrency: int,
              data: Path, window_ms: int, folder: Path, gpu_index: int | None,
              profile_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """perf_analyzer against ``model`` for three windows of ``window_ms``; the
    server's CPU and the GPU's utilisation over the whole run. ``profile_s``:
    also sample the server's stacks with py-spy for that long."""
    url = server.url.removeprefix("http://") if protocol == "http" else server.grpc_address
    csv_path = folder / f"{model}_{protocol}_{concurrency}.csv"
    command = [pa["binary"], "-m", model, "-i", protocol, "-u", url, "--input-data", str(data),
               "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
               # Up to 6 windows for 3 alike: one stalled window (a busy 2-core CI machine
               # froze the server for longer than a window) no longer fails the point.
               "--max-trials", "6", "--stability-percentage", "999", "-f", str(csv_path)]
    if concurrency > SYNC_UP_TO:
        command += ["--async", "--max-threads", str(ASYNC_THREADS)]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": pa["LD_LIBRARY_PATH"]}
    pid = server.process.pid
    before_tree, before_counts = sample_tree(pid), server_counts(server.url, model)
    before_threads = thread_cpu(list(before_tree))
    started, children_before = time.perf_counter(), _children_cpu()
    with GpuSampler(gpu_index) as sampler:
        client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)  # fmt: skip
        profiling = _children_cpu()
        stacks = pyspy_top(pid, profile_s) if profile_s else None
        profiler_cpu = _children_cpu() - profiling
        output, _ = client.communicate(timeout=window_ms / 1000 * 12 + 60)
    wall = time.perf_counter() - started
    client_cpu = _children_cpu() - children_before - profiler_cpu
    after_tree, after_counts = sample_tree(pid), server_counts(server.url, model)
    after_threads = thread_cpu(list(after_tree))
    requests, batching = 0, None
    if before_counts is not None and after_counts is not None:
        requests = after_counts.requests - before_counts.requests
        batching = after_counts.since(before_counts)  # how the server batched the point
    point: dict[str, Any] = {"model": model, "protocol": protocol, "concurrency": concurrency,
                             "seconds": round(wall, 1), "requests": requests}
    if batching is not None and batching["mean_batch"] is not None:  # an ensemble has none
        point["batching"] = batching
    if client.returncode or not csv_path.is_file():
        point["error"] = f"perf_analyzer exit {client.returncode}: {output.strip()[-600:]}"
        return point
    with csv_path.open() as f:
        row = next(csv.DictReader(f))
    point["items_per_s"] = float(row["Inferences/Second"])
    for theirs, ours in CSV_US.items():
        point[ours] = int(row[theirs]) if row.get(theirs, "").strip() else None
    if "error" in output.lower():
        point["warning"] = output.strip()[-400:]
    point["gpu_util"] = None if sampler.mean is None else round(sampler.mean, 1)
    split = split_cpu(before_tree, after_tree, pid)
    cpu = split.as_row(requests)
    point["cpu_us_per_request"] = {role: _round(cpu[f"{role}_cpu_us_per_request"])
                                   for role in ("scheduler", "frontend", "workers", "total")}
    point["cpu_us_per_request"]["perf_analyzer"] = _round(1e6 * client_cpu / requests
                                                          if requests else None)
    point["processes"] = {"frontend": split.frontends, "workers": split.workers}
    roles = {p: ("scheduler" if p == pid else "frontend" if s.is_frontend else "worker")
             for p, s in after_tree.items()}  # fmt: skip
    if concurrency == 1:  # where the c=1 CPU goes, thread by thread
        point["busiest_threads"] = busiest_threads(before_threads, after_threads, requests, roles)
    if stacks is not None:
        point["pyspy_top"] = stacks
    return point


def _children_cpu() -> float:
    """User + system seconds of this process's reaped children (perf_analyzer, py-spy)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


if __name__ == "__main__":
    sys.exit("run benchmarks/gpu_fill.py")
