"""benchmarks/frontend.py with ``--frontends``, against a stub source tree
whose ``python -m tensorserve serve`` answers what the benchmark needs (ready,
a model's metadata, 200 to every infer) in one process or, with
``--frontends N``, in N children that share its port (SO_REUSEPORT) and
whose command line names ``tensorserve.frontends.process``, as the real
server's do. The CPU then lands in the front ends, not in the process the
benchmark started, and the rows must say so. A stub of an older tree (no
such flag) is refused before any server starts."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

FRONTEND = """
import json, socket, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METADATA = json.dumps({"name": "zeros", "max_batch_size": 64,
    "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}]}).encode()
BATCHES = [0]  # each infer is one batch of one item that took 1 ms


def statistics():
    count = BATCHES[0]
    one = {"batch_size": 1, "compute_infer": {"count": count, "ns": count * 1_000_000}}
    return json.dumps({"model_stats": [{"name": "zeros", "batch_stats": [one]}]}).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out apart: no 40 ms delayed ACKs

    def answer(self, status, body=b""):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.endswith("/config"):
            self.answer(404)
        elif self.path.endswith("/stats"):
            self.answer(200, statistics())
        else:
            self.answer(200, METADATA if self.path.startswith("/v2/models/") else b"")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        BATCHES[0] += 1
        self.answer(200, b"{}")

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def serve_http(port):
    Server(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve_http(int(sys.argv[1]))
"""

MAIN = """
import signal, subprocess, sys
from tensorserve.frontends.process import serve_http

HAS_FLAG = {has_flag}
args = sys.argv[1:]
if "--help" in args:
    print("usage: tensorserve serve [--port PORT]" + (" [--frontends N]" if HAS_FLAG else ""))
    sys.exit(0)
if "--frontends" in args and not HAS_FLAG:
    sys.exit("tensorserve: error: unrecognized arguments: --frontends")
port = int(args[args.index("--port") + 1])
count = int(args[args.index("--frontends") + 1]) if "--frontends" in args else 1
if count == 1:
    serve_http(port)
module = "tensorserve.frontends.process"
children = [subprocess.Popen([sys.executable, "-m", module, str(port)]) for _ in range(count)]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    while True:
        signal.pause()
finally:
    for child in children:
        child.terminate()
        child.wait()
"""


def stub_tree(folder: Path, *, has_flag: bool) -> Path:
    (folder / "tensorserve" / "frontends").mkdir(parents=True)
    (folder / "tensorserve" / "__init__.py").write_text("")
    (folder / "tensorserve" / "__main__.py").write_text(MAIN.format(has_flag=has_flag))
    (folder / "tensorserve" / "frontends" / "__init__.py").write_text("")
    (folder / "tensorserve" / "frontends" / "process.py").write_text(FRONTEND)
    return folder


@pytest.fixture
def frontend() -> Iterator[Any]:
    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install wrk)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import frontend

        yield frontend
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_rows_split_the_cpu_between_the_scheduler_and_its_front_ends(
    tmp_path: Path, frontend: Any
) -> None:
    tree, output = stub_tree(tmp_path / "tree", has_flag=True), tmp_path / "out.json"
    frontend.main([
        "--tree", str(tree), "--frontends", "1", "2", "--cases", "zeros", "--zeros-c", "4",
        "--protocols", "msgpack", "--duration", "1", "--warmup", "0", "--output", str(output),
    ])  # fmt: skip
    results = json.loads(output.read_text())
    one, two = results["rows"]  # the N = 1 server first, as the order given
    assert (one["frontends"], two["frontends"]) == (1, 2)
    assert one["requests"] > 0 and two["requests"] > 0 and two["non_2xx"] == 0
    assert (one["frontend_processes"], two["frontend_processes"]) == (0, 2)
    assert one["frontend_cpu_s"] == 0 and one["scheduler_cpu_s"] > 0
    # The model's own figures come from the server's statistics (one process: one count).
    assert one["mean_batch"] == 1.0 and one["batch_ms"] == pytest.approx(1.0)
    # The stub's parent only waits: with front ends, the serving CPU is theirs.
    assert two["frontend_cpu_us_per_request"] > 5 * two["scheduler_cpu_us_per_request"]
    assert two["total_cpu_s"] == pytest.approx(
        two["scheduler_cpu_s"] + two["frontend_cpu_s"] + two["workers_cpu_s"]
    )
    ratio = {s["frontends"]: s["total_cpu_vs_one_process"] for s in results["summary"]}
    assert ratio[1] == pytest.approx(1.0)
    assert ratio[2] == pytest.approx(
        two["total_cpu_us_per_request"] / one["total_cpu_us_per_request"]
    )


def test_a_tree_without_the_flag_is_refused_before_any_server_starts(
    tmp_path: Path, frontend: Any
) -> None:
    tree, output = stub_tree(tmp_path / "old", has_flag=False), tmp_path / "out.json"
    with pytest.raises(SystemExit, match="^tree .*old: its `tensorserve serve` has no --frontends"):
        frontend.main([
            "--tree", str(tree), "--frontends", "1", "2", "--cases", "zeros",
            "--output", str(output),
        ])  # fmt: skip
    assert not output.exists()


def test_the_model_figures_are_the_windows_or_none_where_statistics_cannot_say(
    frontend: Any,
) -> None:
    nothing = {"mean_batch": None, "batch_ms": None}
    assert frontend.model_figures(None, (2, 8, 10)) == nothing  # a server that died
    assert frontend.model_figures((1, 4, 10), (1, 4, 10)) == nothing  # no batch in the window
    window = frontend.model_figures((1, 4, 0), (3, 12, 4_000_000))
    assert window == {"mean_batch": 4.0, "batch_ms": 2.0}
