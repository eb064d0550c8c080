"""PNG plots of a benchmark result, next to its JSON:

    <stem>_throughput.png   items/s against concurrency (or offered rate), a line per variant
    <stem>_latency.png      p50 and p99 latency against the same axis
    <stem>_batch_sizes.png  share of executed batches per batch-size bucket, for each point

matplotlib is imported here only (the ``bench`` extra), with the Agg backend
through the object API, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tensorserve.bench.loadgen import PointResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _by_variant(points: Sequence[PointResult]) -> dict[str, list[PointResult]]:
    groups: dict[str, list[PointResult]] = {}
    for point in points:
        groups.setdefault(point.variant, []).append(point)
    return {name: sorted(group, key=lambda p: p.x) for name, group in groups.items()}


def _axis_label(points: Sequence[PointResult]) -> str:
    return (
        "concurrency (requests in flight)"
        if points[0].mode == "closed"
        else "offered rate (requests/s)"
    )


def _figure(width: float = 7.0, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def throughput_figure(points: Sequence[PointResult], title: str = "") -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _by_variant(points).items():
        ax.plot([p.x for p in group], [p.items_per_s for p in group], marker="o", label=name)
    ax.set_xlabel(_axis_label(points))
    ax.set_ylabel("items/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def latency_figure(points: Sequence[PointResult], title: str = "") -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    for index, (name, group) in enumerate(_by_variant(points).items()):
        color = f"C{index}"
        xs = [p.x for p in group]
        ax.plot(
            xs, [p.latency_ms["p50"] for p in group], marker="o", color=color, label=f"{name} p50"
        )
        ax.plot(
            xs,
            [p.latency_ms["p99"] for p in group],
            marker="^",
            linestyle="--",
            color=color,
            label=f"{name} p99",
        )
    ax.set_xlabel(_axis_label(points))
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "Latency")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def batch_size_figure(points: Sequence[PointResult], title: str = "") -> Figure:
    """Grouped bars: for each point, the share of its batches in each bucket."""
    from tensorserve.batching.stats import BATCH_SIZE_BUCKETS

    present = {int(b) for p in points for b in p.batch_size_histogram} or {1}
    # every bucket up to the largest used, so empty buckets show as gaps
    bounds = sorted(present | {b for b in BATCH_SIZE_BUCKETS if b <= max(present)})
    labels = []
    previous = 0
    for bound in bounds:
        labels.append(str(bound) if bound == previous + 1 else f"{previous + 1}-{bound}")
        previous = bound
    fig = _figure(max(7.0, 1.0 + 0.9 * len(bounds)), 4.5)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(points))
    for index, point in enumerate(points):
        total = sum(point.batch_size_histogram.values()) or 1
        shares = [point.batch_size_histogram.get(str(b), 0) / total for b in bounds]
        load = f"c={point.concurrency}" if point.mode == "closed" else f"{point.rate:g}/s"
        ax.bar(
            [i + (index - (len(points) - 1) / 2) * width for i in range(len(bounds))],
            shares,
            width=width,
            label=f"{point.variant} {load} (mean {point.avg_batch_size:.1f})",
        )
    ax.set_xticks(range(len(bounds)), labels)
    ax.set_xlabel("executed batch size")
    ax.set_ylabel("share of batches")
    ax.set_title(title or "Executed batch sizes")
    ax.legend(fontsize="small")
    return fig


def write_plots(
    points: Sequence[PointResult], json_path: str | Path, title: str = ""
) -> list[Path]:
    """Write the three PNGs beside ``json_path``; returns their paths."""
    if not points:
        return []
    path = Path(json_path)
    stem = path.with_suffix("")
    written = []
    for suffix, make in (
        ("throughput", throughput_figure),
        ("latency", latency_figure),
        ("batch_sizes", batch_size_figure),
    ):
        target = stem.parent / f"{stem.name}_{suffix}.png"
        make(points, title).savefig(target, dpi=110)
        written.append(target)
    return written
