#!/usr/bin/env python
"""Thread-layout benchmark for the tagger forward pass (see docs/threading.md).

Question: why was the same forward pass slower on a non-main thread, and which
thread layout / per-thread setup avoids it?

Suspects and how each is isolated:

  grad mode (thread-local)   model thread with / without inference_mode inside
                             it (the caller always holds inference_mode)
  OpenMP thread pools        libgomp gives every thread that runs a parallel
                             region its own pool.  When the process has more
                             libgomp threads than CPUs it stops spin-waiting at
                             barriers ("throttled": futex sleep instead).  We
                             toggle this *inside one process*: pools=one (only
                             the model thread's pool exists) vs pools=two (a
                             parked helper thread that once ran a parallel torch
                             op is alive) -- interleaved, so noise cancels.
  intra-op thread count      worker with torch.set_num_threads(1) ("w1") vs the
                             inherited default 2 ("w2")
  what the other thread does idle / asyncio-busy / py-busy / cpu-nogil (below)
  GIL switch interval        sys.setswitchinterval(0.1 ms) vs default 5 ms
  OMP_WAIT_POLICY, malloc    process-wide, so separate child processes, run
                             ABAB with the others (--rounds)
  thread identity            the same variants with the model on the main thread
                             (process "main") and the load in a 2nd thread
  thread creation            a fresh thread per forward ("fresh")

Loads (what the thread that does NOT run the model does meanwhile):
  idle          nothing: blocked waiting for the result
  asyncio-busy  an asyncio loop saturated with request work (json decode,
                python tokenisation, json encode; 4 coroutines, sleep(0)
                between requests) -- holds the GIL except for a moment inside
                select() on every loop iteration
  py-busy       the same request work in a loop that never yields (CPU-bound
                Python on the loop thread)
  cpu-nogil     hashlib over 1 MiB buffers: burns a core, releases the GIL
A load stops being busy after CAP_S (1 s) even if the forward is not done;
such samples are counted in the "capped" column (true latency is higher).

Primary metric: latency of one batch (32 items, lengths uniform 8..128, eval
mode) from submitting it to the model thread until the result exists ("fwd" =
the forward call alone, timed inside the model thread).  Variants are
interleaved round-robin in shuffled order; medians reported.  Per forward we
also record the whole process's voluntary context switches ("cswch") and minor
page faults ("faults") as mechanism evidence.

Usage:  python benchmarks/thread_layout.py [--rounds 2] [--reps 3] [--only worker,main]
Writes: benchmarks/results/thread_layout.json   (~2 min on 2 cores)
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import platform
import queue
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "thread_layout.json")


# --------------------------------------------------------------------------
# model + batch
# --------------------------------------------------------------------------
def make_model_and_batch():
    """Token tagger (eval mode) and one fixed batch of 32 items, lengths 8..128."""
    import torch
    from torch import nn

    warnings.filterwarnings("ignore", message=".*nested tensors.*")
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor.*")
    VOCAB, D, MAXLEN, LABELS, BATCH = 30000, 128, 128, 9, 32

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.pos = nn.Embedding(MAXLEN, D)  # learned positional embedding
            layer = nn.TransformerEncoderLayer(D, nhead=4, dim_feedforward=256, dropout=0.0,
                                               batch_first=True)
            self.enc = nn.TransformerEncoder(layer, num_layers=2)
            self.out = nn.Linear(D, LABELS)

        def forward(self, ids, mask):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.tok(ids) + self.pos(pos)[None]
            return self.out(self.enc(x, src_key_padding_mask=~mask))

    torch.manual_seed(0)
    model = Tagger().eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(8, MAXLEN + 1, (BATCH,), generator=g).tolist()
    L = max(lens)
    ids = torch.zeros(BATCH, L, dtype=torch.long)
    mask = torch.zeros(BATCH, L, dtype=torch.bool)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, :n] = True
    return model, ids, mask, lens


def V(runner, load, mode="inference_mode", pools="one", si=None):
    """runner: w2 | w1 | main | fresh;  pools: one | two (see module doc)."""
    bits = [f"{runner} pools={pools}" if runner in ("w2", "main") else runner, load,
            "grad on" if mode == "none" else "inference_mode"]
    if si:
        bits.append(f"switchinterval {si * 1e3:g}ms")
    return dict(name=" | ".join(bits), runner=runner, load=load, mode=mode,
                pools=pools if runner != "w1" else "one", si=si)


# One child process per entry; 'build': the thread that builds the model.
# w1 = the worker thread calls torch.set_num_threads(1); w2 = inherited default (2).
PROCS: dict[str, dict] = {
    "worker": dict(
        build="worker", env={},
        doc="model built + run on a persistent worker thread; main thread never runs torch",
        variants=[
            V("w2", "idle", pools="one"), V("w2", "idle", pools="two"),
            V("w2", "idle", "none", pools="two"),
            V("w1", "idle"), V("w1", "idle", "none"), V("fresh", "idle"),
            V("w2", "py-busy", pools="two"), V("w2", "py-busy", "none", pools="two"),
            V("w1", "py-busy"), V("w1", "py-busy", "none"), V("w1", "py-busy", si=0.0001),
            V("w2", "asyncio-busy", pools="one"), V("w2", "asyncio-busy", pools="two"),
            V("w2", "asyncio-busy", pools="two", si=0.0001),
            V("w1", "asyncio-busy"), V("w1", "asyncio-busy", "none"),
            V("w1", "asyncio-busy", si=0.0001),
            V("w2", "cpu-nogil", pools="two"), V("w1", "cpu-nogil"),
        ]),
    "main": dict(
        build="main", env={},
        doc="model built + run on the main thread; load runs in a 2nd thread",
        variants=[
            V("main", "idle", pools="one"), V("main", "idle", pools="two"),
            V("main", "idle", "none", pools="two"),
            V("main", "py-busy", pools="two"),
            V("main", "asyncio-busy", pools="one"), V("main", "asyncio-busy", pools="two"),
        ]),
    "worker PASSIVE": dict(
        build="worker", env={"OMP_WAIT_POLICY": "PASSIVE"},
        doc="as 'worker', OMP_WAIT_POLICY=PASSIVE (set before torch is imported)",
        variants=[V("w2", "idle"), V("w2", "py-busy"), V("w2", "asyncio-busy"),
                  V("w2", "cpu-nogil"), V("w1", "idle"), V("w1", "asyncio-busy")]),
    "worker mallopt": dict(
        build="worker", env={}, mallopt=True,
        doc="as 'worker', plus mallopt(M_TRIM_THRESHOLD=1G, M_MMAP_THRESHOLD=32M); "
            "w1 + switchinterval 0.1ms rows = the recommended set-up",
        variants=[V("w2", "idle", pools="two"), V("w1", "idle"), V("w1", "asyncio-busy"),
                  V("w1", "idle", si=0.0001), V("w1", "py-busy", si=0.0001),
                  V("w1", "asyncio-busy", si=0.0001), V("w1", "cpu-nogil", si=0.0001)]),
}
BASELINE = ("main", "main pools=one | idle | inference_mode")  # main thread, nothing else running
CAP_S = 1.0  # a load stops being busy after this long (forward then finishes unloaded)


# --------------------------------------------------------------------------
# child process
# --------------------------------------------------------------------------
def child(proc: str, reps: int, seed: int, deadline_s: float) -> dict:
    cfg = PROCS[proc]
    if cfg.get("mallopt"):
        libc = ctypes.CDLL("libc.so.6")
        # glibc: M_TRIM_THRESHOLD=-1, M_MMAP_THRESHOLD=-3.  Keep freed memory in
        # the heap instead of returning it to the OS after every forward.
        assert libc.mallopt(-1, 1 << 30) == 1 and libc.mallopt(-3, 1 << 25) == 1

    import torch

    default_threads = torch.get_num_threads()
    st: dict = {}

    def build() -> None:
        st["model"], st["ids"], st["mask"], st["lens"] = make_model_and_batch()
        with torch.inference_mode():
            st["model"](st["ids"], st["mask"])

    def timed_forward(mode: str) -> dict:
        ctx = torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
        with ctx:
            grad = torch.is_grad_enabled()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            st["model"](st["ids"], st["mask"])
            ms = (time.perf_counter() - t0) * 1e3
            r1 = resource.getrusage(resource.RUSAGE_SELF)
        return {"ms": ms, "grad": grad, "threads": torch.get_num_threads(),
                "vcsw": r1.ru_nvcsw - r0.ru_nvcsw, "minflt": r1.ru_minflt - r0.ru_minflt}

    class Runner:
        """One persistent thread executing submitted callables."""

        def __init__(self, name: str, init=None) -> None:
            self.q: queue.Queue = queue.Queue()
            ready = threading.Event()
            threading.Thread(target=self._run, args=(init, ready), name=name,
                             daemon=True).start()
            ready.wait()

        def _run(self, init, ready) -> None:
            if init:
                init()
            ready.set()
            while True:
                fn, done, box = self.q.get()
                box.append(fn())
                done()

        def submit(self, fn, done) -> list:
            box: list = []
            self.q.put((fn, done, box))
            return box

    def init_w1() -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():  # lazy per-thread init happens now, with 1
            st["model"](st["ids"], st["mask"])

    class ExtraPool:
        """A parked thread that ran one parallel torch op: its libgomp pool
        stays alive (and counted) until the thread exits."""

        def __init__(self) -> None:
            self.ev, ready = threading.Event(), threading.Event()

            def run() -> None:
                torch.set_num_threads(default_threads)
                torch.ones(1 << 22).add_(1)
                ready.set()
                self.ev.wait()

            self.t = threading.Thread(target=run, daemon=True)
            self.t.start()
            ready.wait()

        def close(self) -> None:
            self.ev.set()
            self.t.join()

    if cfg["build"] == "main":
        build()
        w2 = None
    else:
        w2 = Runner("model-worker", build)
    w1 = Runner("model-worker-1thread", init_w1)
    load_thread = Runner("loop-thread")

    # ---- loads ---------------------------------------------------------------
    payload = json.dumps({"inputs": [" ".join(f"tok{i}" for i in range(60)) for _ in range(4)]})
    vocab: dict[str, int] = {}

    def request_work() -> str:  # ~70 us of pure-Python request handling
        req = json.loads(payload)
        out = []
        for text in req["inputs"]:
            ids = [vocab.setdefault(w, len(vocab) % 30000) for w in text.split()]
            out.append({"ids": ids, "labels": [i % 9 for i in ids]})
        return json.dumps(out)

    buf = os.urandom(1 << 20)
    loops: dict[int, asyncio.AbstractEventLoop] = {}

    def run_load(kind: str, stop: threading.Event, on_start) -> tuple[int, bool]:
        """Run `kind` in this thread until `stop` is set or CAP_S has passed
        (so pathological variants cannot run for minutes).  Returns
        (work items done, whether the cap was hit)."""
        t_cap = time.perf_counter() + CAP_S
        busy = lambda: not stop.is_set() and time.perf_counter() < t_cap
        n = 0
        if kind == "idle":
            on_start()
            stop.wait()
        elif kind == "asyncio-busy":
            if threading.get_ident() not in loops:
                loops[threading.get_ident()] = asyncio.new_event_loop()
            loop = loops[threading.get_ident()]
            cnt = [0]

            async def client() -> None:
                while busy():
                    request_work()
                    cnt[0] += 1
                    await asyncio.sleep(0)

            async def amain() -> None:
                on_start()
                await asyncio.gather(*(client() for _ in range(4)))

            loop.run_until_complete(amain())
            n = cnt[0]
        elif kind == "py-busy":
            on_start()
            while busy():
                request_work()
                n += 1
        elif kind == "cpu-nogil":
            on_start()
            while busy():
                hashlib.sha256(buf).digest()
                n += 1
        else:
            raise ValueError(kind)
        return n, not stop.is_set()

    def fresh_thread(fn):
        out: list = []

        def run() -> None:
            torch.set_num_threads(default_threads)
            out.append(fn())

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out[0]

    def measure(v: dict) -> dict:
        fwd = lambda: timed_forward(v["mode"])
        extra = ExtraPool() if v["pools"] == "two" else None
        old = sys.getswitchinterval()
        if v["si"]:
            sys.setswitchinterval(v["si"])
        try:
            stop = threading.Event()
            if v["runner"] == "fresh":
                t0 = time.perf_counter()
                r = fresh_thread(fwd)
                return dict(r, e2e=(time.perf_counter() - t0) * 1e3, load_ops=0, capped=False)
            if v["runner"] in ("w1", "w2"):  # model in a worker, load on main thread
                runner = w1 if v["runner"] == "w1" else w2
                box: list = []

                def start() -> None:
                    t_sub.append(time.perf_counter())
                    with torch.inference_mode():  # caller side: does NOT reach the worker
                        box.append(runner.submit(
                            lambda: dict(fwd(), t_done=time.perf_counter()), stop.set))

                t_sub: list = []
                ops, capped = run_load(v["load"], stop, start)
                stop.wait()
                r = box[0][0]
                e2e = (r.pop("t_done") - t_sub[0]) * 1e3
                return dict(r, e2e=e2e, load_ops=ops, capped=capped)
            # model on the main thread, load in the 2nd thread
            if v["load"] == "idle":
                r = fwd()
                return dict(r, e2e=r["ms"], load_ops=0, capped=False)
            started, fin = threading.Event(), threading.Event()
            lb = load_thread.submit(lambda: run_load(v["load"], stop, started.set), fin.set)
            started.wait()
            r = fwd()
            stop.set()
            fin.wait()
            return dict(r, e2e=r["ms"], load_ops=lb[0][0], capped=lb[0][1])
        finally:
            sys.setswitchinterval(old)
            if extra:
                extra.close()

    variants = list(cfg["variants"])
    for v in variants:  # warm-up
        measure(v)
    rng = random.Random(seed)
    raw: dict[str, list] = {v["name"]: [] for v in variants}
    t_end = time.monotonic() + deadline_s
    for rep in range(reps):
        if rep >= 2 and time.monotonic() > t_end:
            break  # pathological variants can take seconds each; keep runtime bounded
        rng.shuffle(variants)
        for v in variants:
            raw[v["name"]].append(measure(v))
            time.sleep(0.002)
    return {"raw": raw, "torch": torch.__version__, "lens": st["lens"],
            "padded_len": int(st["ids"].shape[1]), "default_threads": default_threads}


# --------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------
def _stat():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def cpu_busy(seconds: float) -> float:
    """Fraction of all CPUs busy over `seconds` while this benchmark sleeps."""
    t0, i0 = _stat()
    time.sleep(seconds)
    t1, i1 = _stat()
    return round(1 - (i1 - i0) / max(1, t1 - t0), 2)


def thread_state_probe() -> dict:
    import torch
    probe = lambda: {"grad_enabled": torch.is_grad_enabled(),
                     "inference_mode": torch.is_inference_mode_enabled(),
                     "num_threads": torch.get_num_threads()}
    out: list = []
    with torch.inference_mode():
        main = probe()
        t = threading.Thread(target=lambda: out.append(probe()))
        t.start()
        t.join()
    return {"main_thread_inside_inference_mode": main,
            "thread_started_from_inside_it": out[0]}


def torch_calls_per_forward() -> dict:
    """Python->torch C calls one forward makes with / without grad mode.  Each
    is a point where the calling thread releases and must re-take the GIL."""
    import torch
    model, ids, mask, _ = make_model_and_batch()
    out = {}
    for name, ctx in (("grad on", torch.enable_grad), ("inference_mode", torch.inference_mode)):
        n = [0]

        def prof(frame, event, arg, n=n):
            if event == "c_call" and "torch" in f"{getattr(arg, '__module__', '')}{arg!r}":
                n[0] += 1

        with ctx():
            model(ids, mask)
            sys.setprofile(prof)
            model(ids, mask)
            sys.setprofile(None)
        out[name] = n[0]
    return out


def summarize(pooled: dict) -> list[dict]:
    from tensorserve.bench.percentiles import percentile

    base_ms = [r["e2e"] for r in pooled[BASELINE[0]][BASELINE[1]]]
    base, base_min = statistics.median(base_ms), min(base_ms)
    rows = []
    for proc, by_var in pooled.items():
        for name, rs in by_var.items():
            ms = sorted(r["e2e"] for r in rs)
            med = statistics.median(ms)
            v = next(x for x in PROCS[proc]["variants"] if x["name"] == name)
            rows.append(dict(
                process=proc, variant=name, median_ms=round(med, 1), min_ms=round(ms[0], 1),
                p25_ms=round(percentile(ms, 25), 1), p75_ms=round(percentile(ms, 75), 1),
                n=len(ms),
                ratio_vs_baseline=round(med / base, 2),
                min_ratio_vs_baseline=round(ms[0] / base_min, 2),
                forward_only_median_ms=round(statistics.median(r["ms"] for r in rs), 1),
                grad_enabled=rs[0]["grad"], num_threads=rs[0]["threads"],
                cswch_per_fwd=statistics.median(r["vcsw"] for r in rs),
                faults_per_fwd=statistics.median(r["minflt"] for r in rs),
                capped=sum(bool(r.get("capped")) for r in rs),
                load_ops_per_ms=(round(statistics.median(r["load_ops"] / r["e2e"] for r in rs), 1)
                                 if v["load"] != "idle" else None),
                samples_ms=[round(r["e2e"], 1) for r in rs],
            ))
    return rows


def print_table(rows: list[dict]) -> None:
    w = max(len(r["variant"]) for r in rows)
    print(f"\nlatency per batch of 32, submit -> result (ms); ratio = median / median, "
          f"minr = min / min, of '{BASELINE[1]}' (process '{BASELINE[0]}')")
    print(f"{'variant':<{w}} {'median':>7} {'min':>6} {'p75':>7} {'ratio':>6} {'minr':>5}"
          f" {'fwd':>6} {'grad':>4} {'thr':>3} {'cswch':>6} {'faults':>6} {'loadops/ms':>10}"
          f" {'capped':>6}")
    proc = None
    for r in rows:
        if r["process"] != proc:
            proc = r["process"]
            print(f"== process '{proc}': {PROCS[proc]['doc']}")
        lo = "" if r["load_ops_per_ms"] is None else f"{r['load_ops_per_ms']:.1f}"
        cap = f"{r['capped']}/{r['n']}" if r["capped"] else ""
        print(f"{r['variant']:<{w}} {r['median_ms']:7.1f} {r['min_ms']:6.1f} {r['p75_ms']:7.1f}"
              f" {r['ratio_vs_baseline']:5.2f}x {r['min_ratio_vs_baseline']:4.2f}x"
              f" {r['forward_only_median_ms']:6.1f} {str(r['grad_enabled'])[0]:>4}"
              f" {r['num_threads']:>3} {r['cswch_per_fwd']:>6.0f} {r['faults_per_fwd']:>6.0f}"
              f" {lo:>10} {cap:>6}")
    print(f"capped: the load stopped after CAP_S={CAP_S:.1f} s although the forward had not "
          "finished (true latency with a persistent load would be higher)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2, help="child processes per config (ABAB)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved reps per variant per child")
    ap.add_argument("--deadline", type=float, default=12.0,
                    help="per child: start no new rep after this many seconds (min 2 reps)")
    ap.add_argument("--only", default="", help="comma-separated process names")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        json.dump(child(args.child, args.reps, args.seed, args.deadline), sys.stdout)
        return

    names = [p for p in PROCS if not args.only or p in args.only.split(",")]
    if BASELINE[0] not in names:
        names.insert(0, BASELINE[0])
    t_start = time.monotonic()
    import torch
    probe = thread_state_probe()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch.get_num_threads()="
          f"{torch.get_num_threads()}, OpenMP backend: "
          f"{'OpenMP' in torch.__config__.parallel_info()}")
    print("thread started inside main's inference_mode sees:",
          probe["thread_started_from_inside_it"])
    calls = torch_calls_per_forward()
    print("Python->torch C calls per forward:", calls)

    pooled: dict[str, dict[str, list]] = {p: {} for p in names}
    busy: list[float] = []
    info: dict = {}
    for rnd in range(args.rounds):
        for p in names:
            busy.append(cpu_busy(0.3))
            env = dict(os.environ)
            env.pop("OMP_WAIT_POLICY", None)
            env.update(PROCS[p]["env"])
            t0 = time.monotonic()
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", p,
                                "--reps", str(args.reps), "--seed", str(rnd),
                                "--deadline", str(args.deadline)],
                               env=env, capture_output=True, text=True, check=False)
            if r.returncode:
                sys.exit(f"child {p!r} failed:\n{r.stderr[-3000:]}")
            res = json.loads(r.stdout)
            info = {k: res[k] for k in ("torch", "lens", "padded_len", "default_threads")}
            for k, v in res["raw"].items():
                pooled[p].setdefault(k, []).extend(v)
            print(f"  round {rnd + 1}/{args.rounds}  {p:<24} {time.monotonic() - t0:5.1f} s"
                  f"   (CPU busy from others just before: {busy[-1]:.0%})", flush=True)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".raw", "w") as f:  # in case summarizing fails
        json.dump(pooled, f)
    rows = summarize(pooled)
    print_table(rows)
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python benchmarks/thread_layout.py", *sys.argv[1:]]),
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch_num_threads_default": torch.get_num_threads(),
        "default_switchinterval_s": sys.getswitchinterval(),
        "cpu_busy_by_others_before_each_child": busy,
        "rounds": args.rounds, "reps_per_child": args.reps,
        "batch": {"items": 32, **info},
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    from tensorserve.bench.results import write_json

    write_json(args.out, {"meta": meta,
                          "processes": {p: {k: v for k, v in PROCS[p].items() if k != "variants"}
                                        for p in names},
                          "thread_state_probe": probe, "torch_calls_per_forward": calls,
                          "baseline": list(BASELINE),
                          "results": rows}, indent=1)
    os.remove(args.out + ".raw")
    print(f"\nwrote {os.path.relpath(args.out)}  ({meta['elapsed_s']} s)")


if __name__ == "__main__":
    main()
