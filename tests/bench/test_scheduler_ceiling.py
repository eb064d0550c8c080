"""benchmarks/scheduler_ceiling.py against this tree: its driver speaks the
front ends' protocol to a real scheduler process, so a change of that
protocol that the benchmark missed fails here, not in a long run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_driver_is_answered_in_shared_batches(tmp_path: Path) -> None:
    output = tmp_path / "ceiling.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scheduler_ceiling.py"), "--tree", str(ROOT),
         "--repeats", "1", "--warmup", "1", "--duration", "1.5", "--flat-ms", "2",
         "--outstanding", "64", "--stop-on-error", "--output", str(output)],
        check=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    (run,) = json.loads(output.read_text())["runs"]
    assert run["failed"] == 0
    assert run["requests_per_s"] > 100
    assert run["scheduler_cpu_us_per_request"] > 0
    assert run["loop_thread_cpu_us_per_request"] > 0  # read from its /proc task
    assert run["mean_batch"] > 2, "64 requests in flight from one driver must share batches"
