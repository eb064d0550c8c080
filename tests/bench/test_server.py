"""The server-process helper: readiness, the process tree (psutil), and a
stop that leaves nothing running. The servers here are tiny scripts."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from tensorserve_bench.server import ChildServer, free_port

from tests.helpers import wait_until

SERVER = """
import http.server, os, subprocess, sys, time

mode, port = sys.argv[1], int(sys.argv[2])
if mode == "crash":
    print("boom: no model here", flush=True)
    sys.exit(3)
if mode == "never-ready":
    time.sleep(60)
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
# A worker that ignores SIGTERM: what LitServe leaves behind.
subprocess.Popen([sys.executable, "-c", STUBBORN])
if mode == "orphan":
    # A worker whose parent exits at once: re-parented to init, in our session.
    PARENT = ("import subprocess, sys, os; "
              f"subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); os._exit(0)")
    subprocess.Popen([sys.executable, "-c", PARENT])


class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def child_server(tmp_path: Path, mode: str, **options: object) -> ChildServer:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(SERVER))
    port = free_port()
    return ChildServer(
        [sys.executable, str(script), mode, str(port)],
        ready_url=f"http://127.0.0.1:{port}/ready",
        log=tmp_path / "server.log",
        name=f"toy-{mode}",
        **options,  # type: ignore[arg-type]
    )


def wait_for_members(
    server: ChildServer, count: int, ready: Callable[[list[psutil.Process]], bool] = bool,
    timeout: float = 20.0,
) -> list[psutil.Process]:
    """The tree once it has exactly ``count`` processes and ``ready`` says so
    (they start and exit on their own time)."""
    members: list[psutil.Process] = []

    def settled() -> bool:
        members[:] = server.members()
        return len(members) == count and ready(members)

    wait_until(settled, f"{count} processes in the server's tree", timeout, poll=0.05)
    return members


def orphans(members: list[psutil.Process]) -> list[psutil.Process]:
    """Members whose parent is not in the tree (the root's is the test's)."""
    pids = {p.pid for p in members}
    return [p for p in members[1:] if p.ppid() not in pids]


def test_stop_kills_the_workers_that_ignore_sigterm_and_reports_them(tmp_path: Path) -> None:
    server = child_server(tmp_path, "stubborn").start()
    try:
        members = wait_for_members(server, 2)
        assert len(members) == 2
        worker = next(p for p in members if p.pid != server.process.pid)  # type: ignore[union-attr]
    finally:
        report = server.stop(linger=0.3)
    assert report.returncode is not None
    assert list(report.leftovers) == [worker.pid] and "SIG_IGN" in report.leftovers[worker.pid]
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in members)
    assert server.members() == []


def test_a_worker_re_parented_to_init_is_still_found_by_session(tmp_path: Path) -> None:
    server = child_server(tmp_path, "orphan", new_session=True).start()
    root = server.process.pid  # type: ignore[union-attr]
    try:
        # the server, its worker, the orphan (once its parent has exited)
        members = wait_for_members(server, 3, lambda m: bool(orphans(m)))
        assert members[0].pid == root
        (orphan,) = orphans(members)
        assert orphan not in psutil.Process(root).children(recursive=True)
    finally:
        report = server.stop(linger=0.3)
    assert orphan.pid in report.leftovers
    assert not psutil.pid_exists(orphan.pid) or orphan.status() == psutil.STATUS_ZOMBIE


def test_usage_sums_the_tree_and_the_sampler_keeps_the_peak(tmp_path: Path) -> None:
    server = child_server(tmp_path, "stubborn", sample_interval=0.05).start()
    try:
        wait_for_members(server, 2)
        usage = server.usage()
        assert usage.processes == 2
        assert usage.rss_bytes > 10 * 2**20  # two Python interpreters
        assert usage.cpu_s > 0
        assert server.peak_rss_bytes >= usage.rss_bytes
    finally:
        server.stop(linger=0.3)


def test_a_server_that_exits_before_it_is_ready_raises_with_its_log(tmp_path: Path) -> None:
    server = child_server(tmp_path, "crash")
    with pytest.raises(RuntimeError, match=r"(?s)status 3 .*boom: no model here"):
        server.start()
    assert server.members() == []


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path: Path) -> None:
    server = child_server(tmp_path, "never-ready", ready_timeout=0.5)
    with pytest.raises(TimeoutError, match="not ready"):
        server.start()
    assert server.process is not None and server.process.poll() is not None
    assert server.members() == []
