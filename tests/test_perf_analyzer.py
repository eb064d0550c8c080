"""Triton's perf_analyzer measures the bundled tagger over HTTP and over gRPC
and ends cleanly: exit 0, no error, and its server-side section (which it
computes from the statistics extension, and aborts on when the three compute
counts disagree) printed.

perf_analyzer is not skipped when missing: ``scripts/install_perf_analyzer.sh``
installs it (a venv of its own under benchmarks/.cache, libb64-0d from
Debian when the library is missing) and prints where it is. The requests are
variable-length: each ``--input-data`` entry gives its own ``shape``.
``benchmarks/perf_analyzer.py`` measures the same way, for longer.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPOSITORY, ROOT, ServerProcess

INSTALL = ROOT / "scripts" / "install_perf_analyzer.sh"
LENGTHS = (3, 8, 17, 32, 50, 77, 120, 5)  # tokens per request, one entry each
# perf_analyzer's own "Server:" lines: the breakdown it computed from our statistics.
BREAKDOWN = re.compile(
    r"Successful request count: (\d+)\n.*Avg request latency: \d+ usec \(overhead \d+ usec \+ "
    r"queue \d+ usec \+ compute input \d+ usec \+ compute infer \d+ usec \+ "
    r"compute output \d+ usec\)"
)


@pytest.fixture(scope="module")
def perf_analyzer() -> dict[str, str]:
    """The environment that runs perf_analyzer (installed on first use)."""
    done = subprocess.run(
        ["bash", str(INSTALL)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"installing perf_analyzer failed:\n{done.stderr[-4000:]}"
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    library_path = os.pathsep.join(p for p in (paths["LD_LIBRARY_PATH"],
                                               os.environ.get("LD_LIBRARY_PATH")) if p)
    return {"PERF_ANALYZER": paths["PERF_ANALYZER"], "LD_LIBRARY_PATH": library_path}


@pytest.fixture(scope="module")
def tagger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of the bundled tagger alone (the other bundled models would
    only lengthen its start)."""
    repo = tmp_path_factory.mktemp("perf_analyzer_repo")
    (repo / "tagger").symlink_to(REPOSITORY / "tagger", target_is_directory=True)
    server = ServerProcess(repo)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def input_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--input-data`` with one entry per length: each its own shape."""
    rng = np.random.default_rng(3)
    entries = [
        {
            "input_ids": {"content": rng.integers(1, 4096, n).tolist(), "shape": [n]},
            "attention_mask": {"content": [1] * n, "shape": [n]},
        }
        for n in LENGTHS
    ]
    path = tmp_path_factory.mktemp("perf_analyzer_data") / "tagger.json"
    path.write_text(json.dumps({"data": entries}))
    return path


@pytest.mark.timeout(600)  # the first run installs perf_analyzer
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_tagger_and_ends_cleanly(
    protocol: str, perf_analyzer: dict[str, str], tagger: ServerProcess, input_data: Path
) -> None:
    url = tagger.url.removeprefix("http://") if protocol == "http" else tagger.grpc_address
    command = [
        perf_analyzer["PERF_ANALYZER"], "-m", "tagger", "-i", protocol, "-u", url,
        "--input-data", str(input_data), "--concurrency-range", "8",
        # Three 1 s windows, whatever their spread: the point is a clean end, not a figure.
        "--measurement-interval", "1000", "--max-trials", "3", "--stability-percentage", "999",
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "LD_LIBRARY_PATH": perf_analyzer["LD_LIBRARY_PATH"]},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "error" not in output.lower() and "terminate" not in output, output
    found = BREAKDOWN.search(output)
    assert found, f"no server-side breakdown in perf_analyzer's output:\n{output}"
    assert int(found.group(1)) > 0
    assert re.search(r"Throughput: [\d.]+ infer/sec", output), output
