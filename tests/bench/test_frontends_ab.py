"""benchmarks/frontends_ab.py against this tree twice (the noise of the
method itself): both servers up at once, the pairs' runs alternating, each
run read by role from /proc, and the summary's ratios taken pair by pair."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_two_servers_take_turns_and_each_pair_gives_a_ratio(tmp_path: Path) -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install wrk)")
    output = tmp_path / "ab.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frontends_ab.py"), "--tree", str(ROOT),
         str(ROOT), "--protocols", "msgpack", "--segments", "2", "--seconds", "1",
         "--warmup", "0", "--c", "16", "--flat-ms", "1", "--isolation", "thread",
         "--output", str(output)],
        check=True, cwd=tmp_path, timeout=180,
    )  # fmt: skip
    result = json.loads(output.read_text())
    rows = result["rows"]
    assert [(r["segment"], r["tree"]) for r in rows] == [
        (0, "A ."), (0, "B ."), (1, "B ."), (1, "A ."),
    ], "each pair runs both trees, in turn, the order alternating"  # fmt: skip
    assert all(r["frontend_processes"] == 2 and r["scheduler_cpu_us_per_request"] > 0 for r in rows)
    (summary,) = result["summary"]
    assert summary["protocol"] == "msgpack" and summary["pairs"] == 2 and summary["errors"] == 0
    figure = summary["scheduler_cpu_us_per_request"]
    by_pair = sorted(
        b["scheduler_cpu_us_per_request"] / a["scheduler_cpu_us_per_request"]
        for a, b in ((rows[0], rows[1]), (rows[3], rows[2]))
    )
    assert figure["ratio_min"] == pytest.approx(by_pair[0])
    assert figure["ratio_max"] == pytest.approx(by_pair[1])
