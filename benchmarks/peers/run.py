#!/usr/bin/env python3
"""Peer comparison: tensorserve vs Triton (PyTriton), MLServer, LitServe, `batched`.

    python benchmarks/peers/run.py                       # everything (~7-9 min)
    python benchmarks/peers/run.py --duration 3          # smoke run
    python benchmarks/peers/run.py --peers tensorserve,litserve --concurrency 32

Every peer runs at each of its settings, its defaults and its best documented
ones: torch's intra-op threads (``--threads``, default ``1,default``: one
thread, and the library's own default, one per core) and, for ``batched``,
the forward pass on the event loop and in a worker thread. tensorserve runs
at its defaults (the tagger's config without ``isolation`` and
``max_batch_tokens``, no thread flag) and tuned as the bundled tagger shipped
until it took ``max_batch_tokens = "auto"`` (``isolation = "process"``, and
``--max-batch-tokens 1024`` by flag), each over the
native msgpack protocol and KServe v2 JSON. The report ends with the best
setting of each peer beside tensorserve's defaults and best, per protocol.

Same model module and weights for every server (``model_repository/tagger``
rebuilt with ``vocab_size = 30000`` by ``scripts/generate_example_weights.py``
into ``benchmarks/.cache/peers/repo``), same request stream (one item per
request, token lengths uniform in 8..128, fixed seed), same batching limits
(max batch and queue delay read from the tagger's ``config.toml``), same torch
thread count, and the same load generator as ``tensorserve bench`` and
``benchmarks/serving.py``: ``tensorserve_bench.loadgen.run_point`` with its
raw HTTP client and its window rules, each peer's protocol spelled by
``targets.PeerTarget``.

For every concurrency (and repeat) each server is started in its own session,
waited for, checked for correctness (a fixed request alone, then a burst of
different lengths, each compared with the model run alone), warmed up,
measured, then stopped; ``tensorserve_bench.server.ChildServer`` stops every
process of the server's tree, killing leftovers by PID (LitServe leaves its
workers behind on SIGTERM), and measures the tree's CPU and peak memory.

Writes ``benchmarks/results/peers.json`` and ``docs/img/peers.png``. Runs in
the interpreter that has tensorserve (with its ``bench`` extra); the other
peers run in their own virtualenvs (``setup.sh``, run first unless
``--skip-setup``), and a peer whose virtualenv is missing is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from protocols import VOCAB_SIZE
from report import (
    DEFAULT_PEERS,
    HEADER,
    LEGEND,
    ORDER,
    best_of_families,
    fmt_best,
    fmt_row,
    fmt_summary,
    plot,
    summarize,
)

VENVS = HERE / ".venvs"
CACHE = ROOT / "benchmarks" / ".cache" / "peers"
RESULTS = ROOT / "benchmarks" / "results" / "peers.json"
PLOT = ROOT / "docs" / "img" / "peers.png"

ALL_PEERS = ORDER
CHECK_TOL = 1e-3
LENGTHS = (8, 128)


# --------------------------------------------------------------------------- set-up

def setup_venvs(peers: list[str]) -> None:
    """The peers' virtualenvs (tensorserve runs in this interpreter)."""
    wanted = [p for p in peers if PEERS[p].launch is not launch_tensorserve]
    if wanted:
        subprocess.run(["bash", str(HERE / "setup.sh"), *wanted], check=True)


def prepare_repository() -> Path:
    """``<cache>/repo/tagger``: the shared tagger with vocab_size=30000 + seeded weights."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from generate_example_weights import make_variant, read_parameters
    from tensorserve_bench.repositories import cached_copy

    def bigger(source: Path, dest: Path) -> None:
        make_variant(source, dest, {"vocab_size": VOCAB_SIZE}, seed=0)

    dst = cached_copy(ROOT / "model_repository" / "tagger", CACHE / "repo" / "tagger", bigger,
                      key=f"vocab_size={VOCAB_SIZE}")
    assert read_parameters(dst)["vocab_size"] == VOCAB_SIZE
    return dst


def prepare_defaults_repository(tuned: Path) -> Path:
    """``<cache>/repo-defaults/tagger``: the same tagger with nothing tuned
    (its config.toml without ``isolation`` and ``max_batch_tokens``)."""
    from tensorserve_bench.repositories import TUNED_KEYS, cached_copy

    return cached_copy(tuned, CACHE / "repo-defaults" / "tagger", without=TUNED_KEYS).parent


# --------------------------------------------------------------------------- peers

@dataclass
class Ctx:
    repo: Path
    model_dir: Path
    max_batch: int
    max_delay_ms: float
    defaults_repo: Path  # the tagger without isolation and budget: tensorserve's defaults decide


@dataclass
class Launch:
    """A peer's server, not started yet, and where to reach it."""

    server: Any  # tensorserve_bench.server.ChildServer
    base_url: str
    stats_file: str | None = None  # a glob of the peer's counters files; None: tensorserve's stats


@dataclass(frozen=True)
class Setting:
    """One way to run a server: torch's intra-op threads (None: the server's
    own default) and the server script's extra arguments."""

    label: str
    threads: int | None = None
    args: tuple[str, ...] = ()


@dataclass
class Peer:
    name: str
    protocol: str
    variants: list[tuple[str, int | None]]
    launch: Callable[[Ctx, Path, Path, Setting], Launch]
    description: str = ""
    # A server's own settings (tensorserve's), or None: one per --threads value.
    settings: list[Setting] | None = None
    # Where the peer's best setting is shown: its family's line in the report.
    family: str = ""
    extra_settings: list[tuple[str, tuple[str, ...]]] = field(default_factory=lambda: [("", ())])

    def settings_for(self, threads: list[int | None]) -> list[Setting]:
        if self.settings is not None:
            return self.settings
        return [
            Setting(", ".join(x for x in (label, thread_label(t)) if x), t, args)
            for label, args in self.extra_settings
            for t in threads
        ]


def thread_label(threads: int | None) -> str:
    return "torch default threads" if threads is None else f"{threads} thread(s)"


# Every server: its own session (so all its processes can be found), the
# tree's memory sampled twice a second.
SERVER_OPTIONS: dict[str, Any] = {"new_session": True, "sample_interval": 0.5}


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads is None:  # the library's own default
            env.pop(k, None)
        else:
            env[k] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def _peer_py(peer: str) -> str:
    python = VENVS / peer / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"no virtualenv for {peer} ({python}); run setup.sh {peer}")
    return str(python)


def _peer_server(name: str, argv: list[str], setting: Setting, ready_url: str,
                 log: Path) -> Any:
    from tensorserve_bench.server import ChildServer

    return ChildServer([*argv, *setting.args], ready_url=ready_url, env=_env(setting.threads),
                       cwd=HERE, log=log, name=name, ready_timeout=180.0, **SERVER_OPTIONS)


def _common_args(ctx: Ctx, stats: str, setting: Setting) -> list[str]:
    threads = 0 if setting.threads is None else setting.threads  # 0: torch's default
    return ["--model-dir", str(ctx.model_dir), "--max-batch", str(ctx.max_batch),
            "--max-delay-ms", str(ctx.max_delay_ms), "--threads", str(threads),
            "--stats-file", stats]


def launch_tensorserve(ctx: Ctx, stats_dir: Path, log: Path, setting: Setting) -> Launch:
    """``python -m tensorserve serve`` with this interpreter: the helper the
    serving benchmark and the tests start it with. The setting's first
    argument picks the repository: ``defaults`` or ``tuned`` (the bundled
    tagger's config as it ships)."""
    from tensorserve_bench.server import ServerProcess

    which, *extra = setting.args
    repo = ctx.defaults_repo if which == "defaults" else ctx.repo
    threads = [] if setting.threads is None else ["--intra-op-threads", str(setting.threads)]
    server = ServerProcess(str(repo), [*threads, *extra], env=_env(setting.threads), log=log,
                           ready_timeout=180.0, **SERVER_OPTIONS)
    return Launch(server, server.url)


def launch_pytriton(ctx: Ctx, stats_dir: Path, log: Path, setting: Setting) -> Launch:
    from tensorserve_bench.server import free_port

    port, grpc, metrics = free_port(), free_port(), free_port()
    stats = str(stats_dir / "pytriton.json")
    argv = [_peer_py("pytriton"), str(HERE / "serve_pytriton.py"),
            *_common_args(ctx, stats, setting),
            "--port", str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    base = f"http://127.0.0.1:{port}"
    server = _peer_server("pytriton", argv, setting, base + "/v2/models/tagger/ready", log)
    return Launch(server, base, stats_file=stats)


def launch_mlserver(ctx: Ctx, stats_dir: Path, log: Path, setting: Setting) -> Launch:
    from tensorserve_bench.server import free_port

    port, grpc, metrics = free_port(), free_port(), free_port()
    stats = str(stats_dir / "mlserver-{pid}.json")
    argv = [_peer_py("mlserver"), str(HERE / "serve_mlserver.py"),
            *_common_args(ctx, stats, setting),
            "--port", str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--workdir", str(stats_dir / "mlserver-settings")]
    base = f"http://127.0.0.1:{port}"
    server = _peer_server("mlserver", argv, setting, base + "/v2/models/tagger/ready", log)
    return Launch(server, base, stats_file=str(stats_dir / "mlserver-*.json"))


def launch_litserve(ctx: Ctx, stats_dir: Path, log: Path, setting: Setting) -> Launch:
    from tensorserve_bench.server import free_port

    port = free_port()
    stats = str(stats_dir / "litserve-{pid}.json")
    argv = [_peer_py("litserve"), str(HERE / "serve_litserve.py"),
            *_common_args(ctx, stats, setting),
            "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    server = _peer_server("litserve", argv, setting, base + "/health", log)
    return Launch(server, base, stats_file=str(stats_dir / "litserve-*.json"))


def launch_batched(ctx: Ctx, stats_dir: Path, log: Path, setting: Setting) -> Launch:
    from tensorserve_bench.server import free_port

    port = free_port()
    stats = str(stats_dir / "batched.json")
    argv = [_peer_py("batched"), str(HERE / "serve_batched.py"),
            *_common_args(ctx, stats, setting),
            "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    server = _peer_server("batched", argv, setting, base + "/v2/health/ready", log)
    return Launch(server, base, stats_file=stats)


TRUE = ("true lengths", None)
PAD = ("client pad 128", 128)
TS_DEFAULTS = [Setting("defaults", None, ("defaults",))]
# The tagger once shipped a 1024-token budget; it ships "auto" now, so the flag keeps
# this contender what its measurements in docs/performance.md were.
TS_TUNED = [Setting("process, budget 1024", None, ("tuned", "--max-batch-tokens", "1024"))]
PEERS: dict[str, Peer] = {
    "tensorserve": Peer("tensorserve", "msgpack", [TRUE], launch_tensorserve,
                        "server pads each batch to its longest item, un-pads per caller",
                        settings=TS_DEFAULTS, family="tensorserve defaults, msgpack"),
    "ts-json": Peer("ts-json", "kserve-json", [TRUE], launch_tensorserve,
                    "tensorserve at its defaults, KServe v2 JSON",
                    settings=TS_DEFAULTS, family="tensorserve defaults, KServe v2 JSON"),
    "ts-tuned": Peer("ts-tuned", "msgpack", [TRUE], launch_tensorserve,
                     "tensorserve as the bundled tagger ships", settings=TS_TUNED,
                     family="tensorserve tuned, msgpack"),
    "ts-tuned-json": Peer("ts-tuned-json", "kserve-json", [TRUE], launch_tensorserve,
                          "tensorserve as the bundled tagger ships, KServe v2 JSON",
                          settings=TS_TUNED, family="tensorserve tuned, KServe v2 JSON"),
    "ts-thread": Peer("ts-thread", "msgpack", [TRUE], launch_tensorserve,
                      "tensorserve with the model in a thread (--isolation thread)",
                      settings=[Setting("tuned, --isolation thread", None,
                                        ("tuned", "--isolation", "thread"))],
                      family="tensorserve tuned, msgpack"),
    # Triton/MLServer: pad first, so a failing true-length run can't disturb it
    "pytriton": Peer("pytriton", "kserve-binary", [PAD, TRUE], launch_pytriton,
                     "Triton dynamic batcher (same-shape requests only)", family="Triton (PyTriton)"),
    "mlserver": Peer("mlserver", "kserve-json", [PAD, TRUE], launch_mlserver,
                     "adaptive batching (concatenates requests along dim 0)", family="MLServer"),
    "litserve": Peer("litserve", "litserve-json", [TRUE], launch_litserve,
                     "batch()/unbatch() pad and un-pad in the LitAPI", family="LitServe"),
    "batched": Peer("batched", "msgpack", [TRUE], launch_batched,
                    "batched.aio.inference.dynamically(pad_tokens=...) + aiohttp",
                    family="`batched` + aiohttp",
                    extra_settings=[("forward on the loop", ("--forward", "loop")),
                                    ("forward in a thread", ("--forward", "thread"))]),
}


# --------------------------------------------------------------------------- correctness

class Reference:
    """The shared tagger run alone (batch of one, no padding) in this process."""

    def __init__(self, model_dir: Path) -> None:
        from common import load_tagger, run_batch

        self._run = run_batch
        self.model = load_tagger(model_dir, threads=1)
        self._cache: dict[bytes, Any] = {}

    def logits(self, ids: Any) -> Any:
        import numpy as np

        key = ids.tobytes()
        if key not in self._cache:
            self._cache[key] = self._run(self.model, ids[None], np.ones_like(ids)[None])[0]
        return self._cache[key]


def check_items() -> list[Any]:
    """A fixed request (77 tokens), then a burst of 16 items of different lengths."""
    from protocols import make_items

    fixed = make_items(1, seed=7, min_len=77, max_len=77)
    return fixed + make_items(16, seed=8)


# --------------------------------------------------------------------------- one run

async def measure(launch: Launch, peer: Peer, variant: str, pad_to: int | None, conc: int,
                  args: argparse.Namespace, ref: Reference, items: list[Any]) -> dict[str, Any]:
    """Check one variant, then measure it with tensorserve's load generator."""
    from targets import PeerTarget
    from tensorserve_bench.lengths import uniform
    from tensorserve_bench.loadgen import run_point
    from tensorserve_bench.sweep import build_pool

    target = PeerTarget(launch.base_url, peer.protocol, pad_to=pad_to,
                        stats_file=launch.stats_file, server=launch.server, timeout=args.timeout)
    await target.open()
    try:
        row: dict[str, Any] = {"check": await target.check(ref, items, CHECK_TOL)}
        # The same seeded stream for every peer (and for `tensorserve bench --seed`).
        pool, lengths = build_pool(target, uniform(*LENGTHS), pool_items=args.pool,
                                   seed=args.seed, max_id=VOCAB_SIZE)
        launch.server.reset_peak()
        point = await run_point(target, pool, concurrency=conc, duration=args.duration,
                                warmup=args.warmup, variant=f"{peer.name} {variant}",
                                seed=args.seed)
        row["load"] = point.to_dict()
        row["lengths"] = lengths
        row["server"] = {"peak_rss_mb": launch.server.peak_rss_bytes / 2**20,
                         "processes": launch.server.usage().processes}
        return row
    finally:
        await target.aclose()


def run_peer(peer: Peer, setting: Setting, ctx: Ctx, conc: int, rep: int,
             args: argparse.Namespace, ref: Reference, items: list[Any]) -> list[dict[str, Any]]:
    slug = "".join(c if c.isalnum() else "-" for c in setting.label)
    tag = f"{peer.name}-{slug}-c{conc}-r{rep}"
    stats_dir = CACHE / "run" / tag
    if stats_dir.exists():
        shutil.rmtree(stats_dir)
    stats_dir.mkdir(parents=True)
    base = {"peer": peer.name, "setting": setting.label, "family": peer.family,
            "concurrency": conc, "repeat": rep, "protocol": peer.protocol,
            "loadavg_before": os.getloadavg()}
    try:
        launch = peer.launch(ctx, stats_dir, CACHE / "logs" / f"{tag}.log", setting)
    except FileNotFoundError as exc:
        print(f"  {peer.name}: SKIPPED - {exc}", flush=True)
        return [{**base, "variant": v, "skipped": str(exc)} for v, _ in peer.variants]
    started = time.monotonic()
    try:
        launch.server.start()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"  {peer.name}: FAILED to start - {exc}", flush=True)
        return [{**base, "variant": v, "failed": str(exc)} for v, _ in peer.variants]
    startup = time.monotonic() - started
    rows = []
    try:
        for variant, pad_to in peer.variants:
            row: dict[str, Any] = {**base, "variant": variant, "pad_to": pad_to,
                                   "startup_s": startup}
            try:
                row.update(asyncio.run(measure(launch, peer, variant, pad_to, conc, args,
                                               ref, items)))
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["failed"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print("  " + fmt_row(row), flush=True)
    finally:
        stop = launch.server.stop()
        if stop.leftovers:
            print(f"  {peer.name}: killed {len(stop.leftovers)} leftover process(es) after "
                  f"SIGTERM: {sorted(stop.leftovers)}", flush=True)
        for row in rows:
            row["stop"] = {"returncode": stop.returncode,
                           "killed_after_sigterm": {str(k): v for k, v in stop.leftovers.items()}}
    return rows


# --------------------------------------------------------------------------- report

def versions() -> dict[str, str]:
    from importlib import metadata

    out = {pkg: metadata.version(pkg) for pkg in ("tensorserve", "torch", "psutil")}
    pkgs = {"pytriton": "nvidia-pytriton", "mlserver": "mlserver", "litserve": "litserve",
            "batched": "batched"}
    for venv, pkg in pkgs.items():
        py = VENVS / venv / "bin" / "python"
        if py.exists():
            code = f"import importlib.metadata as m; print(m.version('{pkg}'), m.version('torch'))"
            r = subprocess.run([str(py), "-c", code],
                               capture_output=True, text=True, check=False)
            out[pkg] = r.stdout.strip() or r.stderr.strip()[-200:]
    return out


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                    help=f"comma list from {','.join(ALL_PEERS)}")
    ap.add_argument("--concurrency", default="32,64", help="comma list, e.g. 32,64")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", default="1,default",
                    help="the peers' torch intra-op thread settings, each run: a comma list of "
                         "counts and 'default' (the library's own: one per core)")
    ap.add_argument("--seed", type=int, default=1234, help="request-stream seed")
    ap.add_argument("--pool", type=int, default=2048, help="distinct pre-encoded requests")
    ap.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in s")
    ap.add_argument("--skip-setup", action="store_true", help="don't run setup.sh first")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--plot", default=str(PLOT))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw --plot from the results in --out")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args(sys.argv[1:])
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s): {unknown}; known: {ALL_PEERS}")
    if args.replot:
        saved = json.loads(Path(args.out).read_text())
        plot(saved["best"], saved["meta"], Path(args.plot))
        print(f"wrote {args.plot}")
        return 0
    if not args.skip_setup:
        setup_venvs(peers)

    from common import model_config

    concs = [int(c) for c in args.concurrency.split(",")]
    repo_model = prepare_repository()
    cfg = model_config(repo_model)
    ctx = Ctx(repo=repo_model.parent, model_dir=repo_model,
              max_batch=int(cfg.get("max_batch_size", 32)),
              max_delay_ms=float(cfg.get("dynamic_batching", {}).get("max_queue_delay_ms", 5.0)),
              defaults_repo=prepare_defaults_repository(repo_model))
    threads = [None if t.strip() == "default" else int(t) for t in args.threads.split(",")]
    ref = Reference(repo_model)
    items = check_items()
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "peers": peers, "concurrency": concs,
            "duration_s": args.duration, "warmup_s": args.warmup, "repeats": args.repeats,
            "threads": args.threads, "max_batch": ctx.max_batch,
            "max_delay_ms": ctx.max_delay_ms, "seed": args.seed, "pool": args.pool,
            "vocab_size": VOCAB_SIZE, "lengths": list(LENGTHS), "items_per_request": 1,
            "check_tolerance": CHECK_TOL, "versions": versions(),
            "loadgen": "tensorserve_bench.loadgen.run_point (closed loop, RawHttpPool)",
            "tensorserve_command": [sys.executable, "-m", "tensorserve", "serve"]}
    print(f"model: {repo_model} (max batch {ctx.max_batch}, delay {ctx.max_delay_ms} ms, "
          f"peers' torch threads {args.threads})", flush=True)

    load1 = os.getloadavg()[0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        print(f"warning: 1-min load average is {load1:.2f} on {os.cpu_count()} cores before "
              "starting; other work on this machine will skew the numbers", flush=True)
    meta["loadavg_start"] = os.getloadavg()
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for rep in range(args.repeats):
        for conc in concs:
            for name in peers:
                for setting in PEERS[name].settings_for(threads):
                    print(f"[rep {rep} c={conc}] {name} [{setting.label}]", flush=True)
                    rows.extend(run_peer(PEERS[name], setting, ctx, conc, rep, args, ref, items))
    summary = summarize(rows)
    meta["elapsed_s"] = time.monotonic() - started
    meta["loadavg_end"] = os.getloadavg()

    print("\n" + HEADER)
    print("-" * len(HEADER))
    for s in summary:
        print(fmt_summary(s))
    print(LEGEND.replace("the tolerance", f"the tolerance {CHECK_TOL}"))
    best = best_of_families(summary)
    print("\n" + "\n".join(fmt_best(best)))
    for s in summary:
        if s.get("error_sample"):
            print(f"  {s['peer']} {s['variant']} c={s['concurrency']}: e.g. {s['error_sample']}")

    from tensorserve_bench.results import write_json

    out = write_json(args.out, {"meta": meta, "summary": summary, "best": best, "runs": rows},
                     indent=1)
    print(f"\nwrote {out}")
    if not args.no_plot:
        plot(best, meta, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
