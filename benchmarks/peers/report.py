"""The peer comparison's summary table and plot, from the runs' rows.

A row is one (peer, variant, concurrency, repeat): its correctness ``check``,
its ``load`` (a ``tensorserve.bench.loadgen.PointResult`` as a dict), the
server tree's peak memory and how the server stopped.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORDER = ["tensorserve", "ts-thread", "pytriton", "mlserver", "litserve", "batched"]


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def per_item_ms(seconds: float | None, items: int) -> float | None:
    return 1000 * seconds / items if seconds is not None and items else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (peer, variant, concurrency): medians over the repeats."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["peer"], r["variant"], r["concurrency"]), []).append(r)
    out = []
    for (peer, variant, conc), rs in groups.items():
        loads = [r["load"] for r in rs if "load" in r]
        s: dict[str, Any] = {"peer": peer, "variant": variant, "concurrency": conc,
                             "runs": len(rs), "measured": len(loads)}
        if not loads:
            note = next((r.get("skipped") or r.get("failed") for r in rs), "no data")
            s["note"] = (note or "").splitlines()[0][:120]
            out.append(s)
            continue

        def med(get: Callable[[dict[str, Any]], float | None]) -> float | None:
            return _median([get(lo) for lo in loads])

        s.update(
            items_per_s=med(lambda lo: lo["items_per_s"]),
            p50_ms=med(lambda lo: lo["latency_ms"]["p50"]),
            p99_ms=med(lambda lo: lo["latency_ms"]["p99"]),
            errors=sum(lo["errors"] for lo in loads),
            ok=sum(lo["requests"] for lo in loads),
            mean_batch=med(lambda lo: lo["avg_batch_size"] if lo["batches"] else None),
            server_cpu_ms_per_item=med(lambda lo: per_item_ms(lo.get("server_cpu_s"), lo["items"])),
            client_cpu_ms_per_item=med(lambda lo: per_item_ms(lo["client_cpu_s"], lo["items"])),
            peak_rss_mb=_median([r.get("server", {}).get("peak_rss_mb") for r in rs]),
        )
        checks = [r["check"] for r in rs if "check" in r]
        diffs = [c["max_abs_diff"] for c in checks if c.get("max_abs_diff") is not None]
        s["max_abs_diff"] = max(diffs) if diffs else None
        s["check_failed"] = sum(c["failed"] for c in checks)
        s["check_requests"] = sum(c["n"] for c in checks)
        s["check_ok"] = all(c["ok"] for c in checks) if checks else False
        samples: dict[str, int] = {}
        for lo in loads:
            for sample in lo.get("error_samples", []):
                samples[sample] = samples.get(sample, 0) + 1
        if samples:
            s["error_sample"] = max(samples, key=lambda k: samples[k])[:200]
        out.append(s)
    ts = {s["concurrency"]: s.get("items_per_s") for s in out if s["peer"] == "tensorserve"}
    for s in out:
        t, p = ts.get(s["concurrency"]), s.get("items_per_s")
        # no ratio against a configuration that mostly fails
        ok_run = p and s.get("errors", 0) <= s.get("ok", 0)
        s["tensorserve_ratio"] = (t / p) if t and ok_run else None
    order = {p: i for i, p in enumerate(ORDER)}
    out.sort(key=lambda s: (s["concurrency"], order.get(s["peer"], 99),
                            s["variant"] != "true lengths"))
    return out


HEADER = (f"{'peer':<12} {'variant':<15} {'conc':>4} {'items/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'errors':>7} {'mean bs':>7} {'cpu ms/it':>9} {'rss MB':>7} {'max|diff|':>9} "
          f"{'check':>9} {'ts x':>6}")

LEGEND = (
    "items/s: successful items per second over the window (drain included); p50/p99 over the\n"
    "requests started in the window; mean bs: mean executed batch size in the window;\n"
    "cpu ms/it: CPU ms the server's process tree spent per item in the window; rss MB: the\n"
    "tree's peak summed RSS; max|diff|: max abs difference vs the model run alone ('!' = check\n"
    "failed or over the tolerance); check: a fixed request alone + a burst of 16 lengths, each\n"
    "vs the model alone; ts x: tensorserve items/s / peer items/s (same concurrency)"
)


def fmt_summary(s: dict[str, Any]) -> str:
    if "items_per_s" not in s:
        return f"{s['peer']:<12} {s['variant']:<15} {s['concurrency']:>4}  n/a: {s.get('note')}"
    diff = _f(s.get("max_abs_diff"), ".1e") + ("" if s.get("check_ok") else "!")
    chk = "ok" if s.get("check_ok") else f"{s.get('check_failed')}/{s.get('check_requests')} bad"
    return (f"{s['peer']:<12} {s['variant']:<15} {s['concurrency']:>4} "
            f"{_f(s['items_per_s'], '.1f'):>8} {_f(s['p50_ms'], '.1f'):>8} "
            f"{_f(s['p99_ms'], '.1f'):>8} {s['errors']:>7} {_f(s['mean_batch'], '.2f'):>7} "
            f"{_f(s.get('server_cpu_ms_per_item'), '.2f'):>9} {_f(s.get('peak_rss_mb'), '.0f'):>7} "
            f"{diff:>9} {chk:>9} {_f(s['tensorserve_ratio'], '.2f'):>6}")


def fmt_row(r: dict[str, Any]) -> str:
    if "load" not in r:
        return f"{r['peer']} / {r['variant']} / c={r['concurrency']}: FAILED {r.get('failed')}"
    lo, c = r["load"], r.get("check", {})
    return (f"{r['peer']:<12} {r['variant']:<15} c={r['concurrency']:<3} "
            f"{lo['items_per_s']:8.1f} items/s  p50 {_f(lo['latency_ms']['p50'], '.1f')} ms  "
            f"p99 {_f(lo['latency_ms']['p99'], '.1f')} ms  errors {lo['errors']}  "
            f"mean batch {_f(lo['avg_batch_size'] if lo['batches'] else None, '.2f')}  "
            f"server cpu {_f(per_item_ms(lo.get('server_cpu_s'), lo['items']), '.2f')} ms/item  "
            f"max|diff| {_f(c.get('max_abs_diff'), '.1e')} (check failures {c.get('failed')})")


def plot(summary: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels: list[tuple[str, str]] = []
    for s in summary:
        key = (s["peer"], s["variant"])
        if key not in labels and "items_per_s" in s:
            labels.append(key)
    concs = sorted({s["concurrency"] for s in summary})
    if not labels:
        return
    by = {(s["peer"], s["variant"], s["concurrency"]): s for s in summary}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    width = 0.8 / max(1, len(concs))
    xs = range(len(labels))
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    for ax, key, title in ((axes[0], "items_per_s", "throughput (items/s, higher is better)"),
                           (axes[1], "p99_ms", "p99 latency (ms, lower is better)")):
        for j, c in enumerate(concs):
            vals = [(by.get((p, v, c)) or {}).get(key) or 0 for p, v in labels]
            bars = ax.bar([x + (j - (len(concs) - 1) / 2) * width for x in xs], vals, width,
                          label=f"concurrency {c}", color=colors[j % len(colors)])
            for b, (p, v) in zip(bars, labels):
                s = by.get((p, v, c)) or {}
                if s.get("errors"):
                    ax.annotate(f"{s['errors']} err", (b.get_x() + b.get_width() / 2,
                                b.get_height()), ha="center", va="bottom", fontsize=7,
                                color="crimson", rotation=90)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{p}\n{v}" for p, v in labels], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"tagger (2-layer Transformer, vocab 30000), 1 item/request, lengths 8-128, "
                 f"max batch {meta['max_batch']}, delay {meta['max_delay_ms']} ms, "
                 f"{meta['cpus']} CPU cores, {meta['duration_s']:.0f} s windows"
                 + (f"\n(shared machine: 1-min load average {meta['loadavg_start'][0]:.1f} "
                    f"before the run)" if meta.get("loadavg_start") else ""), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
