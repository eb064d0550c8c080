#!/usr/bin/env python3
"""A Hugging Face checkpoint served as ``platform = "huggingface_transformers"``
against the same checkpoint behind a hand-written ``model.py`` (issue #53).

One real server on loopback serves both models from one repository made
here: the same BERT-style text classifier (seeded random weights, a
WordPiece vocabulary trained on scripts/data/tokenizer_corpus.txt; smaller
than BERT-base by default, so a 2-core machine runs it), with the same
batching settings and isolation:

    transformers  three config lines; the server tokenizes each text before
                  it is queued, so batches are formed and padded by real tokens
    model.py      what a user writes today: TEXT in, encode_batch and padding
                  inside forward, the checkpoint's classifier

KServe v2 JSON, one text per request, closed loop; both targets at each
concurrency in the same run, alternating:

    python benchmarks/transformers_platform.py                # c = 32, 64; ~2 minutes
    python benchmarks/transformers_platform.py --hidden 768 --layers 12 --heads 12   # BERT-base
    python benchmarks/transformers_platform.py --frontends 2 --targets transformers \
        --out benchmarks/results/transformers_platform_frontends2.json

Prints a table of items/s, p50 and p99 per target and concurrency, and the
models' mean batch sizes (``/v2/models/{name}/stats``). Saves everything to
``benchmarks/results/transformers_platform.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from tensorserve_bench.checkpoints import Size, write_checkpoint
from tensorserve_bench.server import ServerProcess
from tensorserve_bench.summaries import percentiles_ms

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "scripts" / "data" / "tokenizer_corpus.txt"
RESULTS = ROOT / "benchmarks" / "results" / "transformers_platform.json"
TARGETS = {"transformers": "hf_classifier", "model.py": "handwritten_classifier"}

BATCHING = """
max_batch_size = {batch}
isolation = "{isolation}"
[dynamic_batching]
max_queue_delay_ms = 5.0
[warmup]
lengths = [16, 128]
"""

TRANSFORMERS_CONFIG = """
[transformers]
task = "text-classification"
max_length = {max_length}
"""

HANDWRITTEN_CONFIG = """
[parameters]
max_length = {max_length}

[[input]]
name = "TEXT"
dtype = "bytes"
shape = [1]
utf8 = true

[[output]]
name = "logits"
dtype = "float32"
shape = [{labels}]
"""

HANDWRITTEN_MODEL = '''
"""The same checkpoint by hand: tokenize and pad the batch in forward."""
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForSequenceClassification

CHECKPOINT = Path(__file__).with_name("checkpoint")


class Model(torch.nn.Module):
    def __init__(self, max_length: int) -> None:
        super().__init__()
        self.tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding(pad_id=self.tokenizer.token_to_id("[PAD]"))
        self.net = AutoModelForSequenceClassification.from_pretrained(str(CHECKPOINT)).eval()

    def forward(self, TEXT: np.ndarray) -> dict[str, torch.Tensor]:
        encodings = self.tokenizer.encode_batch([row[0].decode("utf-8") for row in TEXT])
        ids = torch.tensor([e.ids for e in encodings])
        mask = torch.tensor([e.attention_mask for e in encodings])
        return {"logits": self.net(input_ids=ids, attention_mask=mask).logits}
'''


def texts(count: int, seed: int = 0) -> list[str]:
    """Texts of 1 to 4 corpus lines: about 10 to 120 tokens each."""
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line]
    rng = random.Random(seed)
    return [" ".join(rng.sample(lines, rng.randint(1, 4))) for _ in range(count)]


def write_repository(repo: Path, size: Size, args: argparse.Namespace) -> None:
    corpus = texts(400, seed=1)
    batching = BATCHING.format(batch=args.max_batch_size, isolation=args.isolation)
    hf = repo / TARGETS["transformers"]
    write_checkpoint(hf / "1", "text-classification", size, 0, args.max_length, corpus)
    (hf / "config.toml").write_text(
        'platform = "huggingface_transformers"\n'
        + batching
        + TRANSFORMERS_CONFIG.format(max_length=args.max_length)
    )
    hand = repo / TARGETS["model.py"]
    write_checkpoint(
        hand / "1" / "checkpoint", "text-classification", size, 0, args.max_length, corpus
    )
    (hand / "1" / "model.py").write_text(textwrap.dedent(HANDWRITTEN_MODEL))
    (hand / "config.toml").write_text(
        batching + HANDWRITTEN_CONFIG.format(max_length=args.max_length, labels=size.labels)
    )


def body(text: str) -> bytes:
    inputs = [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]
    return json.dumps({"inputs": inputs}).encode()


async def closed_loop(
    url: str, model: str, corpus: list[str], concurrency: int, warmup: float, duration: float
) -> dict[str, Any]:
    """``concurrency`` callers, each sending its next text when its answer
    came; latencies of the requests sent after ``warmup``, for ``duration``."""
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
            async with session.post(f"{url}/v2/models/{model}/infer", data=body(text)) as response:
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
        "concurrency": concurrency, "items": len(latencies), "errors": errors,
        "items_per_s": len(latencies) / duration, "p50_ms": summary["p50"],
        "p99_ms": summary["p99"],
    }  # fmt: skip


def tokenize_cost(tokenizer_json: Path, corpus: list[str], max_length: int) -> dict[str, float]:
    """In-process: microseconds per text of what the server runs before
    queueing (``TextEncoder.encode``: the cut rule, then ``encode_batch``),
    one text per call as a one-text request is, and 32 per call."""
    from tensorserve.text.encoder import TextEncoder

    encoder = TextEncoder.from_file(str(tokenizer_json), max_length)
    sample = corpus[:2048]
    started = time.perf_counter()
    for text in sample:
        encoder.encode([text])
    single = (time.perf_counter() - started) / len(sample)
    started = time.perf_counter()
    for i in range(0, len(sample), 32):
        encoder.encode(sample[i : i + 32])
    batched = (time.perf_counter() - started) / len(sample)
    tokens = sum(len(e.input_ids) for e in encoder.encode(sample[:256])) / 256
    return {"encode_1_us": single * 1e6, "encode_32_us": batched * 1e6, "mean_tokens": tokens}


def mean_batch(url: str, model: str) -> float:
    with urllib.request.urlopen(f"{url}/v2/models/{model}/stats") as response:
        return float(json.load(response)["batching"]["avg_batch_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--isolation", default="auto", choices=["auto", "thread", "process"])
    parser.add_argument(
        "--frontends", type=int, default=0, help="serve --frontends N (0: one process)"
    )
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    size = Size(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=2000, positions=512)
    corpus = texts(4096)
    load_before = os.getloadavg()[0]  # a shared machine: say how busy it was
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        write_repository(Path(scratch), size, args)
        tokenizing = tokenize_cost(
            Path(scratch, TARGETS["transformers"], "1", "tokenizer.json"), corpus, args.max_length
        )
        flags = ["--grpc-port", "-1"]
        if args.frontends:
            flags += ["--frontends", str(args.frontends)]
        server = ServerProcess(scratch, flags, ready_timeout=180).start()
        try:
            for concurrency in args.concurrency:
                for target in args.targets:
                    model = TARGETS[target]
                    run = asyncio.run(
                        closed_loop(
                            server.url, model, corpus, concurrency, args.warmup, args.duration
                        )
                    )
                    runs.append({"target": target, **run})
                    print(
                        f"{target:14} c={concurrency:<3} {run['items_per_s']:8.1f} items/s  "
                        f"p50 {run['p50_ms']:7.2f} ms  p99 {run['p99_ms']:7.2f} ms  "
                        f"errors {run['errors']}",
                        flush=True,
                    )
            batches = {target: mean_batch(server.url, TARGETS[target]) for target in args.targets}
        finally:
            server.stop()
    print()
    print(f"{'target':14} {'c':>3} {'items/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for run in runs:
        print(
            f"{run['target']:14} {run['concurrency']:>3} {run['items_per_s']:9.1f} "
            f"{run['p50_ms']:8.2f} {run['p99_ms']:8.2f}"
        )
    print("mean batch size: " + ", ".join(f"{t} {b:.1f}" for t, b in batches.items()))
    print(
        f"tokenizing before queueing, in-process: {tokenizing['encode_1_us']:.1f} us/text one "
        f"at a time, {tokenizing['encode_32_us']:.1f} us/text 32 at a time; "
        f"{tokenizing['mean_tokens']:.0f} tokens/text"
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    result = {
        "command": "python benchmarks/transformers_platform.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "out"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "checkpoint": {"hidden": size.hidden, "layers": size.layers, "heads": size.heads,
                       "max_length": args.max_length},
        "runs": runs,
        "mean_batch_size": batches,
        "tokenize_in_process": tokenizing,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
