#!/usr/bin/env python3
"""Peer comparison: tensorserve vs Triton (PyTriton), MLServer, LitServe, `batched`.

    python benchmarks/peers/run.py                       # everything (~7-9 min)
    python benchmarks/peers/run.py --duration 3          # smoke run
    python benchmarks/peers/run.py --peers tensorserve,litserve --concurrency 32

Same model module and weights for every server (``model_repository/tagger``
rebuilt with ``vocab_size = 30000`` by ``scripts/generate_example_weights.py``
into ``benchmarks/.cache/peers/repo``), same request stream (one item per
request, token lengths uniform in 8..128, fixed seed), same closed-loop load
generator (``loadgen.py``), same batching limits (max batch and queue delay
read from the tagger's ``config.toml``), same torch thread count.

For every concurrency (and repeat) each server is started in its own session,
waited for, checked for correctness (a fixed request alone, then a burst of
different lengths, each compared with the model run alone), warmed up,
measured, then stopped; the runner verifies that every process of the server's
tree is gone, killing leftovers by PID (LitServe leaves its workers behind on
SIGTERM).

Writes ``benchmarks/results/peers.json`` and ``docs/img/peers.png``.
Runs inside ``benchmarks/peers/.venvs/bench`` (re-executes itself there after
``setup.sh``); the tensorserve server runs with the interpreter that has the
``tensorserve`` command (the one that launched this script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENVS = HERE / ".venvs"
CACHE = ROOT / "benchmarks" / ".cache" / "peers"
RESULTS = ROOT / "benchmarks" / "results" / "peers.json"
PLOT = ROOT / "docs" / "img" / "peers.png"
BENCH_PY = VENVS / "bench" / "bin" / "python"
HOST_PY_ENV = "TS_PEERS_HOST_PYTHON"

ALL_PEERS = ["tensorserve", "ts-thread", "pytriton", "mlserver", "litserve", "batched"]
VOCAB_SIZE = 30000
CHECK_TOL = 1e-3


# --------------------------------------------------------------------------- set-up

def _in_bench_venv() -> bool:
    return Path(sys.prefix).resolve() == (VENVS / "bench").resolve()


def bootstrap(argv: list[str], peers: list[str], skip_setup: bool) -> None:
    """Create the venvs if needed, then re-exec this script in the bench venv."""
    if _in_bench_venv():
        return
    if not skip_setup:
        wanted = ["bench"] + [p for p in peers if p not in ("tensorserve", "ts-thread")]
        subprocess.run(["bash", str(HERE / "setup.sh"), *wanted], check=True)
    env = dict(os.environ)
    env.setdefault(HOST_PY_ENV, sys.executable)
    os.execve(str(BENCH_PY), [str(BENCH_PY), str(Path(__file__).resolve()), *argv], env)


def prepare_repository() -> Path:
    """``<cache>/repo/tagger``: the shared tagger with vocab_size=30000 + seeded weights."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from generate_example_weights import make_variant, read_parameters

    src = ROOT / "model_repository" / "tagger"
    dst = CACHE / "repo" / "tagger"
    stamp = dst / ".source-stamp"
    want = json.dumps({"config": (src / "config.toml").read_text(),
                       "model": (src / "1" / "model.py").read_text(), "vocab": VOCAB_SIZE})
    if not (stamp.exists() and stamp.read_text() == want
            and (dst / "1" / "model.safetensors").exists()):
        if dst.exists():
            shutil.rmtree(dst)
        make_variant(src, dst, {"vocab_size": VOCAB_SIZE}, seed=0)
        stamp.write_text(want)
    assert read_parameters(dst)["vocab_size"] == VOCAB_SIZE
    return dst


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, sid, state) for every live process."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        out[int(d.name)] = (int(rest[1]), int(rest[3]), rest[0])
    return out


def tree_pids(root: int) -> set[int]:
    """Live (non-zombie) processes descending from ``root`` or in its session."""
    table = _proc_table()
    found = {p for p, (_, sid, st) in table.items() if sid == root and st != "Z"}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for p, (ppid, _, st) in table.items():
            if ppid == parent and p not in found and st != "Z":
                found.add(p)
                frontier.append(p)
    if root in table and table[root][2] != "Z":
        found.add(root)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "?"


def _alive(pids: set[int]) -> set[int]:
    table = _proc_table()
    return {p for p in pids if p in table and table[p][2] != "Z"}


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    log: Path
    ready_url: str

    def stop(self, grace: float = 10.0) -> dict[str, Any]:
        """SIGTERM the server, then kill whatever is left of its tree, by PID."""
        pids = tree_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.time() + 3.0
        while time.time() < deadline and _alive(pids | tree_pids(self.proc.pid)):
            time.sleep(0.2)  # children shutting down on their own
        leftover = _alive(pids | tree_pids(self.proc.pid))
        killed = {p: _cmdline(p) for p in leftover}
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if not leftover:
                break
            for p in leftover:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            end = time.time() + wait
            while time.time() < end and _alive(leftover):
                time.sleep(0.1)
            leftover = _alive(leftover)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        remaining = _alive(pids | tree_pids(self.proc.pid))
        if remaining:
            raise RuntimeError(f"{self.name}: processes still alive after SIGKILL: "
                               f"{ {p: _cmdline(p) for p in remaining} }")
        return {"killed_after_sigterm": killed}


def start_server(name: str, argv: list[str], env: dict[str, str], ready_url: str,
                 log: Path, timeout: float = 180.0) -> Server:
    import urllib.request

    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "wb")
    proc = subprocess.Popen(argv, env=env, cwd=str(HERE), stdout=fh, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    fh.close()
    server = Server(name, proc, log, ready_url)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{name} exited with {proc.returncode} before becoming ready; "
                               f"log tail:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"{name} not ready after {timeout:.0f}s; log tail:\n{_tail(log)}")


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- peers

@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    ready_url: str
    base_url: str
    stats_file: str | None = None
    stats_url: str | None = None


@dataclass
class Peer:
    name: str
    protocol: str
    variants: list[tuple[str, int | None]]
    launch: Callable[["Ctx", Path], Launch]
    description: str = ""


@dataclass
class Ctx:
    repo: Path
    model_dir: Path
    max_batch: int
    max_delay_ms: float
    threads: int
    host_python: str
    extra: dict[str, Any] = field(default_factory=dict)


def _env(ctx: Ctx) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = str(ctx.threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def _peer_py(peer: str) -> str:
    return str(VENVS / peer / "bin" / "python")


def _common_args(ctx: Ctx, stats: str) -> list[str]:
    return ["--model-dir", str(ctx.model_dir), "--max-batch", str(ctx.max_batch),
            "--max-delay-ms", str(ctx.max_delay_ms), "--threads", str(ctx.threads),
            "--stats-file", stats]


def tensorserve_command(ctx: Ctx) -> list[str] | None:
    exe = shutil.which("tensorserve", path=str(Path(ctx.host_python).parent)) \
        or shutil.which("tensorserve")
    if exe:
        return [exe]
    probe = subprocess.run([ctx.host_python, "-c", "import tensorserve.cli"], cwd=str(ROOT),
                           capture_output=True)
    if probe.returncode == 0:
        return [ctx.host_python, "-m", "tensorserve.cli"]
    return None


def launch_tensorserve_thread(ctx: Ctx, stats_dir: Path) -> Launch:
    """tensorserve with the model in a thread of the server instead of the
    worker process the bundled config asks for."""
    launch = launch_tensorserve(ctx, stats_dir)
    launch.argv += ["--isolation", "thread"]
    return launch


def launch_tensorserve(ctx: Ctx, stats_dir: Path) -> Launch:
    cmd = tensorserve_command(ctx)
    if cmd is None:
        raise FileNotFoundError("tensorserve is not installed (no `tensorserve` command and "
                                "`import tensorserve.cli` fails); run `pip install -e .`")
    port = free_port()
    env = _env(ctx)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [*cmd, "serve", "--model-repository", str(ctx.repo), "--host", "127.0.0.1",
            "--port", str(port), "--intra-op-threads", str(ctx.threads), "--log-level", "WARNING"]
    base = f"http://127.0.0.1:{port}"
    return Launch(argv, env, base + "/v2/health/ready", base,
                  stats_url=base + "/v2/models/tagger/stats")


def launch_pytriton(ctx: Ctx, stats_dir: Path) -> Launch:
    port, grpc, metrics = free_port(), free_port(), free_port()
    stats = str(stats_dir / "pytriton.json")
    argv = [_peer_py("pytriton"), str(HERE / "serve_pytriton.py"), *_common_args(ctx, stats),
            "--port", str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    base = f"http://127.0.0.1:{port}"
    return Launch(argv, _env(ctx), base + "/v2/models/tagger/ready", base, stats_file=stats)


def launch_mlserver(ctx: Ctx, stats_dir: Path) -> Launch:
    port, grpc, metrics = free_port(), free_port(), free_port()
    stats = str(stats_dir / "mlserver-{pid}.json")
    workdir = stats_dir / "mlserver-settings"
    argv = [_peer_py("mlserver"), str(HERE / "serve_mlserver.py"), *_common_args(ctx, stats),
            "--port", str(port), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            "--workdir", str(workdir)]
    base = f"http://127.0.0.1:{port}"
    return Launch(argv, _env(ctx), base + "/v2/models/tagger/ready", base,
                  stats_file=str(stats_dir / "mlserver-*.json"))


def launch_litserve(ctx: Ctx, stats_dir: Path) -> Launch:
    port = free_port()
    stats = str(stats_dir / "litserve-{pid}.json")
    argv = [_peer_py("litserve"), str(HERE / "serve_litserve.py"), *_common_args(ctx, stats),
            "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    return Launch(argv, _env(ctx), base + "/health", base,
                  stats_file=str(stats_dir / "litserve-*.json"))


def launch_batched(ctx: Ctx, stats_dir: Path) -> Launch:
    port = free_port()
    stats = str(stats_dir / "batched.json")
    argv = [_peer_py("batched"), str(HERE / "serve_batched.py"), *_common_args(ctx, stats),
            "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    return Launch(argv, _env(ctx), base + "/v2/health/ready", base, stats_file=stats)


TRUE = ("true lengths", None)
PAD = ("client pad 128", 128)
PEERS: dict[str, Peer] = {
    "tensorserve": Peer("tensorserve", "msgpack", [TRUE], launch_tensorserve,
                        "server pads each batch to its longest item, un-pads per caller"),
    "ts-thread": Peer("ts-thread", "msgpack", [TRUE], launch_tensorserve_thread,
                      "tensorserve with the model in a thread (--isolation thread)"),
    # Triton/MLServer: pad first, so a failing true-length run can't disturb it
    "pytriton": Peer("pytriton", "kserve-binary", [PAD, TRUE], launch_pytriton,
                     "Triton dynamic batcher (same-shape requests only)"),
    "mlserver": Peer("mlserver", "kserve-json", [PAD, TRUE], launch_mlserver,
                     "adaptive batching (concatenates requests along dim 0)"),
    "litserve": Peer("litserve", "litserve-json", [TRUE], launch_litserve,
                     "batch()/unbatch() pad and un-pad in the LitAPI"),
    "batched": Peer("batched", "msgpack", [TRUE], launch_batched,
                    "batched.aio.inference.dynamically(pad_tokens=...) + aiohttp"),
}


# --------------------------------------------------------------------------- correctness

class Reference:
    """The shared tagger run alone (batch of one, no padding) in this process."""

    def __init__(self, model_dir: Path) -> None:
        sys.path.insert(0, str(HERE))
        from common import load_tagger, run_batch

        self._run = run_batch
        self.model = load_tagger(model_dir, threads=1)
        self._cache: dict[bytes, Any] = {}

    def logits(self, ids):
        import numpy as np

        key = ids.tobytes()
        if key not in self._cache:
            self._cache[key] = self._run(self.model, ids[None], np.ones_like(ids)[None])[0]
        return self._cache[key]


async def _check_async(base_url: str, protocol: str, pad_to: int | None, ref: Reference,
                       items: list) -> dict[str, Any]:
    import aiohttp
    import numpy as np

    from protocols import PROTOCOLS

    proto = PROTOCOLS[protocol]
    url = base_url + proto.path

    async def one(session: aiohttp.ClientSession, ids) -> tuple[float | None, str | None]:
        body, extra = proto.encode(ids, pad_to)
        headers = {"Content-Type": proto.content_type, "Accept-Encoding": "identity", **extra}
        try:
            async with session.post(url, data=body, headers=headers) as r:
                payload = await r.read()
                if r.status != 200:
                    return None, f"HTTP {r.status}: {payload[:160]!r}"
                out = proto.decode(payload, r.headers, int(ids.shape[0]))
        except Exception as exc:  # noqa: BLE001
            return None, f"{type(exc).__name__}: {exc}"[:200]
        want = ref.logits(ids)
        if out.shape != want.shape:
            return None, f"shape {out.shape} != {want.shape}"
        return float(np.max(np.abs(out - want))), None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        single, single_err = await one(session, items[0])  # the fixed request, alone
        burst = await asyncio.gather(*(one(session, ids) for ids in items[1:]))
    diffs = [d for d, _ in [(single, single_err), *burst] if d is not None]
    errs = [e for _, e in [(single, single_err), *burst] if e is not None]
    return {"single_max_abs_diff": single, "single_error": single_err,
            "max_abs_diff": max(diffs) if diffs else None,
            "n": len(items), "failed": len(errs), "errors": errs[:3],
            "ok": bool(diffs) and max(diffs) <= CHECK_TOL and not errs}


def check_items() -> list:
    """A fixed request (77 tokens), then a burst of 16 items of different lengths."""
    from protocols import make_items

    fixed = make_items(1, seed=7, min_len=77, max_len=77)
    return fixed + make_items(16, seed=8)


# --------------------------------------------------------------------------- one run

def run_loadgen(launch: Launch, protocol: str, pad_to: int | None, conc: int, args,
                out: Path) -> dict[str, Any]:
    cmd = [str(BENCH_PY), str(HERE / "loadgen.py"), "--url", launch.base_url,
           "--protocol", protocol, "--concurrency", str(conc), "--warmup", str(args.warmup),
           "--duration", str(args.duration), "--seed", str(args.seed), "--out", str(out)]
    if pad_to:
        cmd += ["--pad-to", str(pad_to)]
    if launch.stats_url:
        cmd += ["--stats-url", launch.stats_url]
    if launch.stats_file:
        cmd += ["--stats-file", launch.stats_file]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=str(HERE),
                   timeout=args.warmup + args.duration + 120)
    return json.loads(out.read_text())


def run_peer(peer: Peer, ctx: Ctx, conc: int, rep: int, args, ref: Reference,
             items: list) -> list[dict[str, Any]]:
    tag = f"{peer.name}-c{conc}-r{rep}"
    stats_dir = CACHE / "run" / tag
    if stats_dir.exists():
        shutil.rmtree(stats_dir)
    stats_dir.mkdir(parents=True)
    base = {"peer": peer.name, "concurrency": conc, "repeat": rep, "protocol": peer.protocol,
            "loadavg_before": os.getloadavg()}
    try:
        launch = peer.launch(ctx, stats_dir)
    except FileNotFoundError as exc:
        print(f"  {peer.name}: SKIPPED - {exc}", flush=True)
        return [{**base, "variant": v, "skipped": str(exc)} for v, _ in peer.variants]
    t0 = time.time()
    try:
        server = start_server(peer.name, launch.argv, launch.env, launch.ready_url,
                              CACHE / "logs" / f"{tag}.log")
    except RuntimeError as exc:
        print(f"  {peer.name}: FAILED to start - {exc}", flush=True)
        return [{**base, "variant": v, "failed": str(exc)} for v, _ in peer.variants]
    startup = time.time() - t0
    rows = []
    try:
        for variant, pad_to in peer.variants:
            row = {**base, "variant": variant, "pad_to": pad_to, "startup_s": startup}
            try:
                row["check"] = asyncio.run(_check_async(launch.base_url, peer.protocol, pad_to,
                                                        ref, items))
                row["load"] = run_loadgen(launch, peer.protocol, pad_to, conc, args,
                                          stats_dir / f"load-{pad_to or 'true'}.json")
            except Exception as exc:  # noqa: BLE001 - record and go on
                row["failed"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print("  " + fmt_row(row), flush=True)
    finally:
        stop = server.stop()
        if stop["killed_after_sigterm"]:
            print(f"  {peer.name}: killed {len(stop['killed_after_sigterm'])} leftover "
                  f"process(es) after SIGTERM: {sorted(stop['killed_after_sigterm'])}", flush=True)
        for row in rows:
            row["stop"] = stop
    return rows


# --------------------------------------------------------------------------- report

def _f(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (peer, variant, concurrency): median over repeats."""
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["peer"], r["variant"], r["concurrency"]), []).append(r)
    out = []
    for (peer, variant, conc), rs in groups.items():
        loads = [r["load"] for r in rs if "load" in r]
        s: dict[str, Any] = {"peer": peer, "variant": variant, "concurrency": conc,
                             "runs": len(rs), "measured": len(loads)}
        if not loads:
            s["note"] = next((r.get("skipped") or r.get("failed") for r in rs), "no data")
            s["note"] = (s["note"] or "").splitlines()[0][:120]
            out.append(s)
            continue

        def med(key: str) -> float | None:
            vals = [lo[key] for lo in loads if lo.get(key) is not None]
            return statistics.median(vals) if vals else None

        s.update(items_per_s=med("items_per_s"), p50_ms=med("p50_ms"), p99_ms=med("p99_ms"),
                 errors=sum(lo["errors"] for lo in loads),
                 ok=sum(lo["ok"] for lo in loads))
        means = [lo.get("batch", {}).get("mean") for lo in loads]
        means = [m for m in means if m is not None]
        s["mean_batch"] = statistics.median(means) if means else None
        checks = [r["check"] for r in rs if "check" in r]
        diffs = [c["max_abs_diff"] for c in checks if c.get("max_abs_diff") is not None]
        s["max_abs_diff"] = max(diffs) if diffs else None
        s["check_failed"] = sum(c["failed"] for c in checks)
        s["check_requests"] = sum(c["n"] for c in checks)
        s["check_ok"] = all(c["ok"] for c in checks) if checks else False
        samples: dict[str, int] = {}
        for lo in loads:
            for k, v in lo.get("error_samples", {}).items():
                samples[k] = samples.get(k, 0) + v
        if samples:
            s["error_sample"] = max(samples, key=samples.get)[:200]
        out.append(s)
    ts = {s["concurrency"]: s.get("items_per_s") for s in out if s["peer"] == "tensorserve"}
    for s in out:
        t, p = ts.get(s["concurrency"]), s.get("items_per_s")
        # no ratio against a configuration that mostly fails
        ok_run = p and s.get("errors", 0) <= s.get("ok", 0)
        s["tensorserve_ratio"] = (t / p) if t and ok_run else None
    order = {p: i for i, p in enumerate(ALL_PEERS)}
    out.sort(key=lambda s: (s["concurrency"], order.get(s["peer"], 99),
                            s["variant"] != "true lengths"))
    return out


HEADER = (f"{'peer':<12} {'variant':<15} {'conc':>4} {'items/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'errors':>7} {'mean bs':>7} {'max|diff|':>9} {'check':>9} {'ts x':>6}")


def fmt_summary(s: dict[str, Any]) -> str:
    if "items_per_s" not in s:
        return f"{s['peer']:<12} {s['variant']:<15} {s['concurrency']:>4}  n/a: {s.get('note')}"
    diff = _f(s.get("max_abs_diff"), ".1e") + ("" if s.get("check_ok") else "!")
    chk = "ok" if s.get("check_ok") else f"{s.get('check_failed')}/{s.get('check_requests')} bad"
    return (f"{s['peer']:<12} {s['variant']:<15} {s['concurrency']:>4} "
            f"{_f(s['items_per_s'], '.1f'):>8} {_f(s['p50_ms'], '.1f'):>8} "
            f"{_f(s['p99_ms'], '.1f'):>8} {s['errors']:>7} {_f(s['mean_batch'], '.2f'):>7} "
            f"{diff:>9} {chk:>9} {_f(s['tensorserve_ratio'], '.2f'):>6}")


def fmt_row(r: dict[str, Any]) -> str:
    if "load" not in r:
        return f"{r['peer']} / {r['variant']} / c={r['concurrency']}: FAILED {r.get('failed')}"
    lo, c = r["load"], r.get("check", {})
    return (f"{r['peer']:<12} {r['variant']:<15} c={r['concurrency']:<3} "
            f"{lo['items_per_s']:8.1f} items/s  p50 {_f(lo['p50_ms'], '.1f')} ms  "
            f"p99 {_f(lo['p99_ms'], '.1f')} ms  errors {lo['errors']}  "
            f"mean batch {_f(lo.get('batch', {}).get('mean'), '.2f')}  "
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


def versions() -> dict[str, str]:
    pkgs = {"pytriton": "nvidia-pytriton", "mlserver": "mlserver", "litserve": "litserve",
            "batched": "batched"}
    out = {}
    for venv, pkg in pkgs.items():
        py = VENVS / venv / "bin" / "python"
        if py.exists():
            r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; "
                                f"print(m.version('{pkg}'), m.version('torch'))"],
                               capture_output=True, text=True)
            out[pkg] = r.stdout.strip() or r.stderr.strip()[-200:]
    return out


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(ALL_PEERS),
                    help=f"comma list from {','.join(ALL_PEERS)}")
    ap.add_argument("--concurrency", default="32,64", help="comma list, e.g. 32,64")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per run")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads per server")
    ap.add_argument("--seed", type=int, default=1234, help="request-stream seed")
    ap.add_argument("--skip-setup", action="store_true", help="don't run setup.sh first")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--plot", default=str(PLOT))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw --plot from the results in --out")
    return ap.parse_args(argv)


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s): {unknown}; known: {ALL_PEERS}")
    bootstrap(argv, peers, args.skip_setup or args.replot)
    if args.replot:
        saved = json.loads(Path(args.out).read_text())
        plot(saved["summary"], saved["meta"], Path(args.plot))
        print(f"wrote {args.plot}")
        return 0

    sys.path.insert(0, str(HERE))
    concs = [int(c) for c in args.concurrency.split(",")]
    repo_model = prepare_repository()
    cfg = __import__("common").model_config(repo_model)
    ctx = Ctx(repo=repo_model.parent, model_dir=repo_model,
              max_batch=int(cfg.get("max_batch_size", 32)),
              max_delay_ms=float(cfg.get("dynamic_batching", {}).get("max_queue_delay_ms", 5.0)),
              threads=args.threads,
              host_python=os.environ.get(HOST_PY_ENV) or shutil.which("python3") or "python3")
    ref = Reference(repo_model)
    items = check_items()
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "peers": peers, "concurrency": concs,
            "duration_s": args.duration, "warmup_s": args.warmup, "repeats": args.repeats,
            "threads": args.threads, "max_batch": ctx.max_batch,
            "max_delay_ms": ctx.max_delay_ms, "seed": args.seed, "vocab_size": VOCAB_SIZE,
            "lengths": [8, 128], "items_per_request": 1, "check_tolerance": CHECK_TOL,
            "versions": versions(), "tensorserve_command": tensorserve_command(ctx)}
    print(f"model: {repo_model} (max batch {ctx.max_batch}, delay {ctx.max_delay_ms} ms, "
          f"{ctx.threads} torch threads)", flush=True)

    load1 = os.getloadavg()[0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        print(f"warning: 1-min load average is {load1:.2f} on {os.cpu_count()} cores before "
              "starting; other work on this machine will skew the numbers", flush=True)
    meta["loadavg_start"] = os.getloadavg()
    rows: list[dict[str, Any]] = []
    t_start = time.time()
    for rep in range(args.repeats):
        for conc in concs:
            for name in peers:
                print(f"[rep {rep} c={conc}] {name}", flush=True)
                rows.extend(run_peer(PEERS[name], ctx, conc, rep, args, ref, items))
    summary = summarize(rows)
    meta["elapsed_s"] = time.time() - t_start
    meta["loadavg_end"] = os.getloadavg()

    print("\n" + HEADER)
    print("-" * len(HEADER))
    for s in summary:
        print(fmt_summary(s))
    print("items/s: successful items per second; mean bs: mean executed batch size in the "
          "window;\nmax|diff|: max abs difference vs the model run alone ('!' = check failed "
          f"or > {CHECK_TOL});\ncheck: a fixed request alone + a burst of 16 lengths, each vs the "
          "model alone;\nts x: tensorserve items/s / peer items/s (same concurrency)")
    for s in summary:
        if s.get("error_sample"):
            print(f"  {s['peer']} {s['variant']} c={s['concurrency']}: e.g. {s['error_sample']}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1,
                              default=str))
    print(f"\nwrote {out}")
    if not args.no_plot:
        plot(summary, meta, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
