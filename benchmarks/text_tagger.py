#!/usr/bin/env python3
"""Strings in, logits out: the bundled ``text_tagger`` ensemble (the server
tokenizes, then tags) against tokenizing in the client and calling ``tagger``
(issue #39, item 5). One real server on loopback serving the bundled
repository; KServe v2 JSON, one text per request, closed loop at each
concurrency, the two targets alternating at each level in the same run:

    python benchmarks/text_tagger.py                     # c = 1, 32, 64; ~2 minutes
    python benchmarks/text_tagger.py --duration 3 --concurrency 1 8

Prints a table of items/s, p50 and p99 per target and concurrency, and what
the tokenizer step costs per item: its model's compute per item as the
server measured it (``/v2/models/tokenizer/stats``), and ``encode`` /
``encode_batch`` in-process here for comparison. Saves everything to
``benchmarks/results/text_tagger.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import percentiles_ms
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = ROOT / "model_repository"
CORPUS = ROOT / "scripts" / "data" / "tokenizer_corpus.txt"
RESULTS = ROOT / "benchmarks" / "results" / "text_tagger.json"
TARGETS = ("text_tagger", "client tokenizes + tagger")


def texts(count: int, seed: int = 0) -> list[str]:
    """Texts of 1 to 4 corpus lines: about 10 to 120 tokens each."""
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line]
    rng = random.Random(seed)
    return [" ".join(rng.sample(lines, rng.randint(1, 4))) for _ in range(count)]


def ensemble_body(text: str) -> bytes:
    inputs = [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]
    return json.dumps({"inputs": inputs}).encode()


def tagger_body(tokenizer: Tokenizer, text: str) -> bytes:
    encoding = tokenizer.encode(text)  # in the client, as a caller without the ensemble must
    n = len(encoding.ids)
    inputs = [
        {"name": "input_ids", "datatype": "INT64", "shape": [1, n], "data": encoding.ids},
        {"name": "attention_mask", "datatype": "INT64", "shape": [1, n],
         "data": encoding.attention_mask},
    ]  # fmt: skip
    return json.dumps({"inputs": inputs}).encode()


async def closed_loop(
    url: str,
    target: str,
    tokenizer: Tokenizer,
    corpus: list[str],
    concurrency: int,
    warmup: float,
    duration: float,
) -> dict[str, Any]:
    """``concurrency`` callers, each sending its next text when its answer
    came; latencies of the requests sent after ``warmup``, for ``duration``."""
    model = "text_tagger" if target == TARGETS[0] else "tagger"
    latencies: list[float] = []
    errors = 0
    started = time.perf_counter()
    measure_from, stop_at = started + warmup, started + warmup + duration

    async def caller(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal errors
        i = index
        while (now := time.perf_counter()) < stop_at:
            text = corpus[i % len(corpus)]
            i += concurrency
            sent = time.perf_counter()
            body = ensemble_body(text) if model == "text_tagger" else tagger_body(tokenizer, text)
            async with session.post(f"{url}/v2/models/{model}/infer", data=body) as response:
                await response.read()
                ok = response.status == 200
            if now >= measure_from:
                if ok:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(caller(i, session) for i in range(concurrency)))
    summary = percentiles_ms(latencies)
    return {
        "target": target, "concurrency": concurrency, "items": len(latencies), "errors": errors,
        "items_per_s": len(latencies) / duration, "p50_ms": summary["p50"],
        "p99_ms": summary["p99"],
    }  # fmt: skip


def tokenizer_cost(tokenizer: Tokenizer, corpus: list[str]) -> dict[str, float]:
    """In-process: microseconds per item of ``encode`` one at a time, and of
    ``encode_batch`` over batches of 32 (what the tokenizer model runs)."""
    sample = corpus[:2048]
    started = time.perf_counter()
    for text in sample:
        tokenizer.encode(text)
    single = (time.perf_counter() - started) / len(sample)
    started = time.perf_counter()
    for i in range(0, len(sample), 32):
        tokenizer.encode_batch(sample[i : i + 32])
    batched = (time.perf_counter() - started) / len(sample)
    tokens = sum(len(tokenizer.encode(t).ids) for t in sample[:256]) / 256
    return {"encode_us": single * 1e6, "encode_batch32_us": batched * 1e6, "mean_tokens": tokens}


def served_tokenizer_cost(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v2/models/tokenizer/stats") as response:
        batching = json.load(response)["batching"]
    items = batching["batch_items"]
    return {
        "compute_us_per_item": batching["batch_seconds"] / items * 1e6 if items else float("nan"),
        "avg_batch_size": batching["avg_batch_size"],
        "batches": batching["total_batches"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    tokenizer = Tokenizer.from_file(str(REPOSITORY / "tokenizer" / "1" / "tokenizer.json"))
    tokenizer.enable_truncation(512)
    corpus = texts(4096)
    cost = tokenizer_cost(tokenizer, corpus)
    load_before = os.getloadavg()[0]  # a shared machine: say how busy it was
    server = ServerProcess(str(REPOSITORY), ["--grpc-port", "-1"], ready_timeout=180).start()
    runs = []
    try:
        for concurrency in args.concurrency:
            for target in TARGETS:
                run = asyncio.run(
                    closed_loop(
                        server.url,
                        target,
                        tokenizer,
                        corpus,
                        concurrency,
                        args.warmup,
                        args.duration,
                    )
                )
                runs.append(run)
                print(
                    f"{target:28} c={concurrency:<3} {run['items_per_s']:8.1f} items/s  "
                    f"p50 {run['p50_ms']:7.2f} ms  p99 {run['p99_ms']:7.2f} ms  "
                    f"errors {run['errors']}",
                    flush=True,
                )
        served = served_tokenizer_cost(server.url)
    finally:
        server.stop()
    print()
    print(f"{'target':28} {'c':>3} {'items/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for run in runs:
        print(
            f"{run['target']:28} {run['concurrency']:>3} {run['items_per_s']:9.1f} "
            f"{run['p50_ms']:8.2f} {run['p99_ms']:8.2f}"
        )
    print(
        f"\ntokenizer step, as served: {served['compute_us_per_item']:.1f} us/item of compute "
        f"(mean batch {served['avg_batch_size']:.1f} over {served['batches']} batches); "
        f"in-process here: encode {cost['encode_us']:.1f} us/item, encode_batch(32) "
        f"{cost['encode_batch32_us']:.1f} us/item; {cost['mean_tokens']:.0f} tokens/text"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    result = {
        "command": "python benchmarks/text_tagger.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "out"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
        "tokenizer_served": served,
        "tokenizer_in_process": cost,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
