"""tensorserve-bench: ``tensorserve bench`` (load generation and
measurement) and the library behind ``benchmarks/``. A distribution of its
own (``bench/`` in the repository), so the server's wheel is the server; the
server's CLI finds ``cli.add_parser`` through the ``tensorserve.commands``
entry point (bench/pyproject.toml).

For scripts (everything here is importable without matplotlib or tqdm):

    from tensorserve_bench import InProcessTarget, HttpTarget, Variant, run_bench, uniform

    result = asyncio.run(run_bench(
        lambda v: InProcessTarget("model_repository", "tagger", overrides=v.overrides),
        variants=[Variant("fifo", {"policy": "fifo"})],
        lengths=uniform(8, 128), concurrency=[32], duration=5,
    ))

Modules: ``lengths`` (length distributions) · ``items`` (synthetic items from
a model's inputs) · ``protocols`` (one request encoder per protocol) ·
``targets`` (HTTP and in-process targets, batching counters) · ``grpc_target``
(KServe v2 gRPC, and its raw ``ModelInfer`` caller) · ``loadgen``
(closed and open loop, ``run_point``) · ``summaries`` (latency summaries with
the server's percentile, medians of repeats) · ``sweep`` (variants
x load levels, ``BenchResult``) · ``report`` (table) · ``plots`` (PNGs) ·
``server`` (the one way to start a server: ``--serve`` and every script of
``benchmarks/``) · ``results`` (result files) · ``repositories`` (toy models,
cached copies of bundled ones) · ``encoder`` (a BERT-base-size encoder
with seeded weights) · ``tolerance`` (per-dtype error bounds) · ``soak`` (one toy model, its good and bad
requests, the fault and the overload scenarios) · ``wrk`` · ``cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorserve_bench.items import FeatureSpec, ItemFactory
    from tensorserve_bench.lengths import (
        LengthDistribution,
        parse_lengths,
        read_lengths_file,
        uniform,
    )
    from tensorserve_bench.loadgen import PointResult, PreparedRequest, run_point
    from tensorserve_bench.plots import write_plots
    from tensorserve_bench.report import format_table
    from tensorserve_bench.server import ServedHttpTarget, ServerProcess
    from tensorserve_bench.sweep import BenchResult, Variant, build_pool, run_bench
    from tensorserve_bench.targets import BatchingDelta, Counters, HttpTarget, InProcessTarget

# Resolved on first use, so `tensorserve --help` imports none of it.
_EXPORTS = {
    "FeatureSpec": "items",
    "ItemFactory": "items",
    "LengthDistribution": "lengths",
    "parse_lengths": "lengths",
    "read_lengths_file": "lengths",
    "uniform": "lengths",
    "PointResult": "loadgen",
    "PreparedRequest": "loadgen",
    "run_point": "loadgen",
    "write_plots": "plots",
    "format_table": "report",
    "ServedHttpTarget": "server",
    "ServerProcess": "server",
    "BenchResult": "sweep",
    "Variant": "sweep",
    "build_pool": "sweep",
    "run_bench": "sweep",
    "BatchingDelta": "targets",
    "Counters": "targets",
    "HttpTarget": "targets",
    "InProcessTarget": "targets",
}
__all__ = [
    "BatchingDelta",
    "BenchResult",
    "Counters",
    "FeatureSpec",
    "HttpTarget",
    "InProcessTarget",
    "ItemFactory",
    "LengthDistribution",
    "PointResult",
    "PreparedRequest",
    "ServedHttpTarget",
    "ServerProcess",
    "Variant",
    "build_pool",
    "format_table",
    "parse_lengths",
    "read_lengths_file",
    "run_bench",
    "run_point",
    "uniform",
    "write_plots",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorserve_bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tensorserve_bench.{module}"), name)
