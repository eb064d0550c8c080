"""The tritonclient example in clients/examples runs against the real server."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT

EXAMPLE = ROOT / "clients" / "examples" / "tritonclient_variable_lengths.py"


def test_the_tritonclient_variable_length_example_runs(server_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", server_url, "--requests", "8"],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "input_ids: INT64 [-1, -1]" in out
    assert "one request of [3, 12] -> logits [3, 12, 9]" in out
    # every request got its own length back
    answers = re.findall(r"request +\d+: \[(\d+), +(\d+)\] -> logits \[(\d+), (\d+), 9\]", out)
    assert len(answers) == 8
    assert all((rows, length) == (r, t) for rows, length, r, t in answers)
    assert "server side:" in out
