#!/usr/bin/env python3
"""Hostile bodies at the full sizes of issue #52, against a real server, while
good callers (a few keep-alive connections, each asking a tiny model again and
again) are served beside them.

    python benchmarks/hostile_bodies.py                        # one process, then --frontends 2
    python benchmarks/hostile_bodies.py --frontends 2 --repeats 1 --only gzip

Each attack is sent ``--repeats`` times, one after another. For each: the
statuses it got, its slowest answer, the good callers' latencies during it
(p50 / p99 / max), their failures, the server tree's RSS growth (the peak,
sampled every 10 ms over every process: scheduler and front ends, less the
tree's RSS just before) and whether a front end was replaced (its pid
changed). The tests (``tests/test_hostile_bodies.py``, "floods") send the
same shapes scaled to a few MiB and assert the bounds; this prints a table
and writes benchmarks/results/hostile_bodies.json.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import msgpack
import numpy as np
from tensorserve_bench.repositories import write_model, write_xy_model
from tensorserve_bench.results import save
from tensorserve_bench.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "hostile_bodies.json"
MIB = 1 << 20
MSGPACK = {"Content-Type": "application/msgpack"}
JSON = {"Content-Type": "application/json"}

GOOD_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * 2
"""
WORDS_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, words):
            return {"n": torch.tensor([[len(row)] for row in words])}
"""
WORDS_CONFIG = """
    max_batch_size = 8
    [warmup]
    enabled = false
    [[input]]
    name = "words"
    dtype = "bytes"
    shape = [-1]
    max_length = 64
    [[output]]
    name = "n"
    dtype = "int64"
    shape = [1]
"""


# ---------------------------------------------------------------------- the attacks
@dataclass(frozen=True)
class Attack:
    name: str
    model: str
    build: Callable[[], tuple[bytes, dict[str, str]]]  # body and headers (gRPC: the message)
    grpc: bool = False


def _native_strings(count: int) -> tuple[bytes, dict[str, str]]:
    # {"items": [{"words": ["ab"] * count}]}, framed by hand: no list of 20M objects here.
    head = msgpack.packb({"items": [{"words": []}]})[:-1]  # the empty array's 0x90 dropped
    return head + b"\xdd" + struct.pack(">I", count) + b"\xa2ab" * count, MSGPACK


def _oip_header(tensor: dict[str, Any]) -> bytes:
    return json.dumps({"inputs": [{"name": "words", "datatype": "BYTES", **tensor}]}).encode()


def _kserve_json_strings(count: int) -> tuple[bytes, dict[str, str]]:
    head = _oip_header({"shape": [1, 1], "data": []})
    at = head.index(b"[]") + 1
    return head[:at] + b",".join([b'"ab"'] * count) + head[at:], JSON


def _binary_empty_strings(count: int, shape: list[int]) -> tuple[bytes, dict[str, str]]:
    frames = b"\0\0\0\0" * count
    header = _oip_header({"shape": shape, "parameters": {"binary_data_size": len(frames)}})
    return header + frames, {"Inference-Header-Content-Length": str(len(header))}


def _gzip_members(size: int) -> tuple[bytes, dict[str, str]]:
    empty = gzip.compress(b"", mtime=0)
    return empty * (size // len(empty)), {"Content-Encoding": "gzip", **JSON}


def _grpc_strings(count: int) -> tuple[bytes, dict[str, str]]:
    from tensorserve.grpc.generated import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="words")
    tensor = request.inputs.add(name="words", datatype="BYTES", shape=[1, 1])
    tensor.contents.bytes_contents.extend([b"ab"] * count)
    return request.SerializeToString(), {}


def _tokenizer_texts(count: int, size: int) -> tuple[bytes, dict[str, str]]:
    text = (b"hello world " * (size // 12 + 1))[:size]
    return msgpack.packb({"items": [{"TEXT": [text]} for _ in range(count)]}), MSGPACK


M = 1 << 20  # the "M" of strings
ATTACKS = [
    Attack("native msgpack 20M strings", "words", lambda: _native_strings(20_000_000)),
    Attack("kserve json 3M strings", "words", lambda: _kserve_json_strings(3_000_000)),
    Attack(
        "binary 8M empty strings [8M,1]",
        "words",
        lambda: _binary_empty_strings(8 * M, [8 * M, 1]),
    ),
    Attack(
        "binary 8M empty strings [1,8M]",
        "words",
        lambda: _binary_empty_strings(8 * M, [1, 8 * M]),
    ),
    Attack("gzip 4 MiB of empty members", "words", lambda: _gzip_members(4 * MIB)),
    Attack("gzip 1 MiB of empty members", "words", lambda: _gzip_members(MIB)),
    Attack("grpc 1M bytes_contents", "words", lambda: _grpc_strings(M), grpc=True),
    Attack("grpc 15M bytes_contents", "words", lambda: _grpc_strings(15 * M), grpc=True),
    Attack("grpc 20M bytes_contents", "words", lambda: _grpc_strings(20 * M), grpc=True),
    Attack("tokenizer 8 texts of 1 MiB", "tokenizer", lambda: _tokenizer_texts(8, MIB)),
]


def send_http(port: int, model: str, body: bytes, headers: dict[str, str]) -> tuple[str, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", f"/v2/models/{model}/infer", body, headers)
        reply = connection.getresponse()
        data = reply.read()
        if reply.getheader("Content-Type", "").startswith("application/msgpack"):
            try:
                data = json.dumps(msgpack.unpackb(data), default=repr).encode()
            except ValueError:
                pass
        return str(reply.status), data[:300].decode("utf-8", "replace")
    except OSError as exc:
        return type(exc).__name__, str(exc)
    finally:
        connection.close()


def send_grpc(address: str, body: bytes) -> tuple[str, str]:
    import grpc

    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,  # the body is already the serialized message
            response_deserializer=None,
        )
        try:
            call(body, timeout=300)
            return "OK", ""
        except grpc.RpcError as error:
            return error.code().name, (error.details() or "")[:300]


# ---------------------------------------------------------------------- the watchers
class GoodCallers:
    """``count`` threads, each on one keep-alive connection, asking ``m`` in a loop."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def _run(self) -> None:
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        body = msgpack.packb(
            {"items": [{"x": {"dtype": "float32", "shape": [1, 4], "data": x.tobytes()}}]}
        )
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("POST", "/v2/models/m/infer", body, MSGPACK)
                reply = connection.getresponse()
                data = reply.read()
                if reply.status != 200:
                    self.failures.append(f"{reply.status} {data[:120]!r}")
            except OSError as exc:
                self.failures.append(repr(exc))
                connection.close()
            self.latencies.append(time.perf_counter() - started)
        connection.close()

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


class PeakRss:
    """The server tree's summed RSS, sampled every 10 ms until ``grown()``."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.baseline = self.peak = server.usage().rss_bytes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, self.server.usage().rss_bytes)

    def grown(self) -> tuple[int, int]:
        """(peak - baseline, now - baseline), bytes."""
        self.stop.set()
        self.thread.join(10)
        now = self.server.usage().rss_bytes
        return max(self.peak, now) - self.baseline, now - self.baseline


def pids(server: ServerProcess) -> set[int]:
    return {p.pid for p in server.members()}


# ---------------------------------------------------------------------- one run
def repository(folder: Path, tokenizer: Path) -> Path:
    write_xy_model(folder, "m", GOOD_MODEL, "max_batch_size = 8\n")
    write_model(folder, "words", WORDS_CONFIG, WORDS_MODEL)
    shutil.copytree(tokenizer, folder / "tokenizer")
    return folder


def _ms(values: list[float], q: float) -> float:
    return round(1000 * float(np.quantile(values, q)), 1) if values else float("nan")


def run_attack(server: ServerProcess, attack: Attack, repeats: int, callers: int) -> dict[str, Any]:
    body, headers = attack.build()
    before = pids(server)
    rss = PeakRss(server)
    statuses: list[str] = []
    details = ""
    latencies: list[float] = []
    with GoodCallers(server.port, callers) as good:
        time.sleep(0.3)  # the good callers' pace before the attack
        for _ in range(repeats):
            started = time.perf_counter()
            if attack.grpc:
                status, details = send_grpc(server.grpc_address, body)
            else:
                status, details = send_http(server.port, attack.model, body, headers)
            latencies.append(time.perf_counter() - started)
            statuses.append(status)
        time.sleep(0.3)
    peak, left = rss.grown()
    after = pids(server)
    good_latencies = good.latencies
    return {
        "attack": attack.name,
        "body_mib": round(len(body) / MIB, 1),
        "statuses": sorted(set(statuses)),
        "details": details,
        "attack_max_s": round(max(latencies), 2),
        "good_calls": len(good_latencies),
        "good_p50_ms": _ms(good_latencies, 0.5),
        "good_p99_ms": _ms(good_latencies, 0.99),
        "good_max_ms": _ms(good_latencies, 1.0),
        "good_failures": len(good.failures),
        "good_failure_examples": good.failures[:3],
        "rss_peak_growth_mib": round(peak / MIB, 1),
        "rss_left_mib": round(left / MIB, 1),
        "processes_gone": len(before - after),
        "processes_new": len(after - before),
    }


def run_server(
    frontends: int, attacks: list[Attack], args: argparse.Namespace, log: Path
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="hostile-") as folder:
        server = ServerProcess(
            str(repository(Path(folder), args.tokenizer)), ["--frontends", str(frontends)], log=log
        ).start()
        try:
            rows = []
            for attack in attacks:
                row = {
                    "frontends": frontends,
                    **run_attack(server, attack, args.repeats, args.callers),
                }
                print_row(row)
                rows.append(row)
            return rows
        finally:
            server.stop()


COLUMNS = [
    ("frontends", "fe", 2),
    ("attack", "attack", 32),
    ("body_mib", "MiB", 6),
    ("statuses", "status", 20),
    ("attack_max_s", "attack s", 8),
    ("good_p50_ms", "good p50", 8),
    ("good_p99_ms", "good p99", 8),
    ("good_max_ms", "good max", 8),
    ("good_failures", "good fail", 9),
    ("rss_peak_growth_mib", "RSS peak+", 9),
    ("rss_left_mib", "RSS left+", 9),
    ("processes_gone", "gone", 4),
]


def print_header() -> None:
    print(" ".join(f"{title:>{width}}" for _, title, width in COLUMNS), flush=True)


def print_row(row: dict[str, Any]) -> None:
    cells = []
    for key, _, width in COLUMNS:
        value = row[key]
        value = ",".join(value) if isinstance(value, list) else value
        cells.append(f"{value!s:>{width}}")
    print(" ".join(cells), flush=True)


def _commit() -> str:
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip() or "?"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frontends", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="each attack, one after another")
    parser.add_argument("--callers", type=int, default=4, help="good keep-alive callers")
    parser.add_argument("--only", default="", help="the attacks whose name holds this")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=ROOT / "model_repository" / "tokenizer",
        help="the tokenizer model's folder (another tree's, say)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    attacks = [a for a in ATTACKS if args.only in a.name]
    rows: list[dict[str, Any]] = []
    print_header()
    with tempfile.TemporaryDirectory(prefix="hostile-logs-") as logs:
        for frontends in args.frontends:
            log = Path(logs, f"server-{frontends}.log")
            rows += run_server(frontends, attacks, args, log)
    save(
        args.output,
        {
            "command": sys.argv,
            "commit": _commit(),
            "tokenizer": str(args.tokenizer),
            "repeats": args.repeats,
            "callers": args.callers,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
