#!/usr/bin/env python3
"""The KServe v2 (OIP) JSON path against the native msgpack one, per item.

    python benchmarks/oip_codec.py                     # ~2 minutes
    python benchmarks/oip_codec.py /tmp/before .       # the HTTP section for two source trees
    # -> benchmarks/results/oip_codec.json

codec  In-process, no server: what the server spends per tagger item
       (input_ids + attention_mask int64 in, logits T x 9 float32 out) to
       decode and validate a request and to encode its answer, for each
       protocol: native msgpack (typed tensors, as the Python client sends),
       OIP JSON, OIP JSON read and written by the stdlib ``json`` module
       (the codec before ``wire/oip_json.py``, swapped in within this run),
       and OIP with binary tensors (tritonclient's default).
http   A real server per source tree on loopback, a model with the tagger's
       inputs and outputs that costs nothing (so the protocol is all there
       is), one request at a time, lengths uniform 8..128, the protocols
       taking turns request by request: p50 and mean per protocol (medians
       over ``--rounds`` rounds; a round per source tree, alternating).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from tensorserve.bench.protocols import encode_request
from tensorserve.bench.repositories import write_token_model
from tensorserve.bench.results import save
from tensorserve.bench.server import ServerProcess
from tensorserve.repository.config import ModelConfig, load_config
from tensorserve.wire import native, oip, oip_json
from tensorserve.wire.validate import validate_item

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "oip_codec.json"
LABELS = 9
PROTOCOLS = ["msgpack", "oip json", "oip json (stdlib)", "oip binary"]
# Each row's request, spelled by tensorserve.bench.protocols.
SPELLING = {"msgpack": "msgpack", "oip json": "json", "oip binary": "binary"}


# ---------------------------------------------------------------------- bodies
def tokens(length: int) -> np.ndarray:
    return (np.arange(length, dtype=np.int64) * 31) % 4000 + 1


def request_body(protocol: str, length: int) -> tuple[bytes, dict[str, str]]:
    """One item's request as a client sends it, and its headers: plain JSON
    has the data inline and gets its answer in JSON; binary asks for a binary
    answer."""
    item = {"input_ids": tokens(length), "attention_mask": np.ones(length, np.int64)}
    encoded = encode_request(SPELLING[protocol], [item], {})
    return encoded.body, {"Content-Type": encoded.content_type, **encoded.headers}


@contextmanager
def stdlib_json() -> Iterator[None]:
    """The OIP codec as it was: the stdlib's json reads and writes."""
    loads, dumps = oip_json.loads, oip_json.dumps

    def plain(value: Any) -> Any:
        return value.tolist() if isinstance(value, np.ndarray) else value

    oip_json.loads = json.loads  # type: ignore[assignment]
    oip_json.dumps = lambda m: json.dumps(m, separators=(",", ":"), default=plain).encode()  # type: ignore[assignment]
    try:
        yield
    finally:
        oip_json.loads, oip_json.dumps = loads, dumps  # type: ignore[assignment]


# ---------------------------------------------------------------------- codec section
def per_call_us(fn: Callable[[], Any], min_time: float = 0.05, repeats: int = 5) -> float:
    """The best of ``repeats`` mean times per call (noise only ever adds time)."""
    loops = 1
    while True:
        started = time.perf_counter()
        for _ in range(loops):
            fn()
        elapsed = time.perf_counter() - started
        if elapsed >= min_time:
            break
        loops *= 2
    best = elapsed / loops
    for _ in range(repeats - 1):
        started = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - started) / loops)
    return best * 1e6


def codec_calls(protocol: str, length: int, config: ModelConfig) -> dict[str, Callable[[], Any]]:
    """The server's decode (with validation) and encode of one item's request."""
    codec = native if protocol == "msgpack" else oip
    body, headers = request_body(protocol, length)
    logits = np.random.default_rng(length).standard_normal((length, LABELS)).astype(np.float32)

    def decode() -> Any:
        request = codec.decode_request(body, headers, config, 64)
        for index, item in enumerate(request.items):
            validate_item(item, config.input, index)
        return request

    request, results = decode(), [{"logits": logits}]
    return {
        "decode": decode,
        "encode": lambda: codec.encode_response(request, results, "tagger", "1", config),
    }


def codec_section(lengths: list[int], rounds: int) -> list[dict[str, Any]]:
    """Each case's best time over ``rounds`` rounds, the cases alternating
    within a round (so a busy minute of this shared machine hits them all)."""
    config = load_config(ROOT / "model_repository" / "tagger" / "config.toml")
    best: dict[tuple[int, str, str], float] = {}
    for _ in range(rounds):
        for length in lengths:
            for protocol in PROTOCOLS:
                stdlib = protocol == "oip json (stdlib)"
                with stdlib_json() if stdlib else nullcontext():
                    calls = codec_calls("oip json" if stdlib else protocol, length, config)
                    for step, call in calls.items():
                        us = per_call_us(call, repeats=3)
                        key = (length, protocol, step)
                        best[key] = min(best.get(key, us), us)
    rows = []
    for length in lengths:
        native_total = best[length, "msgpack", "decode"] + best[length, "msgpack", "encode"]
        for protocol in PROTOCOLS:
            decode_us, encode_us = best[length, protocol, "decode"], best[length, protocol, "encode"]
            total = decode_us + encode_us
            rows.append({"tokens": length, "protocol": protocol, "decode_us": decode_us,
                         "encode_us": encode_us, "total_us": total,
                         "vs_msgpack": total / native_total})
    return rows


# ---------------------------------------------------------------------- http section
# The tagger's contract (repositories.TOKEN_CONTRACT), no warm-up.
SETTINGS = """max_batch_size = 32
device = "cpu"
isolation = "thread"
"""
# Costs next to nothing, and its floats are not round (each writes ~18 digits).
MODEL = """import torch


class Model(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return (input_ids * attention_mask).unsqueeze(-1) / torch.arange(7.0, 16.0)
"""


def http_round(
    tree: Path, repository: Path, requests: int, seed: int, log: Path
) -> list[dict[str, Any]]:
    """One server; the protocols take turns request by request (one
    keep-alive connection each), so a busy moment of the machine costs them
    alike."""
    server = ServerProcess(str(repository), ready_timeout=60, env={"PYTHONPATH": str(tree)},
                           cwd=tree, log=log).start()
    port = server.port
    try:
        lengths = np.random.default_rng(seed).integers(8, 129, size=requests + requests // 5)
        protocols = [p for p in PROTOCOLS if p != "oip json (stdlib)"]
        bodies = {p: {n: request_body(p, n) for n in set(lengths.tolist())} for p in protocols}
        conns = {p: http.client.HTTPConnection("127.0.0.1", port, timeout=10) for p in protocols}
        latencies: dict[str, list[float]] = {p: [] for p in protocols}
        for i, n in enumerate(lengths.tolist()):
            for protocol in protocols:
                body, headers = bodies[protocol][n]
                started = time.perf_counter()
                conns[protocol].request("POST", "/v2/models/noop/infer", body=body, headers=headers)
                response = conns[protocol].getresponse()
                answer = response.read()
                if response.status != 200:
                    raise RuntimeError(answer[:300])
                if i >= requests // 5:  # the first fifth warms up
                    latencies[protocol].append(time.perf_counter() - started)
        return [
            {"tree": str(tree), "protocol": p, "p50_ms": statistics.median(v) * 1e3,
             "mean_ms": statistics.fmean(v) * 1e3}
            for p, v in latencies.items()
        ]
    finally:
        server.stop()


def http_section(trees: list[Path], rounds: int, requests: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp, "repository")
        write_token_model(repository, "noop", MODEL, SETTINGS)
        for round_ in range(rounds):
            for tree in trees:
                log = Path(tmp, "server.log")
                for row in http_round(tree.resolve(), repository, requests, round_, log):
                    rows.append({"round": round_ + 1, **row})
                    print(f"round {round_ + 1}  {row['tree']:24} {row['protocol']:11} "
                          f"p50 {row['p50_ms']:.3f} ms  mean {row['mean_ms']:.3f} ms", flush=True)
    return rows


# ---------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=Path, default=[ROOT],
                        help="source trees for the HTTP section (default: this one)")
    parser.add_argument("--lengths", default="16,64,128", help="tokens per item, codec section")
    parser.add_argument("--codec-rounds", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="HTTP section rounds")
    parser.add_argument("--requests", type=int, default=2000, help="per protocol and round")
    parser.add_argument("--sections", default="codec,http")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    sections = args.sections.split(",")
    results: dict[str, Any] = {"command": " ".join(sys.argv)}
    if "codec" in sections:
        rows = codec_section([int(n) for n in args.lengths.split(",")], args.codec_rounds)
        results["codec"] = rows
        print("\nServer codec per item (decode + validate the request, encode the answer)")
        print(f"{'tokens':>6} {'protocol':<18} {'decode':>9} {'encode':>9} {'total':>9} {'x msgpack':>9}")
        for r in rows:
            print(f"{r['tokens']:>6} {r['protocol']:<18} {r['decode_us']:>7.1f}us "
                  f"{r['encode_us']:>7.1f}us {r['total_us']:>7.1f}us {r['vs_msgpack']:>9.2f}")
    if "http" in sections:
        print("\nHTTP, c=1, a model that costs nothing (lengths 8..128)")
        results["http"] = rows = http_section(args.trees, args.rounds, args.requests)
        print(f"\n{'tree':<24} {'protocol':<11} {'p50 ms':>8} {'mean ms':>8} {'p50 - msgpack':>14}")
        for tree in dict.fromkeys(r["tree"] for r in rows):
            medians = {}
            for protocol in dict.fromkeys(r["protocol"] for r in rows):
                mine = [r for r in rows if r["tree"] == tree and r["protocol"] == protocol]
                p50 = medians[protocol] = statistics.median(r["p50_ms"] for r in mine)
                mean = statistics.median(r["mean_ms"] for r in mine)
                gap = p50 - medians["msgpack"]
                print(f"{tree:<24} {protocol:<11} {p50:>8.3f} {mean:>8.3f} {gap:>+11.3f} ms")
    save(args.output, results)


if __name__ == "__main__":
    main()
