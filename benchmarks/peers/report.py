"""The peer comparison's summary table and plot, from the runs' rows.

A row is one (peer, variant, concurrency, repeat): its correctness ``check``,
its ``load`` (a ``tensorserve_bench.loadgen.PointResult`` as a dict), the
server tree's peak memory and how the server stopped.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

ORDER = ["tensorserve", "ts-json", "ts-tuned", "ts-tuned-json", "ts-thread", "pytriton",
         "mlserver", "litserve", "batched"]
# The default run: ts-thread (the tuned tagger with the model in a thread) only when asked.
DEFAULT_PEERS = [p for p in ORDER if p != "ts-thread"]
# The report's last table: each of these families' best setting, tensorserve's first.
TENSORSERVE_FAMILIES = [
    "tensorserve defaults, msgpack",
    "tensorserve defaults, KServe v2 JSON",
    "tensorserve tuned, msgpack",
    "tensorserve tuned, KServe v2 JSON",
]


def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def per_item_ms(seconds: float | None, items: int) -> float | None:
    return 1000 * seconds / items if seconds is not None and items else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (peer, setting, variant, concurrency): medians over the repeats."""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["peer"], r.get("setting", ""), r["variant"], r["concurrency"])
        groups.setdefault(key, []).append(r)
    out = []
    for (peer, setting, variant, conc), rs in groups.items():
        loads = [r["load"] for r in rs if "load" in r]
        s: dict[str, Any] = {"peer": peer, "setting": setting, "family": rs[0].get("family"),
                             "variant": variant, "concurrency": conc,
                             "runs": len(rs), "measured": len(loads)}
        if not loads:
            note = next((r.get("skipped") or r.get("failed") for r in rs), "no data")
            s["note"] = (note or "").splitlines()[0][:120]
            out.append(s)
            continue

        def med(get: Callable[[dict[str, Any]], float | None],
                loads: list[dict[str, Any]] = loads) -> float | None:
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
                            s["variant"] != "true lengths", s["setting"]))
    return out


def best_of_families(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, each family's best line (the most items/s among its
    settings and variants that served without errors and passed the check),
    with tensorserve's defaults and best (of defaults and tuned) per protocol
    over it."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for s in summary:
        usable = s.get("items_per_s") and not s.get("errors") and s.get("check_ok")
        key = (s["concurrency"], s.get("family") or s["peer"])
        if usable and s["items_per_s"] > best.get(key, {}).get("items_per_s", 0):
            best[key] = s
    out = []
    for (conc, family), s in sorted(best.items(), key=lambda kv: kv[0][0]):
        row = {"concurrency": conc, "family": family, "setting": s["setting"],
               "variant": s["variant"], "items_per_s": s["items_per_s"], "p50_ms": s["p50_ms"],
               "p99_ms": s["p99_ms"], "mean_batch": s["mean_batch"]}

        def ratio(*families: str, conc: int = conc, row: dict[str, Any] = row) -> float | None:
            mine = [best[conc, f]["items_per_s"] for f in families if (conc, f) in best]
            return max(mine) / row["items_per_s"] if mine else None

        row["defaults_msgpack_x"] = ratio("tensorserve defaults, msgpack")
        row["defaults_json_x"] = ratio("tensorserve defaults, KServe v2 JSON")
        row["best_msgpack_x"] = ratio("tensorserve defaults, msgpack", "tensorserve tuned, msgpack")
        row["best_json_x"] = ratio("tensorserve defaults, KServe v2 JSON",
                                   "tensorserve tuned, KServe v2 JSON")
        out.append(row)
    rank = {f: i for i, f in enumerate(TENSORSERVE_FAMILIES)}
    out.sort(key=lambda r: (r["concurrency"], rank.get(r["family"], 99)))
    return out


def fmt_best(best: list[dict[str, Any]]) -> list[str]:
    """The best-of-each table, as markdown (docs/performance.md quotes it)."""
    lines = [
        "Each at its best setting (no errors, check passed); x: tensorserve's items/s over it",
        (
            "| c | server | best setting | variant | items/s | p50 ms | p99 ms | mean batch "
            "| ts defaults msgpack x | ts defaults JSON x | ts best msgpack x | ts best JSON x |"
        ),
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in best:
        lines.append(
            f"| {r['concurrency']} | {r['family']} | {r['setting']} | {r['variant']} "
            f"| {_f(r['items_per_s'], '.1f')} | {_f(r['p50_ms'], '.1f')} "
            f"| {_f(r['p99_ms'], '.1f')} | {_f(r['mean_batch'], '.2f')} "
            f"| {_f(r['defaults_msgpack_x'], '.2f')} | {_f(r['defaults_json_x'], '.2f')} "
            f"| {_f(r['best_msgpack_x'], '.2f')} | {_f(r['best_json_x'], '.2f')} |"
        )
    return lines


HEADER = (f"{'peer':<13} {'setting':<44} {'variant':<15} {'conc':>4} {'items/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
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
        return (f"{s['peer']:<13} {s['setting']:<44} {s['variant']:<15} {s['concurrency']:>4}  "
                f"n/a: {s.get('note')}")
    diff = _f(s.get("max_abs_diff"), ".1e") + ("" if s.get("check_ok") else "!")
    chk = "ok" if s.get("check_ok") else f"{s.get('check_failed')}/{s.get('check_requests')} bad"
    return (f"{s['peer']:<13} {s['setting']:<44} {s['variant']:<15} {s['concurrency']:>4} "
            f"{_f(s['items_per_s'], '.1f'):>8} {_f(s['p50_ms'], '.1f'):>8} "
            f"{_f(s['p99_ms'], '.1f'):>8} {s['errors']:>7} {_f(s['mean_batch'], '.2f'):>7} "
            f"{_f(s.get('server_cpu_ms_per_item'), '.2f'):>9} {_f(s.get('peak_rss_mb'), '.0f'):>7} "
            f"{diff:>9} {chk:>9} {_f(s['tensorserve_ratio'], '.2f'):>6}")


def fmt_row(r: dict[str, Any]) -> str:
    if "load" not in r:
        return f"{r['peer']} / {r['variant']} / c={r['concurrency']}: FAILED {r.get('failed')}"
    lo, c = r["load"], r.get("check", {})
    return (f"{r['peer']:<13} [{r.get('setting', '')}] {r['variant']:<15} c={r['concurrency']:<3} "
            f"{lo['items_per_s']:8.1f} items/s  p50 {_f(lo['latency_ms']['p50'], '.1f')} ms  "
            f"p99 {_f(lo['latency_ms']['p99'], '.1f')} ms  errors {lo['errors']}  "
            f"mean batch {_f(lo['avg_batch_size'] if lo['batches'] else None, '.2f')}  "
            f"server cpu {_f(per_item_ms(lo.get('server_cpu_s'), lo['items']), '.2f')} ms/item  "
            f"max|diff| {_f(c.get('max_abs_diff'), '.1e')} (check failures {c.get('failed')})")


def plot(best: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    """Each server at its best setting (``best_of_families``), per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["family"] for r in best))
    concs = sorted({r["concurrency"] for r in best})
    if not labels:
        return
    by = {(r["family"], r["concurrency"]): r for r in best}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    width = 0.8 / max(1, len(concs))
    xs = range(len(labels))
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
    for ax, key, title in ((axes[0], "items_per_s", "throughput (items/s, higher is better)"),
                           (axes[1], "p99_ms", "p99 latency (ms, lower is better)")):
        for j, c in enumerate(concs):
            vals = [(by.get((f, c)) or {}).get(key) or 0 for f in labels]
            ax.bar([x + (j - (len(concs) - 1) / 2) * width for x in xs], vals, width,
                   label=f"concurrency {c}", color=colors[j % len(colors)])
        ax.set_xticks(list(xs))
        names = [f.replace(", ", "\n").replace("tensorserve ", "tensorserve\n") for f in labels]
        ax.set_xticklabels(names, fontsize=7)
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
