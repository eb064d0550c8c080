#!/usr/bin/env python3
"""tensorserve's own serving benchmarks (issue 5), all measured in one run.

    python benchmarks/serving.py                 # about 6 minutes on 2 cores
    python benchmarks/serving.py --quick         # a smoke run (~1 minute)

Sections (each alternates its contenders, repeated ``--repeats`` times, so
that ratios come from the same minutes of the same machine):

  overhead   HTTP server vs the in-process ceiling (no HTTP), tagger with its
             shipped 1024-token budget, c=32; each with the model in a
             thread and in a worker process (isolation); beside them the
             server at its defaults (the tagger's config without isolation
             and budget) and the naive loop a user writes without a server
             (FIFO batches of 32, torch's default threads and one thread)
  policy     fifo vs length_aware (+ padded-volume budgets), c=64, for the
             tagger, gru_tagger (a GRU: pays per sequential step) and
             attention_tagger (hand-written attention: pays for every padded
             element)
  dispatch   eager vs timer dispatch over HTTP at c=1, 8, 32
  latency    c=1 HTTP p50 minus the model's own batch-1 forward time (bare,
             back to back; and as the server timed it in the run), the model
             in a thread and in a worker process

The tagger is the bundled model.py at the issue's benchmark size:
Embedding(30000,128) -> 2-layer TransformerEncoder(128, 4 heads, ff 256) ->
Linear(128, 9), weights from a fixed seed (built once under
benchmarks/.cache/). Lengths are uniform 8..128; one item per request.

Writes benchmarks/results/serving.json and docs/img/serving_*.png and prints
a table per section.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from generate_example_weights import make_variant
from tensorserve_bench import (
    InProcessTarget,
    ServedHttpTarget,
    Variant,
    format_table,
    run_bench,
    uniform,
)
from tensorserve_bench.loadgen import PointResult
from tensorserve_bench.repositories import TUNED_KEYS, cached_copy
from tensorserve_bench.results import machine_info, save
from tensorserve_bench.server import override_flags

from tensorserve import ServedModel
from tensorserve.runtime.device import default_intra_op_threads
from tensorserve.settings import Settings

CACHE = ROOT / "benchmarks" / ".cache" / "repository"
DEFAULTS = ROOT / "benchmarks" / ".cache" / "defaults"
# torch's own thread count, read before anything here changes it (the naive loop's default).
TORCH_DEFAULT_THREADS = torch.get_num_threads()
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
IMAGES = ROOT / "docs" / "img"
LENGTHS = uniform(8, 128)


def bigger(source: Path, dest: Path) -> None:
    make_variant(source, dest, {"vocab_size": 30000})


def benchmark_repository() -> Path:
    """The bundled tagger and gru_tagger at the issue's size (vocab 30000)."""
    for model in ("tagger", "gru_tagger", "attention_tagger"):
        # The policy section sets budgets explicitly: the copies start without one.
        cached_copy(ROOT / "model_repository" / model, CACHE / model, bigger,
                    key="vocab_size=30000", without=("max_batch_tokens",))
    return CACHE


def defaults_repository() -> Path:
    """The benchmark tagger with nothing tuned: its config.toml without
    ``isolation`` and ``max_batch_tokens``, so tensorserve's defaults decide."""
    cached_copy(benchmark_repository() / "tagger", DEFAULTS / "tagger", without=TUNED_KEYS)
    return DEFAULTS


def naive_loop(repo: Path, threads: int, args: Any, batch: int = 32) -> dict[str, Any]:
    """What a user writes without a server: items in arrival order, ``batch``
    at a time, each batch padded with zeros to its longest item, one forward,
    every row cut back to its item's length. No queue, no policy, no HTTP;
    the same lengths (uniform 8..128) and token ids as the load generator's."""
    served = ServedModel.from_repository(repo, "tagger", isolation="thread")
    module = served.fn
    assert module is not None
    rng = np.random.default_rng(args.seed)
    pool = [rng.integers(1, 30000, size=int(n)) for n in rng.integers(8, 129, size=1024)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    items, times, cursor = 0, [], 0
    try:
        with torch.inference_mode():
            started = time.perf_counter()
            measuring_from = started + args.warmup
            while (now := time.perf_counter()) < measuring_from + args.duration:
                if now >= measuring_from and not times:
                    items, started = 0, now
                chunk = [pool[(cursor + i) % len(pool)] for i in range(batch)]
                cursor += batch
                t0 = time.perf_counter()
                longest = max(len(x) for x in chunk)
                ids = torch.zeros(batch, longest, dtype=torch.int64)
                mask = torch.zeros(batch, longest, dtype=torch.int64)
                for row, x in enumerate(chunk):
                    ids[row, : len(x)] = torch.from_numpy(x)
                    mask[row, : len(x)] = 1
                logits = module(input_ids=ids, attention_mask=mask)
                rows = [logits[row, : len(x)].numpy() for row, x in enumerate(chunk)]
                assert len(rows) == batch
                if t0 >= measuring_from:
                    times.append(time.perf_counter() - t0)
                    items += batch
            elapsed = time.perf_counter() - started
    finally:
        torch.set_num_threads(before)
        served.close()
    return {
        "name": f"naive loop, fifo {batch}, {threads} torch thread(s)",
        "threads": threads,
        "items_per_s": items / elapsed,
        "batch_ms_p50": 1000 * statistics.median(times),
    }


async def measure(make_target: Any, variants: list[Variant], concurrency: list[int], args: Any) -> list[PointResult]:
    result = await run_bench(
        make_target,
        variants=variants,
        lengths=LENGTHS,
        concurrency=concurrency,
        duration=args.duration,
        warmup=args.warmup,
        max_id=30000,
        seed=args.seed,
    )
    return result.points


# --------------------------------------------------------------------------- sections
# The budget the bundled tagger shipped until it took "auto" (issue 34), for the
# sections that measure the server as it then shipped.
SHIPPED = {"max_batch_tokens": 1024}


OVERHEAD_CONTENDERS = [
    ("in-process, thread", "in-process", "thread"),
    ("in-process, process", "in-process", "process"),
    ("http, thread", "http", "thread"),
    ("http, process", "http", "process"),  # the tagger as shipped
    ("http, defaults", "http", None),  # nothing tuned: tensorserve's defaults decide
]


async def overhead(repo: Path, args: Any) -> dict[str, Any]:
    """HTTP vs in-process, each with the model in a thread and in a worker
    process, and the server at its defaults; beside them the naive loop. The
    ceiling of a repeat is its best in-process figure, the loop's its best
    thread setting."""
    rows: list[PointResult] = []
    loops: list[dict[str, Any]] = []
    defaults = defaults_repository()
    for repeat in range(args.repeats):
        for threads in dict.fromkeys([TORCH_DEFAULT_THREADS, 1]):
            loops.append({**naive_loop(repo, threads, args), "repeat": repeat + 1})
            print(f"{loops[-1]['name']} #{repeat + 1}: {loops[-1]['items_per_s']:.1f} items/s", flush=True)
        for name, kind, isolation in OVERHEAD_CONTENDERS:
            overrides = {**SHIPPED, "isolation": isolation}
            if kind == "in-process":
                target = lambda v, o=overrides: InProcessTarget(str(repo), "tagger", overrides=o)
            elif isolation is None:
                target = lambda v: ServedHttpTarget(str(defaults), "tagger", [])
            else:
                target = lambda v, o=overrides: ServedHttpTarget(str(repo), "tagger", override_flags(o))
            rows += await measure(target, [Variant(f"{name} #{repeat + 1}")], [32], args)
    per_repeat = [rows[i : i + len(OVERHEAD_CONTENDERS)] for i in range(0, len(rows), len(OVERHEAD_CONTENDERS))]
    ceilings = [max(r[0].items_per_s, r[1].items_per_s) for r in per_repeat]
    best_loops = [
        max(loop["items_per_s"] for loop in loops if loop["repeat"] == repeat + 1)
        for repeat in range(args.repeats)
    ]
    return {
        "points": rows,
        "naive_loop": loops,
        "http_process_over_ceiling": [r[3].items_per_s / c for r, c in zip(per_repeat, ceilings)],
        "http_thread_over_ceiling": [r[2].items_per_s / c for r, c in zip(per_repeat, ceilings)],
        "http_thread_over_inprocess_thread": [r[2].items_per_s / r[0].items_per_s for r in per_repeat],
        "ceiling_over_naive_loop": [c / b for c, b in zip(ceilings, best_loops)],
        "http_defaults_over_naive_loop": [r[4].items_per_s / b for r, b in zip(per_repeat, best_loops)],
        "http_process_over_naive_loop": [r[3].items_per_s / b for r, b in zip(per_repeat, best_loops)],
    }


async def policy(repo: Path, args: Any) -> dict[str, Any]:
    # In-process, the model in a thread: the policies' own effect, no IPC.
    inproc = {"isolation": "thread"}
    variants = [
        Variant("fifo", {**inproc, "policy": "fifo"}),
        Variant("length_aware", {**inproc, "policy": "length_aware"}),
        Variant("length_aware, budget 2048", {**inproc, "policy": "length_aware", "max_batch_tokens": 2048}),
        Variant("length_aware, budget 1024", {**inproc, "policy": "length_aware", "max_batch_tokens": 1024}),
    ]
    rows: list[PointResult] = []
    for model in ("tagger", "gru_tagger", "attention_tagger"):
        for repeat in range(args.repeats):
            named = [Variant(f"{model} {v.name} #{repeat + 1}", v.overrides) for v in variants]
            by_name = {n.name: v for n, v in zip(named, variants)}
            rows += await measure(
                lambda v, m=model, b=by_name: InProcessTarget(str(repo), m, overrides=b[v.name].overrides),
                named,
                [64],
                args,
            )
    return {"points": rows}


async def dispatch(repo: Path, args: Any) -> dict[str, Any]:
    rows: list[PointResult] = []
    for repeat in range(args.repeats):
        for mode in ("eager", "timer"):
            rows += await measure(
                lambda v, m=mode: ServedHttpTarget(str(repo), "tagger", override_flags({"dispatch": m})),
                [Variant(f"{mode} #{repeat + 1}")],
                [1, 8, 32],
                args,
            )
    return {"points": rows}


def batch1_forward_ms(repo: Path, samples: int, seed: int) -> float:
    """Median time of the bare model on one unpadded item, same lengths, with
    the intra-op threads the server gives it (one per core but one)."""
    model = ServedModel.from_repository(repo, "tagger", isolation="thread")
    module = model.fn
    assert module is not None
    rng = np.random.default_rng(seed)
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(default_intra_op_threads())
    with torch.inference_mode():
        for _ in range(samples):
            n = int(rng.integers(8, 129))
            ids = torch.from_numpy(rng.integers(1, 30000, size=(1, n)))
            mask = torch.ones(1, n, dtype=torch.int64)
            start = time.perf_counter()
            module(input_ids=ids, attention_mask=mask)
            times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 1000 * statistics.median(times[samples // 10 :])


async def latency(repo: Path, args: Any) -> dict[str, Any]:
    rows: list[PointResult] = []
    forward: list[float] = []
    for repeat in range(args.repeats):
        for isolation in ("thread", "process"):
            forward.append(batch1_forward_ms(repo, 200, args.seed))
            rows += await measure(
                lambda v, i=isolation: ServedHttpTarget(str(repo), "tagger", override_flags({"isolation": i})),
                [Variant(f"c=1, {isolation} #{repeat + 1}")],
                [1],
                args,
            )
    overheads = [p.latency_ms["p50"] - f for p, f in zip(rows, forward)]
    # The same, against the model's own time per batch as the server measured
    # it during the run (paced one request at a time, the forward runs slower
    # than back to back: colder caches; in a worker it is the worker's clock).
    in_server = [p.latency_ms["p50"] - (p.avg_batch_ms or math.nan) for p in rows]
    return {
        "points": rows,
        "forward_ms": forward,
        "p50_minus_forward_ms": overheads,
        "p50_minus_model_ms": in_server,
    }


# --------------------------------------------------------------------------- output
def plot(results: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", file=sys.stderr)
        return
    IMAGES.mkdir(parents=True, exist_ok=True)
    if "policy" in results:
        points = results["policy"]["points"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        names = [p.variant.rsplit(" #", 1)[0] for p in points]
        labels = list(dict.fromkeys(names))
        for axis, key, title in (
            (left, "items_per_s", "items/s at c=64"),
            (right, "padding_efficiency", "padding efficiency at c=64"),
        ):
            values = [statistics.median(getattr(p, key) for p, n in zip(points, names) if n == label) for label in labels]
            axis.barh(labels, values, color="tab:blue")
            axis.set_title(title)
            axis.invert_yaxis()
        fig.tight_layout()
        fig.savefig(IMAGES / "serving_policy.png", dpi=110)
        plt.close(fig)
    if "dispatch" in results:
        points = results["dispatch"]["points"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for mode, color in (("eager", "tab:green"), ("timer", "tab:orange")):
            mine = [p for p in points if p.variant.startswith(mode)]
            levels = sorted({p.concurrency for p in mine})
            thr = [statistics.median(p.items_per_s for p in mine if p.concurrency == c) for c in levels]
            p50 = [statistics.median(p.latency_ms["p50"] for p in mine if p.concurrency == c) for c in levels]
            left.plot(levels, thr, marker="o", color=color, label=mode)
            right.plot(levels, p50, marker="o", color=color, label=mode)
        left.set(xlabel="concurrency", ylabel="items/s", title="throughput")
        right.set(xlabel="concurrency", ylabel="p50 ms", title="median latency")
        left.legend()
        fig.tight_layout()
        fig.savefig(IMAGES / "serving_dispatch.png", dpi=110)
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="overhead,policy,dispatch,latency")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 2 s points")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup, args.repeats = 2.0, 0.5, 1
    # The in-process ceiling runs with the GIL switch interval the server uses.
    sys.setswitchinterval(Settings().switch_interval_ms / 1000)
    repo = benchmark_repository()
    sections = {"overhead": overhead, "policy": policy, "dispatch": dispatch, "latency": latency}
    results: dict[str, Any] = {}
    for name in args.sections.split(","):
        started = time.monotonic()
        results[name] = asyncio.run(sections[name](repo, args))
        print(f"\n== {name} ({time.monotonic() - started:.0f} s)")
        print(format_table(results[name]["points"]))
        for key, value in results[name].items():
            if key == "naive_loop":
                for loop in value:
                    print(f"{loop['name']} #{loop['repeat']}: {loop['items_per_s']:.1f} items/s, "
                          f"p50 batch {loop['batch_ms_p50']:.1f} ms")
            elif key != "points":
                print(f"{key}: {[round(v, 3) for v in value]}")
    plot(results)
    serializable = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "settings": {"duration": args.duration, "warmup": args.warmup, "repeats": args.repeats, "lengths": "uniform 8..128"},
        **{
            name: {k: ([p.to_dict() for p in v] if k == "points" else v) for k, v in section.items()}
            for name, section in results.items()
        },
    }
    save(args.output, serializable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
