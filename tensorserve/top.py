"""``tensorserve top``: a live view of every model of a running server.

    tensorserve top --url http://127.0.0.1:8000            # refreshes in place
    tensorserve top --url http://127.0.0.1:8000 --once     # one frame, then exit

Each frame reads the server over plain HTTP: ``GET /metrics`` (twice, an
interval apart, for the rates), ``GET /v2/models`` (every model's state) and
``GET /v2/models/stats`` (the last minute's p50/p99 and padding efficiency,
and the queue depth). One row per model: state, requests/s, items/s, p50 and
p99, mean batch size, padding efficiency, queue depth, the latency target (p99
achieved / target, batch cap) if the model has one, and errors and
rejections by reason since the server started.

Reading and arithmetic are plain functions (``read``, ``rows``); only
``render`` and ``run`` touch ``rich``, which is imported when they run (so
``tensorserve --help`` stays light).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

UNKNOWN_MODEL = "_unknown"  # tensorserve.metrics.requests.UNKNOWN_MODEL


@dataclass
class Reading:
    """One read of a server: metric samples, model states and stats."""

    at: float  # time.monotonic()
    samples: dict[str, list[tuple[dict[str, str], float]]]  # metric name -> (labels, value)
    states: dict[str, str]  # model -> state
    stats: dict[str, dict[str, Any]]  # model -> the stats endpoint's batching object

    def total(self, name: str, model: str, **match: str) -> float:
        """The sum of ``name`` over the samples of ``model`` whose labels match."""
        return sum(
            value
            for labels, value in self.samples.get(name, [])
            if labels.get("model") == model and all(labels.get(k) == v for k, v in match.items())
        )

    def by(self, name: str, model: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self.samples.get(name, []):
            if labels.get("model") == model and value:
                out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
        return out


@dataclass
class Row:
    model: str
    state: str
    requests_per_s: float | None = None
    items_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    batch_size: float | None = None
    padding_efficiency: float | None = None
    queue_depth: int | None = None
    # The latency target's controller (batching/target.py), if the model has one.
    target: dict[str, Any] | None = None
    errors: dict[str, int] = field(default_factory=dict)  # reason or code -> count


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def read(url: str, timeout: float = 5.0) -> Reading:
    url = url.rstrip("/")
    samples = parse_metrics(_get(f"{url}/metrics", timeout).decode())
    models = json.loads(_get(f"{url}/v2/models", timeout))["models"]
    stats = json.loads(_get(f"{url}/v2/models/stats", timeout))["model_stats"]
    return Reading(
        at=time.monotonic(),
        samples=samples,
        states={m["name"]: m["state"] for m in models},
        stats={s["name"]: s["batching"] for s in stats if "batching" in s},  # not ensembles
    )


def rows(before: Reading | None, now: Reading) -> list[Row]:
    """One row per model of ``now`` (rates need ``before``), then one for
    requests to unknown models if there were any."""
    out = []
    elapsed = now.at - before.at if before is not None else 0.0
    for model in sorted(now.states):
        row = Row(model, now.states[model])
        if before is not None and elapsed > 0:
            row.requests_per_s = (
                now.total("tensorserve_requests_total", model)
                - before.total("tensorserve_requests_total", model)
            ) / elapsed
            row.items_per_s = (
                now.total("tensorserve_batch_items_total", model)
                - before.total("tensorserve_batch_items_total", model)
            ) / elapsed
        stats = now.stats.get(model)
        if stats is not None:
            recent = stats.get("recent", {})
            if recent.get("items"):
                row.p50_ms, row.p99_ms = recent["p50_ms"], recent["p99_ms"]
                row.padding_efficiency = recent["padding_efficiency"]
            row.batch_size = stats["avg_batch_size"] if stats["total_batches"] else None
            row.queue_depth = int(stats["queue_depth"])
            row.target = stats.get("latency_target")
        row.errors = _errors(now, model)
        out.append(row)
    unknown = _errors(now, UNKNOWN_MODEL)
    if unknown:
        out.append(Row(UNKNOWN_MODEL, "-", errors=unknown))
    return out


def _errors(reading: Reading, model: str) -> dict[str, int]:
    """Rejections by reason, and model failures, since the server started."""
    errors = {
        k: int(v) for k, v in reading.by("tensorserve_rejections_total", model, "reason").items()
    }
    codes = reading.by("tensorserve_requests_total", model, "code")
    for code in ("model_failure", "internal"):
        if codes.get(code):
            errors[code] = int(codes[code])
    return dict(sorted(errors.items()))


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


COLUMNS = (
    "model",
    "state",
    "req/s",
    "items/s",
    "p50 ms",
    "p99 ms",
    "batch",
    "pad eff",
    "queue",
    "target",
    "errors (since start)",
)


def _target(target: dict[str, Any] | None) -> str:
    """``p99 achieved / target ms, batch cap``: what the controller keeps to."""
    if target is None:
        return "-"
    achieved = target["achieved_p99_ms"]
    return f"{_number(achieved, 0)}/{target['target_p99_ms']:g} ms, cap {target['batch_cap']}"


def cells(row: Row) -> list[str]:
    return [
        row.model,
        row.state,
        _number(row.requests_per_s, 1),
        _number(row.items_per_s, 1),
        _number(row.p50_ms, 2),
        _number(row.p99_ms, 2),
        _number(row.batch_size, 2),
        _number(row.padding_efficiency, 3),
        "-" if row.queue_depth is None else str(row.queue_depth),
        _target(row.target),
        ", ".join(f"{k} {v}" for k, v in row.errors.items()) or "-",
    ]


def render(table_rows: list[Row], url: str, interval: float) -> Table:
    from rich.table import Table

    table = Table(
        title=f"tensorserve {url}  (rates over {interval:g} s; p50/p99, pad eff: last minute)",
        title_justify="left",
    )
    for index, name in enumerate(COLUMNS):
        table.add_column(
            name, justify="left" if index in (0, 1, 10) else "right", no_wrap=index != 10
        )
    for row in table_rows:
        style = None if row.state in ("READY", "-") else "yellow"
        table.add_row(*cells(row), style=style)
    return table


def run(url: str, *, interval: float = 1.0, once: bool = False) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console(width=None if Console().is_terminal else 160)
    before = read(url)
    if once:
        time.sleep(interval)  # two reads an interval apart give the rates
        console.print(render(rows(before, read(url)), url, interval))
        return 0
    with Live(
        render(rows(None, before), url, interval),
        console=console,
        refresh_per_second=4,
        screen=False,
    ) as live:
        try:
            while True:
                time.sleep(interval)
                now = read(url)
                live.update(render(rows(before, now), url, interval))
                before = now
        except KeyboardInterrupt:
            return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "top",
        help="a live view of a running server's models",
        description="A live view of every model of a running tensorserve: rates, p50/p99, "
        "batch size, padding efficiency, queue depth, errors by reason.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")

    def start(args: argparse.Namespace) -> int:
        if args.interval <= 0:
            parser.error("--interval must be > 0")
        try:
            return run(args.url, interval=args.interval, once=args.once)
        except OSError as exc:
            print(f"tensorserve top: cannot read {args.url}: {exc}", file=sys.stderr)
            return 1

    parser.set_defaults(run=start)
    return parser
