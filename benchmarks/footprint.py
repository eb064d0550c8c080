#!/usr/bin/env python3
"""What the bundled repository costs to start and to keep loaded, and what a
worker crash costs it: seconds from ``tensorserve serve`` to
``/v2/health/ready`` answering 200, the processes of the server's tree, their
memory (PSS: each shared page counted once, shared by the processes that map
it; a worker forked from the worker template shares the loaded weights and
torch with it), and the milliseconds from SIGKILL of the tagger's worker to
the next tagger request's answer (``--crashes`` per round; each waits until
the server has its spare worker back).

    python benchmarks/footprint.py                       # defaults vs --isolation thread, 3 rounds
    python benchmarks/footprint.py --contenders 'defaults=;thread=--isolation thread' --rounds 5
    python benchmarks/footprint.py --contenders 'defaults=' --against base=/tmp/base

``--no-spare`` serves a copy of the repository whose models keep no spare
worker (``[faults] standby_worker = false``): a crash then forks (or loads)
a new worker while its callers wait. ``--against NAME=TREE`` adds a
contender that serves the same repository with the defaults of another
source tree (``git archive COMMIT | tar -x -C TREE``).
Contenders take turns, round by round. Prints a table and writes
benchmarks/results/footprint.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess, tree_path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "footprint.json"
CONTENDERS = "defaults=;thread=--isolation thread"
CRASHED = "tagger"  # a process-isolated model of the bundled repository
# The server's INFO lines that name a model's worker: started, or swapped in.
WORKER = re.compile(rf"model '{CRASHED}' instance 0: (?:worker process|the standby worker) (\d+)")
TAGGER_BODY = json.dumps({"inputs": [
    {"name": "input_ids", "shape": [1, 8], "datatype": "INT64", "data": [2, 17, 99, 5, 8, 13, 21, 3]},
    {"name": "attention_mask", "shape": [1, 8], "datatype": "INT64", "data": [1] * 8},
]}).encode()


def infer(url: str, timeout: float = 60.0) -> int:
    request = urllib.request.Request(f"{url}/v2/models/{CRASHED}/infer", TAGGER_BODY,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return int(reply.status)


def tagger_worker(log: Path) -> int | None:
    """The tagger's instance worker, as the server's log last named it."""
    found = WORKER.findall(log.read_text(errors="replace"))
    return int(found[-1]) if found else None


def settle(server: ServerProcess, processes: int, timeout: float = 60.0) -> int:
    """Wait until the tree has ``processes`` (its spare is up again), or
    stops changing for 1 s; the count it settled at."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(server.members())
        if count == processes:
            return count
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since > 1.0:
            return count
        time.sleep(0.05)
    return last


def crash(server: ServerProcess, log: Path, processes: int) -> float | None:
    """Milliseconds from SIGKILL of the tagger's worker to a tagger answer
    (None: the model runs in the server's process)."""
    pid = tagger_worker(log)
    if pid is None:
        return None
    infer(server.url)
    died = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    if psutil.pid_exists(pid):  # the template's child (or ours): gone once it cannot be found
        psutil.wait_procs([psutil.Process(pid)], timeout=30)
    status = infer(server.url)
    ms = 1000 * (time.perf_counter() - died)
    assert status == 200, status
    settle(server, processes)
    return ms


def without_spares(repository: Path, folder: Path) -> Path:
    """A copy of ``repository`` whose models keep no spare worker."""
    copy = folder / "repository"
    shutil.copytree(repository, copy)
    for config in copy.glob("*/config.toml"):
        text = config.read_text()
        if 'platform = "ensemble"' not in text:
            config.write_text(text + "\n[faults]\nstandby_worker = false\n")
    return copy


def measure(flags: list[str], repository: Path, log: Path, tree: str | None, crashes: int,
            timeout: float = 180.0) -> dict[str, object]:
    env, cwd = ({"PYTHONPATH": tree_path(tree)}, tree) if tree else (None, None)
    server = ServerProcess(str(repository), [*flags, "--log-level", "INFO"], ready_timeout=timeout,
                           log=log, env=env, cwd=cwd)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:  # it says why, with the log's tail
        raise SystemExit(f"{shlex.join(server.command)}: not ready: {exc}") from None
    try:
        time.sleep(1.0)  # the spare forks just after the models are ready
        processes = settle(server, -1)
        pss = sum(p.memory_full_info().pss for p in server.members())
        assert server.ready_s is not None
        replaced = [crash(server, log, processes) for _ in range(crashes)]
        return {"ready_s": server.ready_s, "processes": processes, "pss_mb": pss / 2**20,
                "replace_ms": [round(ms, 1) for ms in replaced if ms is not None]}
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=CONTENDERS, help="';'-separated name=server flags")
    parser.add_argument("--against", action="append", default=[], metavar="NAME=TREE",
                        help="a contender serving with another source tree's defaults")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--crashes", type=int, default=3, help="tagger worker kills per round")
    parser.add_argument("--no-spare", action="store_true", help="models keep no spare worker")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    contenders: dict[str, tuple[str, str | None]] = {
        name: (flags, None) for name, flags in (c.split("=", 1) for c in args.contenders.split(";"))
    }
    contenders |= {name: ("", tree) for name, tree in (a.split("=", 1) for a in args.against)}
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="footprint-") as logs:
        repository = without_spares(args.repository, Path(logs)) if args.no_spare else args.repository
        for round_ in range(1, args.rounds + 1):
            for name, (flags, tree) in contenders.items():
                log = Path(logs, f"{name}-{round_}.log")
                measured = measure(shlex.split(flags), repository, log, tree, args.crashes)
                row = {"contender": name, "round": round_, **measured}
                print(f"#{round_} {name:<10} ready {row['ready_s']:5.1f} s  "
                      f"{row['processes']:3} processes  {row['pss_mb']:7.0f} MB PSS  "
                      f"worker killed -> answer {row['replace_ms']} ms", flush=True)
                rows.append(row)
    print(f"\n{'contender':<10} {'ready s (median)':>17} {'processes':>10} {'PSS MB (median)':>16} "
          f"{'replace ms (median)':>20}")
    for name in contenders:
        mine = [r for r in rows if r["contender"] == name]
        replaced = [ms for r in mine for ms in r["replace_ms"]]  # type: ignore[attr-defined]
        print(f"{name:<10} {statistics.median(r['ready_s'] for r in mine):17.1f} "  # type: ignore[misc]
              f"{mine[0]['processes']:>10} {statistics.median(r['pss_mb'] for r in mine):16.0f} "  # type: ignore[misc]
              f"{statistics.median(replaced) if replaced else '-':>20}")
    save(args.output, {"command": "python " + shlex.join(sys.argv),
                       "contenders": {name: flags for name, (flags, _) in contenders.items()},
                       "against": dict(a.split("=", 1) for a in args.against), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
