"""The wrk driver: its report parsed into numbers (units converted), and the
Lua script's body files, which the server's own codecs read back as the
items they were made from, on both protocols. One test runs wrk itself
(where it is installed) against a recording server for a second."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tensorserve_bench.items import FeatureSpec, ItemFactory
from tensorserve_bench.lengths import uniform
from tensorserve_bench.server import ChildServer, free_port
from tensorserve_bench.targets import HttpTarget
from tensorserve_bench.wrk import (
    WrkFailed,
    lua_string,
    measure,
    parse_wrk_output,
    run_wrk,
    write_script,
)

from tensorserve.repository.config import parse_config
from tensorserve.wire import native, oip
from tensorserve.wire.validate import validate_item

# Captured from wrk 4.1.0 (Debian) against python -m http.server (every answer a 404).
REPORT_404 = """\
Running 1s test @ http://127.0.0.1:18765/nonexistent
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   680.09us  283.70us   4.99ms   76.33%
    Req/Sec     2.76k   355.86     3.30k    70.00%
  Latency Distribution
     50%  652.00us
     75%  807.00us
     90%    1.00ms
     99%    1.41ms
  2742 requests in 1.00s, 1.36MB read
  Non-2xx or 3xx responses: 2742
Requests/sec:   2741.61
Transfer/sec:      1.36MB
"""

# wrk's layout (wrk.c print order) with socket errors and latencies in seconds.
REPORT_SOCKET_ERRORS = """\
Running 5s test @ http://127.0.0.1:8000/v2/models/flat/infer
  1 threads and 256 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    81.77ms   21.33ms   2.31s    88.20%
    Req/Sec     3.14k   301.54     3.62k    74.00%
  Latency Distribution
     50%   78.52ms
     75%   86.01ms
     90%   98.34ms
     99%    1.20s
  15643 requests in 5.01s, 10.91MB read
  Socket errors: connect 0, read 3, write 1, timeout 12
Requests/sec:   3122.36
Transfer/sec:      2.18MB
"""

TOKENS = [FeatureSpec("input_ids", "int64", (-1,)), FeatureSpec("attention_mask", "int64", (-1,))]
CONFIG = parse_config(
    {
        "max_batch_size": 64,
        "input": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in TOKENS],
        "output": [{"name": "logits", "dtype": "float32", "shape": [-1, 9]}],
    },
    "zeros",
)


def test_report_with_non_2xx_answers() -> None:
    result = parse_wrk_output(REPORT_404)
    assert result.requests == 2742
    assert result.duration_s == pytest.approx(1.0)
    assert result.requests_per_s == pytest.approx(2741.61)
    assert result.non_2xx == 2742 and result.ok_requests == 0 and result.ok_per_s == 0
    assert result.socket_errors == {}
    assert result.latency_ms == pytest.approx({"p50": 0.652, "p75": 0.807, "p90": 1.0, "p99": 1.41})


def test_report_with_socket_errors_and_seconds() -> None:
    result = parse_wrk_output(REPORT_SOCKET_ERRORS)
    assert (result.requests, result.non_2xx) == (15643, 0)
    assert result.duration_s == pytest.approx(5.01)
    assert result.ok_per_s == pytest.approx(3122.36)
    assert result.socket_errors == {"connect": 0, "read": 3, "write": 1, "timeout": 12}
    assert result.errors == 16
    # The thread stats' "2.31s" maximum is not a percentile; 1.20s is p99.
    assert result.latency_ms == pytest.approx(
        {"p50": 78.52, "p75": 86.01, "p90": 98.34, "p99": 1200.0}
    )


def test_not_a_report() -> None:
    with pytest.raises(WrkFailed, match="not a wrk report"):
        parse_wrk_output("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_lua_string_escapes_every_byte_outside_printable_ascii() -> None:
    assert lua_string('/a b"c\\d') == '"/a b\\034c\\092d"'
    assert lua_string("é\n") == '"\\195\\169\\010"'


def bodies(target: HttpTarget, count: int = 12) -> tuple[list[dict[str, np.ndarray]], list[bytes]]:
    target.specs = TOKENS  # what open() would have discovered
    items, _ = ItemFactory(TOKENS, uniform(8, 128), seed=3).make(count)
    return items, [target.encode_body([item])[0] for item in items]


@pytest.mark.parametrize(
    ("target", "codec"),
    [
        (HttpTarget("http://127.0.0.1:1", "zeros"), native),
        (HttpTarget("http://127.0.0.1:1", "zeros", protocol="json"), oip),
    ],
    ids=["msgpack", "json"],
)
def test_body_files_decode_back_to_the_items(tmp_path: Path, target: HttpTarget, codec) -> None:  # type: ignore[no-untyped-def]
    items, encoded = bodies(target)
    script = write_script(tmp_path, target.infer_path, target.content_type, encoded)

    text = script.read_text()
    files = sorted(tmp_path.glob("body_*.bin"))
    assert len(files) == len(items)
    # Listed in order, read in binary, one request formatted per body.
    positions = [text.index(lua_string(str(f.resolve()))) for f in files]
    assert positions == sorted(positions)
    assert 'io.open(name, "rb")' in text
    assert 'wrk.format("POST", path' in text
    assert lua_string("/v2/models/zeros/infer") in text
    assert lua_string(target.content_type) in text
    for path, item in zip(files, items):
        request = codec.decode_request(path.read_bytes(), {}, CONFIG, 64)
        assert len(request.items) == 1
        decoded = validate_item(request.items[0], CONFIG.input, 0)
        assert decoded.keys() == item.keys()
        for name, array in item.items():
            np.testing.assert_array_equal(decoded[name], array)


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    """A keep-alive HTTP server that answers 200 and records (path, content
    type, body) of every POST."""
    seen: list[tuple[str, str, bytes]] = []

    class Record(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_wrk_sends_the_bodies_in_turn(
    tmp_path: Path, recorder: tuple[str, list[tuple[str, str, bytes]]]
) -> None:
    import shutil

    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install wrk)")
    url, seen = recorder
    target = HttpTarget(url, "zeros")
    _, encoded = bodies(target, count=5)
    script = write_script(tmp_path, target.infer_path, target.content_type, encoded)

    result, wrk_cpu = run_wrk(url, script, connections=1, duration=1)

    assert result.requests > len(encoded) and result.non_2xx == 0 and wrk_cpu > 0
    # One connection: the server sees the bodies in turn, byte for byte. (wrk
    # calls request() once before it starts, to check the script: the cycle
    # starts wherever that left it.)
    assert result.requests <= len(seen) <= result.requests + 1
    start = encoded.index(seen[0][2])
    for index, (path, content_type, body) in enumerate(seen):
        assert (path, content_type) == ("/v2/models/zeros/infer", "application/msgpack")
        assert body == encoded[(start + index) % len(encoded)]


def test_measure_splits_the_servers_cpu_by_role(tmp_path: Path) -> None:
    import shutil

    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (apt-get install wrk)")
    port = free_port()
    # A server process with a child that only waits: the child is a worker and spends nothing
    # (sleep(1), not a Python child, whose start-up could fall inside the window on a busy machine).
    code = (
        "import subprocess, sys, http.server; "
        "child = subprocess.Popen(['sleep', '60']); "
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), "
        "http.server.SimpleHTTPRequestHandler).serve_forever()"
    )
    server = ChildServer(
        [sys.executable, "-c", code], ready_url=f"http://127.0.0.1:{port}/", cwd=tmp_path,
        log=tmp_path / "server.log",
    )  # fmt: skip
    script = write_script(tmp_path / "bodies", "/", "text/plain", [b"x"])
    server.start()
    try:
        window = measure(server, f"http://127.0.0.1:{port}/", script, connections=2, duration=1,
                         warmup=0)  # fmt: skip
    finally:
        server.stop()
    assert window.roles is not None and window.result.requests > 0
    roles = window.roles
    assert roles.scheduler_s > 0 and (roles.frontends, roles.workers) == (0, 1)
    assert roles.workers_s < roles.scheduler_s / 10
    # The same tree, read two ways: /proc by role and psutil as a whole.
    assert window.server_cpu_s is not None
    assert roles.total_s == pytest.approx(window.server_cpu_s, rel=0.2, abs=0.05)
