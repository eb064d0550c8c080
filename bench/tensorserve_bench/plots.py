"""PNG plots of a benchmark result, next to its JSON:

    <stem>_throughput.png   items/s against concurrency (or offered rate), a line per variant
    <stem>_latency.png      p50, p90 and p99 latency against the same axis
    <stem>_padding.png      padding efficiency (real / padded elements) against the same axis
    <stem>_batch_sizes.png  share of executed batches per batch-size bucket, for each point

The load axis is logarithmic (base 2), ticked at the measured levels, so 1,
8, 32 and 64 are evenly readable. Every title says the model, the date and
the machine (``run_context``).

matplotlib is imported here only (a dependency of tensorserve-bench), with the Agg backend
through the object API, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorserve_bench.loadgen import PointResult

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


def run_context(result: Any) -> str:
    """``tagger · 2026-11-23 16:30 UTC · Linux x86_64, 2 CPUs, torch 2.13.0``
    from a ``BenchResult``: what a plot's title says below its own name."""
    models = sorted({str(t.get("model")) for t in result.targets if t.get("model")})
    created = str(result.created).replace("T", " ").removesuffix("+00:00")
    machine = result.machine
    system = str(machine.get("platform") or "?").split("-")[0]  # "Linux", not the kernel build
    parts = [
        f"{system} {machine.get('processor') or ''}".strip(),
        f"{machine.get('cpu_count')} CPUs",
    ]
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return " · ".join([", ".join(models) or "?", f"{created[:16]} UTC", ", ".join(parts)])


def _title(ax: Any, what: str, title: str, context: str) -> None:
    head = f"{what}: {title}" if title else what
    ax.set_title(f"{head}\n{context}" if context else head, fontsize="medium")


def _load_axis(ax: Any, points: Sequence[PointResult]) -> None:
    """A log (base 2) axis ticked at the measured levels, labelled plainly."""
    from matplotlib.ticker import NullFormatter

    xs = sorted({p.x for p in points if p.x and p.x > 0})
    ax.set_xlabel(_axis_label(points))
    if not xs:
        return
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _figure(width: float = 7.0, height: float = 4.5) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def throughput_figure(points: Sequence[PointResult], title: str = "", context: str = "") -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _by_variant(points).items():
        ax.plot([p.x for p in group], [p.items_per_s for p in group], marker="o", label=name)
    _load_axis(ax, points)
    ax.set_ylabel("items/s")
    ax.set_ylim(bottom=0)
    _title(ax, "Throughput", title, context)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


LATENCY_LINES = (("p50", "o", "-"), ("p90", "s", "-."), ("p99", "^", "--"))


def latency_figure(points: Sequence[PointResult], title: str = "", context: str = "") -> Figure:
    fig = _figure()
    ax = fig.add_subplot()
    for index, (name, group) in enumerate(_by_variant(points).items()):
        xs = [p.x for p in group]
        for quantile, marker, style in LATENCY_LINES:
            ax.plot(
                xs,
                [p.latency_ms[quantile] for p in group],
                marker=marker,
                linestyle=style,
                color=f"C{index}",
                label=f"{name} {quantile}",
            )
    _load_axis(ax, points)
    ax.set_ylabel("latency (ms)")
    ax.set_ylim(bottom=0)
    _title(ax, "Latency", title, context)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def padding_figure(points: Sequence[PointResult], title: str = "", context: str = "") -> Figure:
    """Padding efficiency (real / padded elements over each point's window)."""
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _by_variant(points).items():
        shown = [(p.x, p.padding_efficiency) for p in group if p.padding_efficiency is not None]
        ax.plot([x for x, _ in shown], [e for _, e in shown], marker="o", label=name)
    _load_axis(ax, points)
    ax.set_ylabel("padding efficiency (real / padded elements)")
    ax.set_ylim(0, 1.05)
    _title(ax, "Padding efficiency", title, context)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def batch_size_figure(points: Sequence[PointResult], title: str = "", context: str = "") -> Figure:
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
    _title(ax, "Executed batch sizes", title, context)
    ax.legend(fontsize="small")
    return fig


def write_plots(
    points: Sequence[PointResult], json_path: str | Path, title: str = "", context: str = ""
) -> list[Path]:
    """Write the four PNGs beside ``json_path``; returns their paths.
    ``context`` (``run_context(result)``) goes under every title."""
    if not points:
        return []
    path = Path(json_path)
    stem = path.with_suffix("")
    written = []
    for suffix, make in (
        ("throughput", throughput_figure),
        ("latency", latency_figure),
        ("padding", padding_figure),
        ("batch_sizes", batch_size_figure),
    ):
        target = stem.parent / f"{stem.name}_{suffix}.png"
        make(points, title, context).savefig(target, dpi=110)
        written.append(target)
    return written
