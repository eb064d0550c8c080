"""The bundled repository with the defaults (issue #55, item 2): a server, one
worker template and one spare worker shared by the five process-isolated
models, and a worker each: 8 processes and at most 700 MB (PSS, as
benchmarks/footprint.py measures), and a crashed worker is still replaced by
a swap with the spare (docs/threading.md, "One template, one spare").

The readiness bound here is loose, for a loaded CI machine: the goal (8 s on
the 2-core VM) is measured by benchmarks/footprint.py."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import REPOSITORY, ServerProcess
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

ISOLATED = ["attention_tagger", "embedder", "gru_tagger", "image_filter", "tagger"]
PROCESSES = 1 + 1 + len(ISOLATED) + 1  # the server, the template, a worker each, the spare
PSS_MB = 700
READY_S = 90.0
STARTED = re.compile(r"model '(\w+)' instance 0: worker process (\d+) ready")
TAGGER_BODY = {
    "inputs": [
        {"name": "input_ids", "shape": [1, 5], "datatype": "INT64", "data": [2, 17, 99, 5, 3]},
        {"name": "attention_mask", "shape": [1, 5], "datatype": "INT64", "data": [1] * 5},
    ]
}


def _template(server: ServerProcess) -> psutil.Process:
    (template,) = psutil.Process(server.process.pid).children()
    assert "--template" in template.cmdline()
    return template


def _instance_workers(log: Path) -> dict[str, int]:
    return {name: int(pid) for name, pid in STARTED.findall(log.read_text())}


def test_the_bundled_repository_runs_in_eight_processes_and_a_crash_swaps_in_the_spare(
    tmp_path: Path,
) -> None:
    log = tmp_path / "server.log"
    server = ServerProcess(REPOSITORY, "--log-level", "INFO", log=log)
    try:
        assert server.ready_s is not None and server.ready_s < READY_S
        wait_until(lambda: len(server.members()) == PROCESSES, "the spare worker forked", 60)
        pss_mb = sum(p.memory_full_info().pss for p in server.members()) / 2**20
        assert pss_mb <= PSS_MB, f"{pss_mb:.0f} MB PSS in {PROCESSES} processes"

        template = _template(server)
        workers = _instance_workers(log)
        assert sorted(workers) == ISOLATED
        forked = {child.pid for child in template.children()}
        (spare,) = forked - set(workers.values())  # every worker is the template's child

        psutil.Process(workers["tagger"]).send_signal(signal.SIGKILL)
        reply = httpx.post(f"{server.url}/v2/models/tagger/infer", json=TAGGER_BODY, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["outputs"][0]["shape"] == [1, 5, 9]
        # The spare took over (a swap, not a fork or a load) ...
        assert f"model 'tagger' instance 0: the standby worker {spare} took over" in log.read_text()
        # ... and a new one is forked for the next crash, of any model.
        wait_until(
            lambda: len(server.members()) == PROCESSES, "a new spare forked after the swap", 60
        )
        assert {child.pid for child in template.children()} - forked != set()
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
    finally:
        server.stop()
