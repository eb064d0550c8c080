#!/usr/bin/env python3
"""What the bundled repository costs to start and to keep loaded: seconds from
``tensorserve serve`` to ``/v2/health/ready`` answering 200, the processes of
the server's tree, and their memory (PSS: each shared page counted once,
shared by the processes that map it; a worker forked from its model's
template shares the loaded weights and torch with it).

    python benchmarks/footprint.py                       # defaults vs --isolation thread, 3 rounds
    python benchmarks/footprint.py --contenders 'defaults=;thread=--isolation thread' --rounds 5

Contenders take turns, round by round. Prints a table and writes
benchmarks/results/footprint.json.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "footprint.json"
CONTENDERS = "defaults=;thread=--isolation thread"


def measure(flags: list[str], repository: Path, log: Path, timeout: float = 180.0) -> dict[str, float]:
    server = ServerProcess(str(repository), flags, ready_timeout=timeout, log=log)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:  # it says why, with the log's tail
        raise SystemExit(f"{shlex.join(server.command)}: not ready: {exc}") from None
    try:
        time.sleep(1.0)  # standby workers fork just after their model is ready
        tree = server.members()
        pss = sum(p.memory_full_info().pss for p in tree)
        assert server.ready_s is not None
        return {"ready_s": server.ready_s, "processes": len(tree), "pss_mb": pss / 2**20}
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=CONTENDERS, help="';'-separated name=server flags")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    contenders = dict(item.split("=", 1) for item in args.contenders.split(";"))
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="footprint-") as logs:
        for round_ in range(1, args.rounds + 1):
            for name, flags in contenders.items():
                measured = measure(shlex.split(flags), args.repository, Path(logs, "server.log"))
                row = {"contender": name, "round": round_, **measured}
                print(f"#{round_} {name:<10} ready {row['ready_s']:5.1f} s  "
                      f"{row['processes']:3} processes  {row['pss_mb']:7.0f} MB PSS", flush=True)
                rows.append(row)
    print(f"\n{'contender':<10} {'ready s (median)':>17} {'processes':>10} {'PSS MB (median)':>16}")
    for name in contenders:
        mine = [r for r in rows if r["contender"] == name]
        print(f"{name:<10} {statistics.median(r['ready_s'] for r in mine):17.1f} "  # type: ignore[misc]
              f"{mine[0]['processes']:>10} {statistics.median(r['pss_mb'] for r in mine):16.0f}")  # type: ignore[misc]
    save(args.output, {"command": "python " + shlex.join(sys.argv), "contenders": contenders, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
