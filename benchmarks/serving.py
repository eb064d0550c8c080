#!/usr/bin/env python3
"""tensorserve's own serving benchmarks (issue 5), all measured in one run.

    python benchmarks/serving.py                 # about 6 minutes on 2 cores
    python benchmarks/serving.py --quick         # a smoke run (~1 minute)

Sections (each alternates its contenders, repeated ``--repeats`` times, so
that ratios come from the same minutes of the same machine):

  overhead   HTTP server vs the in-process ceiling (no HTTP), tagger with its
             shipped 1024-token budget, c=32
  policy     fifo vs length_aware (+ padded-volume budgets), c=64, for the
             tagger, gru_tagger (a GRU: pays per sequential step) and
             attention_tagger (hand-written attention: pays for every padded
             element)
  dispatch   eager vs timer dispatch over HTTP at c=1, 8, 32
  latency    c=1 HTTP p50 minus the model's own batch-1 forward time

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
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from generate_example_weights import make_variant  # noqa: E402

from tensorserve import ServedModel  # noqa: E402
from tensorserve.bench import (  # noqa: E402
    InProcessTarget,
    ServedHttpTarget,
    Variant,
    format_table,
    run_bench,
    uniform,
)
from tensorserve.bench.loadgen import PointResult  # noqa: E402
from tensorserve.bench.sweep import machine_info  # noqa: E402
from tensorserve.settings import Settings  # noqa: E402

CACHE = ROOT / "benchmarks" / ".cache" / "repository"
RESULTS = ROOT / "benchmarks" / "results" / "serving.json"
IMAGES = ROOT / "docs" / "img"
LENGTHS = uniform(8, 128)


def benchmark_repository() -> Path:
    """The bundled tagger and gru_tagger at the issue's size (vocab 30000)."""
    for model in ("tagger", "gru_tagger", "attention_tagger"):
        if not (CACHE / model / "1" / "model.safetensors").exists():
            make_variant(ROOT / "model_repository" / model, CACHE / model, {"vocab_size": 30000})
            # The policy section sets budgets explicitly: the copies start without one.
            config = CACHE / model / "config.toml"
            lines = config.read_text().splitlines(keepends=True)
            config.write_text("".join(l for l in lines if not l.startswith("max_batch_tokens")))
    return CACHE


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


def flags(overrides: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]


# --------------------------------------------------------------------------- sections
# The bundled tagger's own budget (its config.toml), for the sections that
# measure the server as shipped.
SHIPPED = {"max_batch_tokens": 1024}


async def overhead(repo: Path, args: Any) -> dict[str, Any]:
    rows: list[PointResult] = []
    for repeat in range(args.repeats):
        for kind in ("in-process", "http"):
            variant = Variant(f"{kind} #{repeat + 1}")
            if kind == "in-process":
                target = lambda v: InProcessTarget(str(repo), "tagger", overrides=SHIPPED)  # noqa: E731
            else:
                target = lambda v: ServedHttpTarget(str(repo), "tagger", flags(SHIPPED))  # noqa: E731
            rows += await measure(target, [variant], [32], args)
    ratios = [
        http.items_per_s / inproc.items_per_s
        for inproc, http in zip(rows[0::2], rows[1::2])
    ]
    return {"points": rows, "http_over_inprocess": ratios}


async def policy(repo: Path, args: Any) -> dict[str, Any]:
    variants = [
        Variant("fifo", {"policy": "fifo"}),
        Variant("length_aware", {"policy": "length_aware"}),
        Variant("length_aware, budget 2048", {"policy": "length_aware", "max_batch_tokens": 2048}),
        Variant("length_aware, budget 1024", {"policy": "length_aware", "max_batch_tokens": 1024}),
    ]
    rows: list[PointResult] = []
    for model in ("tagger", "gru_tagger", "attention_tagger"):
        for repeat in range(args.repeats):
            named = [Variant(f"{model} {v.name} #{repeat + 1}", v.overrides) for v in variants]
            by_name = {n.name: v for n, v in zip(named, variants)}
            rows += await measure(
                lambda v, m=model: InProcessTarget(str(repo), m, overrides=by_name[v.name].overrides),
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
                lambda v, m=mode: ServedHttpTarget(str(repo), "tagger", flags({"dispatch": m})),
                [Variant(f"{mode} #{repeat + 1}")],
                [1, 8, 32],
                args,
            )
    return {"points": rows}


def batch1_forward_ms(repo: Path, samples: int, seed: int) -> float:
    """Median time of the bare model on one unpadded item, same lengths."""
    model = ServedModel.from_repository(repo, "tagger")
    module = model.fn
    rng = np.random.default_rng(seed)
    times = []
    with torch.inference_mode():
        for _ in range(samples):
            n = int(rng.integers(8, 129))
            ids = torch.from_numpy(rng.integers(1, 30000, size=(1, n)))
            mask = torch.ones(1, n, dtype=torch.int64)
            start = time.perf_counter()
            module(input_ids=ids, attention_mask=mask)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[samples // 10 :])


async def latency(repo: Path, args: Any) -> dict[str, Any]:
    rows: list[PointResult] = []
    forward: list[float] = []
    for repeat in range(args.repeats):
        forward.append(batch1_forward_ms(repo, 200, args.seed))
        rows += await measure(
            lambda v: ServedHttpTarget(str(repo), "tagger"), [Variant(f"c=1 #{repeat + 1}")], [1], args
        )
    overheads = [p.latency_ms["p50"] - f for p, f in zip(rows, forward)]
    return {"points": rows, "forward_ms": forward, "p50_minus_forward_ms": overheads}


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
            if key != "points":
                print(f"{key}: {[round(v, 3) for v in value]}")
    plot(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    serializable = {
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "settings": {"duration": args.duration, "warmup": args.warmup, "repeats": args.repeats, "lengths": "uniform 8..128"},
        **{
            name: {k: ([p.to_dict() for p in v] if k == "points" else v) for k, v in section.items()}
            for name, section in results.items()
        },
    }
    args.output.write_text(json.dumps(serializable, indent=1))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
