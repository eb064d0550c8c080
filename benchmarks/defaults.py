#!/usr/bin/env python3
"""Do tensorserve's defaults serve every bundled model well? One run.

    python benchmarks/defaults.py                  # about 7 minutes on 2 cores
    python benchmarks/defaults.py --quick          # a smoke run (~2 minutes)
    python benchmarks/defaults.py --contenders 'defaults=;thread=--isolation=thread'

Each of the five bundled models (tagger, attention_tagger and gru_tagger at
the benchmark's size, vocab 30000; embedder and image_filter as bundled)
is served alone, from a config.toml with nothing tuned (no ``isolation``,
no ``max_batch_tokens``), by each contender: the former defaults (a model
thread, no budget), today's defaults (``isolation = "auto"``: a worker
process on a CPU with 2+ CPUs; ``max_batch_tokens = "auto"``: a learnt
budget) and the tagger's hand-tuned settings (a worker process, 1024). Every contender serves every
model once per repeat, alternating, so ratios come from the same minutes.
One item per request, lengths uniform 8..128 (both axes of an image),
closed loop at ``--concurrency``.

Prints a table per model (items/s and p99, medians over the repeats, and
each contender's ratio to the defaults) and writes
benchmarks/results/defaults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from generate_example_weights import make_variant
from tensorserve_bench import ServedHttpTarget, Variant, run_bench, uniform
from tensorserve_bench.repositories import TUNED_KEYS, cached_copy
from tensorserve_bench.results import save

CACHE = ROOT / "benchmarks" / ".cache" / "defaults-per-model"
RESULTS = ROOT / "benchmarks" / "results" / "defaults.json"
# The token models at the benchmark's size (docs/performance.md); the others as bundled.
BIGGER = {"tagger", "attention_tagger", "gru_tagger"}
MODELS = ("tagger", "attention_tagger", "gru_tagger", "embedder", "image_filter")
# The first is the baseline of the ratios: the defaults before they were
# learnt (a model thread, no budget).
CONTENDERS = (
    "thread, no budget=--isolation=thread --max-batch-tokens=0;"
    "defaults=;"
    "process, 1024=--isolation=process --max-batch-tokens=1024"
)


def bigger(source: Path, dest: Path) -> None:
    make_variant(source, dest, {"vocab_size": 30000})


def repository(model: str) -> Path:
    """A repository holding only ``model``, its config without tuned keys."""
    folder = CACHE / model
    build, key = (bigger, "vocab_size=30000") if model in BIGGER else (None, "")
    cached_copy(ROOT / "model_repository" / model, folder / model, build, key=key,
                without=TUNED_KEYS)
    return folder


def parse_contenders(text: str) -> list[tuple[str, list[str]]]:
    pairs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        pairs.append((name.strip(), flags.split()))
    return pairs


async def measure(model: str, name: str, flags: list[str], args: Any) -> Any:
    result = await run_bench(
        lambda v: ServedHttpTarget(str(repository(model)), model, flags),
        variants=[Variant(name)],
        lengths=uniform(8, 128),
        concurrency=[args.concurrency],
        duration=args.duration,
        warmup=args.warmup,
        max_id=30000 if model in BIGGER else 4096,
        seed=args.seed,
    )
    return result.points[0]


async def run(args: Any) -> dict[str, Any]:
    contenders = parse_contenders(args.contenders)
    models = [m.strip() for m in args.models.split(",")]
    for model in models:
        repository(model)
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for model in models:
            for name, flags in contenders:
                point = await measure(model, name, flags, args)
                rows.append({
                    "model": model, "contender": name, "flags": flags, "repeat": repeat + 1,
                    "items_per_s": point.items_per_s, "p50_ms": point.latency_ms["p50"],
                    "p99_ms": point.latency_ms["p99"], "avg_batch_size": point.avg_batch_size,
                    "errors": point.errors,
                })
                print(f"#{repeat + 1} {model:16s} {name:14s} {point.items_per_s:8.1f} items/s "
                      f"p99 {point.latency_ms['p99']:6.1f} ms  batch {point.avg_batch_size:4.1f}",
                      flush=True)
    return {"rows": rows, "contenders": contenders, "models": models}


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Medians over the repeats, and each contender's per-repeat ratio to
    the first contender (the defaults) with its median."""
    table = []
    first = result["contenders"][0][0]
    for model in result["models"]:
        rows = [r for r in result["rows"] if r["model"] == model]
        base = {r["repeat"]: r["items_per_s"] for r in rows if r["contender"] == first}
        for name, _ in result["contenders"]:
            mine = [r for r in rows if r["contender"] == name]
            ratios = [r["items_per_s"] / base[r["repeat"]] for r in mine if base.get(r["repeat"])]
            table.append({
                "model": model, "contender": name,
                "items/s": round(statistics.median(r["items_per_s"] for r in mine), 1),
                "p99 ms": round(statistics.median(r["p99_ms"] for r in mine), 1),
                "batch": round(statistics.median(r["avg_batch_size"] for r in mine), 1),
                f"x {first}": round(statistics.median(ratios), 2) if ratios else None,
                "ratios": " ".join(f"{x:.2f}" for x in ratios),
            })
    return table


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of dicts that share their keys."""
    cells = [list(rows[0])] + [["" if v is None else str(v) for v in r.values()] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contenders", default=CONTENDERS,
                        help="';'-separated name=server flags; the first is the baseline")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 3 s points")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.duration, args.warmup = 1, 3.0, 1.0
    result = asyncio.run(run(args))
    table = summary(result)
    print(format_rows(table))
    command = "python " + " ".join(sys.argv)
    save(args.output, {"command": command, "settings": vars(args) | {"output": str(args.output)},
                       **result, "summary": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
