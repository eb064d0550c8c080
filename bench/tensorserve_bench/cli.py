"""``tensorserve bench``: measure a model under load and write the result.

    tensorserve bench tagger --url http://127.0.0.1:8000 --concurrency 1,8,32,64
    tensorserve bench tagger --serve --protocol binary --concurrency 32
    tensorserve bench tagger --in-process --variant fifo:policy=fifo \\
        --variant length_aware:policy=length_aware --output results/policies.json

Only argparse is imported at module level: ``tensorserve --help`` must not
pay for the load generator, matplotlib or tqdm.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def parse_value(text: str) -> Any:
    """``32`` -> 32, ``2.5`` -> 2.5, ``true`` -> True, ``none`` -> None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_assignments(text: str) -> dict[str, Any]:
    """``key=value[,key=value]`` -> a dict with typed values."""
    result = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value, got {part!r}")
        result[key.strip().replace("-", "_")] = parse_value(value)
    return result


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:key=value[,key=value], got {text!r}")
    return name.strip(), parse_assignments(rest)


# What `tensorserve bench --help` says first (the module docstring is for maintainers).
DESCRIPTION = """Measure a model under load and write the result.

    tensorserve bench tagger --url http://127.0.0.1:8000 --concurrency 1,8,32,64
    tensorserve bench tagger --serve --protocol binary --concurrency 32
    tensorserve bench tagger --in-process --variant fifo:policy=fifo \\
        --variant length_aware:policy=length_aware --output results/policies.json
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="measure throughput, latency and batching under load",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model name")
    where = p.add_argument_group("target (default: --url http://127.0.0.1:8000)")
    choice = where.add_mutually_exclusive_group()
    choice.add_argument("--url", help="a running tensorserve")
    choice.add_argument(
        "--in-process",
        action="store_true",
        help="load the model in this process and call it with no HTTP (the ceiling)",
    )
    choice.add_argument(
        "--serve",
        action="store_true",
        help="start `tensorserve serve` on a free loopback port for the run (one per variant)",
    )
    where.add_argument(
        "--model-repository",
        default="model_repository",
        help="repository for --in-process and --serve (default %(default)s)",
    )
    where.add_argument(
        "--server-args", default="", help="extra `tensorserve serve` flags for --serve"
    )
    where.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        type=parse_assignments,
        metavar="KEY=VALUE",
        help="config override for every variant, e.g. max_batch_size=32 (repeatable)",
    )
    where.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        type=_variant,
        metavar="NAME:KEY=VALUE[,...]",
        help="a named config to sweep, e.g. fifo:policy=fifo (repeatable; --in-process or --serve)",
    )
    where.add_argument(
        "--timeout", type=float, default=60.0, help="per-request timeout in s (HTTP)"
    )
    where.add_argument(
        "--protocol",
        choices=["msgpack", "json", "binary"],  # protocols.PROTOCOLS, not imported here
        default="msgpack",
        help="HTTP: the native msgpack protocol (default), KServe v2 JSON, or KServe v2 "
        "with binary tensors (Triton's extension)",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--mode",
        choices=["closed", "open"],
        default="closed",
        help="closed: N workers each with one request in flight; open: Poisson arrivals",
    )
    load.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 8, 32, 64],
        help="closed-loop sweep, e.g. 1,8,32,64 (default)",
    )
    load.add_argument(
        "--rate",
        type=_float_list,
        default=[],
        help="open-loop sweep in requests/s, e.g. 50,100,200",
    )
    load.add_argument(
        "--max-outstanding",
        type=int,
        default=1024,
        help="open loop: arrivals beyond this many in flight are dropped and counted",
    )
    load.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    load.add_argument(
        "--warmup", type=float, default=2.0, help="unmeasured seconds before each point"
    )
    load.add_argument("--items-per-request", type=int, default=1)
    load.add_argument(
        "--lengths",
        default="8:128",
        help="variable-axis lengths: LOW:HIGH (uniform), N, or a file of one length per line",
    )
    load.add_argument(
        "--pool", type=int, default=1024, help="distinct pre-encoded items to cycle through"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--max-id",
        type=int,
        default=1000,
        help="integer inputs get ids in [1, max-id) (and below the model's vocab_size)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--output",
        "-o",
        type=Path,
        help="JSON result; PNG plots are written beside it (<stem>_throughput.png ...)",
    )
    out.add_argument("--no-plots", action="store_true")
    out.add_argument(
        "--no-progress", action="store_true", help="no progress bar (also off when not a TTY)"
    )
    out.add_argument("--title", default="", help="title for the plots")
    p.set_defaults(run=run)
    return p


def _merged(overrides: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for one in overrides:
        merged.update(one)
    return merged


def _make_target_factory(args: argparse.Namespace) -> Callable[[Any], Any]:
    from tensorserve_bench.server import ServedHttpTarget, override_flags
    from tensorserve_bench.targets import HttpTarget, InProcessTarget

    common = _merged(args.overrides)
    if args.in_process:
        return lambda v: InProcessTarget(
            args.model_repository, args.model, overrides={**common, **v.overrides}
        )
    if args.serve:
        extra = shlex.split(args.server_args)
        return lambda v: ServedHttpTarget(
            args.model_repository,
            args.model,
            [*extra, *override_flags({**common, **v.overrides})],
            timeout=args.timeout,
            protocol=args.protocol,
        )
    url = args.url or "http://127.0.0.1:8000"
    return lambda v: HttpTarget(url, args.model, timeout=args.timeout, protocol=args.protocol)


def _check(args: argparse.Namespace) -> str | None:
    remote = not (args.in_process or args.serve)
    if remote and (args.overrides or args.variants):
        return (
            "--set and --variant change the model's config: use them with --in-process or --serve"
        )
    if args.in_process and args.protocol != "msgpack":
        return "--protocol is how requests travel over HTTP: not with --in-process"
    if args.mode == "open" and not args.rate:
        return "--mode open needs --rate (requests/s, e.g. --rate 50,100,200)"
    if args.duration <= 0 or args.warmup < 0:
        return "--duration must be > 0 and --warmup >= 0"
    if args.items_per_request < 1 or args.pool < 1:
        return "--items-per-request and --pool must be >= 1"
    names = [name for name, _ in args.variants]
    if len(set(names)) != len(names):
        return "--variant names must be distinct"
    return None


class _Bar:
    """tqdm over the planned seconds of the whole sweep; lines go through it."""

    def __init__(self, total: float) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=round(total, 1),
            desc="starting",
            unit="s",
            dynamic_ncols=True,
            leave=False,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]",
        )

    def advance(self, seconds: float, status: str) -> None:
        self.bar.set_description_str(status, refresh=False)
        self.bar.update(seconds)

    def write(self, line: str) -> None:
        self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(args: argparse.Namespace, total: float) -> _Bar | None:
    if args.no_progress or not sys.stderr.isatty():
        return None
    try:
        return _Bar(total)
    except ImportError:  # a dependency of tensorserve-bench, but it may have been removed
        return None


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tensorserve_bench.lengths import parse_lengths
    from tensorserve_bench.report import format_point, format_table
    from tensorserve_bench.sweep import Variant, run_bench

    problem = _check(args)
    if problem is None:
        try:
            lengths = parse_lengths(args.lengths)
        except (OSError, ValueError) as exc:
            problem = str(exc)
    if problem is not None:
        print(f"tensorserve bench: error: {problem}", file=sys.stderr)
        return 2
    variants = [Variant(name, overrides) for name, overrides in args.variants] or [
        Variant("default", {})
    ]
    levels = len(args.concurrency) if args.mode == "closed" else len(args.rate)
    bar = _progress_bar(args, len(variants) * levels * (args.warmup + args.duration))

    def on_point(point: Any) -> None:
        line = format_point(point)
        bar.write(line) if bar is not None else print(line, file=sys.stderr, flush=True)

    try:
        result = asyncio.run(
            run_bench(
                _make_target_factory(args),
                lengths=lengths,
                variants=variants,
                mode=args.mode,
                concurrency=args.concurrency,
                rates=args.rate,
                duration=args.duration,
                warmup=args.warmup,
                items_per_request=args.items_per_request,
                pool_items=args.pool,
                seed=args.seed,
                max_id=args.max_id,
                max_outstanding=args.max_outstanding,
                progress=bar.advance if bar is not None else None,
                on_point=on_point,
            )
        )
    except Exception as exc:  # noqa: BLE001 - a target that cannot be reached or loaded
        print(f"tensorserve bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(format_table(result.points))
    if args.output is not None:
        _write_outputs(result, args)
    return 1 if any(p.items == 0 for p in result.points) else 0


def _write_outputs(result: Any, args: argparse.Namespace) -> None:
    from tensorserve_bench.plots import matplotlib_available, run_context, write_plots

    result.settings["cli"] = {
        key: str(value) if isinstance(value, Path) else value
        for key, value in vars(args).items()
        if key not in ("run", "command")
    }
    path = result.save(args.output)
    print(f"wrote {path}")
    if args.no_plots:
        return
    if not matplotlib_available():
        print(
            "no plots: matplotlib is not installed (pip install matplotlib)",
            file=sys.stderr,
        )
        return
    for png in write_plots(result.points, path, args.title, run_context(result)):
        print(f"wrote {png}")
