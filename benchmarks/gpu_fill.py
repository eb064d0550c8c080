#!/usr/bin/env python3
"""How much of the GPU the server fills at its defaults, in one command:

    python benchmarks/gpu_fill.py [--device cuda:0|cpu] [--out PATH] [--budget-s S]

For tagger, embedder, text_tagger (the bundled models, configs as shipped)
and a BERT-base-size encoder (tensorserve_bench.encoder: 12 layers, d_model
768, seeded random weights, float16 on CUDA), each served by one
``tensorserve serve`` with no flags, as the image runs it:

    ceiling   the same model and weights in a tight in-process loop on the
              same device: the same lengths, sorted, in full batches of the
              model's max_batch_size; items/s by CUDA events (CPU: wall clock).
              text_tagger's is the tagger's forward over its texts' token ids
              (tokenising is CPU work the server overlaps with the GPU's).
    served    Triton's perf_analyzer over HTTP and over gRPC, one item a
              request, variable-length --input-data: lengths uniform 8..128
              for every model, and a long tail 8..512 (log-uniform) for the
              encoder; 256 and 1 concurrent callers first, then 64 and 1024
              while the time budget allows. Items/s, p50/p99, GPU busy
              (NVML), CPU per request of each process role (scheduler, front
              ends, model workers, and perf_analyzer itself), and at c=1 the
              busiest threads (and py-spy's busiest stacks where installed).
    fill      served / ceiling.

``--device cpu`` runs a small version (an encoder of 2 layers and d_model 64,
callers 16 and 1, short windows) in about a minute: CI runs it. It prints
one table and writes one JSON object with the machine's facts (device,
driver, CUDA, torch, commit, date): benchmarks/results/gpu_fill.json, or
gpu_fill_cpu.json with ``--device cpu``, rewritten after every point and
marked ``"partial": true`` until the end. On CUDA the issue's targets are
judged too (fill >= 0.85 for the encoder and >= 0.8 for the others at c=256,
the tagger's p50 at c=1 over HTTP <= 1.5 ms): reported, not the exit
status, which is 1 only when a point or a ceiling could not be measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tensorserve from this tree

from gpu_check import machine, write_result
from gpu_fill_ceiling import load_forward, measure
from gpu_fill_served import find_perf_analyzer, run_point
from tensorserve_bench.encoder import BERT_BASE, MODEL_NAME, EncoderSize, write_encoder
from tensorserve_bench.server import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "model_repository"
ENTRIES = 256  # distinct requests per --input-data file (and items of the ceiling)
UNIFORM = "uniform 8..128"
LONG_TAIL = "long tail 8..512"
TAGGER_VOCAB = 4096


@dataclass(frozen=True)
class Plan:
    """What one device kind runs."""

    first: tuple[int, ...]  # concurrencies every model gets
    then: tuple[int, ...]  # while the budget allows
    window_ms: int  # each of perf_analyzer's 3 windows
    ceiling_s: float
    budget_s: float  # the whole run: stop adding points past it
    encoder: EncoderSize


PLANS = {
    "cuda": Plan((256, 1), (64, 1024), 1500, 2.0, 450.0, BERT_BASE),
    "cpu": Plan((16, 1), (), 500, 0.6, 100.0, EncoderSize(layers=2, d_model=64, heads=2)),
}
# The targets (c=256, both protocols), judged on CUDA only.
FILL_TARGET = {MODEL_NAME: 0.85, "tagger": 0.8, "embedder": 0.8, "text_tagger": 0.8}
TAGGER_C1_P50_MS = 1.5


@dataclass(frozen=True)
class Workload:
    """One model fed one length distribution."""

    model: str
    lengths: str  # UNIFORM or LONG_TAIL
    ceiling_model: str  # whose forward the ceiling times
    ids: list[np.ndarray]  # the ceiling's items: token ids, one array each
    data: Path  # perf_analyzer's --input-data

    @property
    def key(self) -> str:
        return f"{self.model} ({self.lengths})"


# ----------------------------------------------------------------- inputs
def draw_lengths(kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == UNIFORM:
        return rng.integers(8, 128, size=ENTRIES, endpoint=True)
    # log-uniform: most requests short, a tail to the encoder's 512
    return np.clip(np.round(np.exp(rng.uniform(math.log(8), math.log(512), ENTRIES))), 8, 512
                   ).astype(np.int64)  # fmt: skip


def token_workload(model: str, kind: str, vocab: int, folder: Path, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, vocab, int(n)).astype(np.int64) for n in draw_lengths(kind, rng)]
    entries = [{"input_ids": {"content": i.tolist(), "shape": [len(i)]},
                "attention_mask": {"content": [1] * len(i), "shape": [len(i)]}} for i in ids]
    data = folder / f"{model}_{kind.split()[0]}.json"
    data.write_text(json.dumps({"data": entries}))
    return Workload(model, kind, model, ids, data)


def text_workload(model: str, ceiling_model: str, folder: Path, seed: int) -> Workload:
    """Texts of whole vocabulary words, n - 2 words for n tokens ([CLS] and
    [SEP] make the rest), n uniform 8..128; the ceiling gets their token ids."""
    from tokenizers import Tokenizer

    tokenizer_file = BUNDLED / "tokenizer" / "1" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_truncation(512)
    vocab = json.loads(tokenizer_file.read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if w.isalpha() and w.isascii() and len(w) > 1)
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(words, size=int(n) - 2)) for n in draw_lengths(UNIFORM, rng)]
    ids = [np.array(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts)]
    data = folder / f"{model}_uniform.json"
    data.write_text(json.dumps({"data": [{"TEXT": {"content": [t], "shape": [1]}} for t in texts]}))
    return Workload(model, UNIFORM, ceiling_model, ids, data)


MODELS = ("tagger", "embedder", "text_tagger", MODEL_NAME)
NEEDS = {"text_tagger": ("tokenizer", "tagger")}  # an ensemble's steps
# The tagger as shipped but eager (compile = "off"): at one caller beside the
# shipped one, it shows what the forward's kernel launches cost the CPU.
EAGER_TAGGER = "tagger_eager"


def build_repository(folder: Path, encoder: EncoderSize, models: Sequence[str]) -> Path:
    """``models`` (and what they need) as the image ships them, linked, not
    copied; the encoder written here with its weights."""
    repository = folder / "repository"
    repository.mkdir()
    wanted = dict.fromkeys(n for m in models for n in (m, *NEEDS.get(m, ())))
    for name in wanted:
        if name == MODEL_NAME:
            write_encoder(repository, encoder, seed=0, text=False)
        else:
            (repository / name).symlink_to(BUNDLED / name, target_is_directory=True)
    if "tagger" in wanted:  # the c=1 cause: the same tagger, its forward never captured
        eager = repository / EAGER_TAGGER
        eager.mkdir()
        (eager / "1").symlink_to(BUNDLED / "tagger" / "1", target_is_directory=True)
        config = (BUNDLED / "tagger" / "config.toml").read_text()
        (eager / "config.toml").write_text('compile = "off"\n' + config)  # top-level keys first
    return repository


def workloads(folder: Path, models: Sequence[str]) -> list[Workload]:
    made = {"tagger": lambda: [token_workload("tagger", UNIFORM, TAGGER_VOCAB, folder, 1)],
            "embedder": lambda: [token_workload("embedder", UNIFORM, TAGGER_VOCAB, folder, 2)],
            "text_tagger": lambda: [text_workload("text_tagger", "tagger", folder, 3)],
            MODEL_NAME: lambda: [token_workload(MODEL_NAME, UNIFORM, 30_522, folder, 4),
                                 token_workload(MODEL_NAME, LONG_TAIL, 30_522, folder, 5)]}
    return [w for m in models for w in made[m]()]  # fmt: skip


# ----------------------------------------------------------------- ceilings
def ceilings(repository: Path, work: Sequence[Workload], device: str, seconds: float
             ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each workload's ceiling, by key; a model's forward is loaded once."""
    import torch

    found: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(w.ceiling_model for w in work):
        try:
            loaded = load_forward(repository, name, device)
        except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
            for w in work:
                if w.ceiling_model == name:
                    found[w.key] = {"model": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        for w in (w for w in work if w.ceiling_model == name):
            try:
                found[w.key] = measure(loaded, w.ids, device, seconds, name).as_json()
            except Exception as exc:  # noqa: BLE001
                found[w.key] = {"model": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"[gpu_fill] ceiling {w.key}: {found[w.key].get('items_per_s', 'failed')}",
                  file=sys.stderr, flush=True)  # fmt: skip
        del loaded
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # the server comes next, on the same GPU
    return found


# ----------------------------------------------------------------- report
def model_notes(log: Path) -> list[str]:
    """What the server's log says about how each model runs on the device: the
    compile choice and its timings, graphs going off, a bucket left eager."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    wanted = ("compile =", "runs eager", "CUDA graph", "isolation", "frontends=")
    return [line[-400:] for line in lines if any(w in line for w in wanted)][:40]


def fill_rows(points: Sequence[dict[str, Any]], found: dict[str, dict[str, Any]]) -> None:
    for p in points:
        ceiling = found.get(p["workload"], {}).get("items_per_s")
        served = p.get("items_per_s")
        p["ceiling_items_per_s"] = ceiling
        p["fill"] = round(served / ceiling, 3) if served is not None and ceiling else None


def targets(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each met or not (None when not measured)."""
    judged = []
    for model, least in FILL_TARGET.items():
        for protocol in ("http", "grpc"):
            hit = [p for p in points if p["model"] == model and p["protocol"] == protocol
                   and p["concurrency"] == 256 and p["lengths"] == UNIFORM]  # fmt: skip
            fill = hit[0].get("fill") if hit else None
            judged.append({"target": f"{model} fill at c=256 over {protocol} >= {least}",
                           "value": fill, "met": None if fill is None else fill >= least})
    lone = [p for p in points if p["model"] == "tagger" and p["protocol"] == "http"
            and p["concurrency"] == 1]  # fmt: skip
    p50 = lone[0].get("p50_us") if lone else None
    judged.append({"target": f"tagger p50 at c=1 over http <= {TAGGER_C1_P50_MS} ms",
                   "value": None if p50 is None else p50 / 1000,
                   "met": None if p50 is None else p50 / 1000 <= TAGGER_C1_P50_MS})
    return judged


def table(result: dict[str, Any]) -> str:
    rows = [(f"{result['device']} | driver {result['driver']} | CUDA {result['cuda']} | "
             f"torch {result['torch']} | {result['commit'][:12]} | {result['date']}"), ""]
    rows.append(f"{'workload':32} {'proto':5} {'c':>5} {'items/s':>9} {'ceiling':>9} {'fill':>5} "
                f"{'p50 ms':>7} {'p99 ms':>7} {'GPU %':>5} | CPU us/req: {'sched':>6} "
                f"{'front':>6} {'worker':>6} {'pa':>6}")  # fmt: skip
    for p in result["points"]:
        head = f"{p['workload']:32} {p['protocol']:5} {p['concurrency']:>5}"
        if "error" in p:
            rows.append(f"{head} FAILED {p['error'][:120]}")
            continue
        cpu = p["cpu_us_per_request"]
        rows.append(
            f"{head} {p['items_per_s']:9.0f} {_num(p['ceiling_items_per_s'], 9, 0)} "
            f"{_num(p['fill'], 5, 2)} {_num(_ms(p['p50_us']), 7, 2)} {_num(_ms(p['p99_us']), 7, 2)} "
            f"{_num(p['gpu_util'], 5, 0)} | {'':11} {_num(cpu['scheduler'], 6, 0)} "
            f"{_num(cpu['frontend'], 6, 0)} {_num(cpu['workers'], 6, 0)} "
            f"{_num(cpu['perf_analyzer'], 6, 0)}")
    # How the server batched each point: the mean batch, the padding it kept (the
    # ceiling's length-sorted batches pad least), items a second of batch time.
    for p in result["points"]:
        b = p.get("batching")
        if b and p["concurrency"] > 1:
            rows.append(f"batches {p['workload']:24} {p['protocol']:5} {p['concurrency']:>5}: mean "
                        f"{_num(b['mean_batch'], 5, 1)}, padding efficiency "
                        f"{_num(b['padding_efficiency'], 5, 2)}, "
                        f"{_num(b['batch_items_per_s'], 9, 0)} items/s of batch time")  # fmt: skip
    # Where one caller's CPU goes (the c=1 burn): by thread, and py-spy's stacks.
    for p in result["points"]:
        for t in p.get("busiest_threads", [])[:3] if p["protocol"] == "http" else []:
            rows.append(f"c=1 {p['workload']:32} {t['role']:9} pid {t['pid']:<7} "
                        f"{t['thread']:16} {t['cpu_us_per_request']:8.0f} us/request")
    # The shipped tagger at one caller (its point, not py-spy's) beside it eager.
    shipped = next((p for p in result["points"] if p["model"] == "tagger"
                    and p["protocol"] == "http" and p["concurrency"] == 1), None)  # fmt: skip
    for p, what in ((shipped, "as shipped"), (result.get("c1_eager"), 'compile = "off"')):
        if p and "error" not in p:
            rows.append(f"c=1 tagger over http, {what:16} p50 {_num(_ms(p['p50_us']), 6, 2)} ms, "
                        f"CPU us/request: scheduler {p['cpu_us_per_request']['scheduler']:.0f}, "
                        f"workers {p['cpu_us_per_request']['workers']:.0f}")
    for stack in result.get("c1_profile", {}).get("pyspy_top", [])[:6]:
        count, _, frames = stack.partition(" ")
        rows.append(f"py-spy, tagger over http at c=1: {count} samples ..{frames[-150:]}")
    for key, c in result["ceilings"].items():
        if "error" in c:
            rows.append(f"ceiling {key}: FAILED {c['error']}")
    for t in result["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        rows.append(f"target: {t['target']}: {t['value']} ({verdict})")
    rows.append(f"{len(result['points'])} points in {result['seconds']:.0f} s")
    return "\n".join(rows)


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


# ----------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="cuda:N or cpu (default: cuda:0 when CUDA is there, else cpu)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: "
                        "benchmarks/results/gpu_fill.json, or gpu_fill_cpu.json on a CPU)")
    parser.add_argument("--server-log", type=Path, default=None,
                        help="keep the server's log there (default: a temporary file)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"a comma-separated subset of {','.join(MODELS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop adding points past this many seconds (cuda 450, cpu 100)")
    parser.add_argument("--isolation", choices=("thread", "process"), default=None,
                        help="run every model in this isolation (the server's --isolation; "
                             "default: each model's own, as shipped)")  # fmt: skip
    args = parser.parse_args(argv)
    device = str(torch.device(args.device))
    device = "cuda:0" if device == "cuda" else device
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available here (use --device cpu)")
    plan = PLANS[kind]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        parser.error(f"--models {args.models}: choose among {', '.join(MODELS)}")
    budget = args.budget_s or plan.budget_s
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_fill{'' if kind == 'cuda' else '_cpu'}.json"
    started = time.monotonic()
    result: dict[str, Any] = {
        **machine(device, args.commit),
        "command": " ".join(["python benchmarks/gpu_fill.py", *(argv or sys.argv[1:])]),
        "server": "python -m tensorserve serve --model-repository <the models as shipped, and "
                  "bert_encoder> (no other flag: the image's defaults)",
        "models": models,
        "isolation": args.isolation or "as shipped",
        "encoder": {"layers": plan.encoder.layers, "d_model": plan.encoder.d_model,
                    "heads": plan.encoder.heads, "parameters": plan.encoder.parameters},
        "perf_analyzer": {"windows": 3, "window_ms": plan.window_ms, "entries": ENTRIES,
                          "async_above": 16},
        "ceilings": {}, "points": [], "targets": [], "partial": True,
    }  # fmt: skip

    def save() -> None:
        result["seconds"] = round(time.monotonic() - started, 1)
        fill_rows(result["points"], result["ceilings"])
        result["targets"] = targets(result["points"]) if kind == "cuda" else []
        write_result(out, result)

    gpu_index = torch.device(device).index if kind == "cuda" else None
    # 1024 callers are 1024 sockets on each side: the server and perf_analyzer inherit this.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    with tempfile.TemporaryDirectory(prefix="gpu_fill_") as scratch:
        folder = Path(scratch)
        repository = build_repository(folder, plan.encoder, models)
        work = workloads(folder, models)
        result["workloads"] = {w.key: {"model": w.model, "lengths": w.lengths,
                                       "mean_tokens": round(float(np.mean([len(i) for i in w.ids])), 1),
                                       "ceiling_model": w.ceiling_model} for w in work}  # fmt: skip
        result["ceilings"] = ceilings(repository, work, device, plan.ceiling_s)
        save()
        # The server picks its device itself ("auto"): on a CPU it is shown no GPU,
        # on CUDA the measured one alone (at its defaults it would place every model on
        # every GPU it sees, and the ceiling is one GPU's).
        env = {"CUDA_VISIBLE_DEVICES": "" if kind == "cpu" else str(gpu_index)}
        if args.isolation:  # thread against process on this device (scripts/gpu_run.sh)
            env["TENSORSERVE_ISOLATION"] = args.isolation
        # The image's log level (the bench's servers log warnings only): the log then
        # says what compile = "auto" chose for each model, and why.
        server_log = Path(args.server_log or folder / "server.log")
        server = ServerProcess(str(repository), ["--log-level", "INFO"], env=env, log=server_log,
                               ready_timeout=300)  # fmt: skip
        try:
            pa = find_perf_analyzer()
            server.start()
            result["server_ready_s"] = round(server.ready_s or 0.0, 1)
            result["server_notes"] = model_notes(server_log)  # the choices made at load
            save()
            print(f"[gpu_fill] server ready in {server.ready_s:.1f} s", file=sys.stderr, flush=True)
            plans = [(c, w, protocol) for c in plan.first for w in work for protocol in ("http", "grpc")]
            later = [(c, w, protocol) for c in plan.then for w in work for protocol in ("http", "grpc")]
            spent: list[float] = []
            def measure_points(todo: list[tuple[int, Workload, str]]) -> None:
                for concurrency, w, protocol in todo:
                    # A point's time: a first guess, then the mean of those so far.
                    per_point = float(np.mean(spent)) if spent else 3 * plan.window_ms / 1000 + 2.0
                    if time.monotonic() - started + per_point > budget:
                        result["not_run"] = result.get("not_run", 0) + 1
                        continue
                    point = run_point(pa, server, w.model, protocol, concurrency, w.data,
                                      plan.window_ms, folder, gpu_index)  # fmt: skip
                    point["workload"], point["lengths"] = w.key, w.lengths
                    spent.append(point["seconds"])
                    result["points"].append(point)
                    print(f"[gpu_fill] {w.key} {protocol} c={concurrency}: "
                          f"{point.get('items_per_s', point.get('error'))}", file=sys.stderr, flush=True)
                    save()

            measure_points(plans)
            # One caller again, before the optional points (a short budget keeps these):
            # watched by py-spy (which pauses the server to sample native frames), where
            # a lone request's CPU goes; then the same tagger eager (compile = "off").
            lone = next((w for w in work if w.model == "tagger"), None)
            if lone is not None and time.monotonic() - started + 10 < budget:
                result["c1_profile"] = run_point(pa, server, lone.model, "http", 1, lone.data,
                                                 plan.window_ms, folder, gpu_index, 3.0)
                result["c1_profile"]["workload"] = lone.key
                save()
            if lone is not None and time.monotonic() - started + 8 < budget:
                result["c1_eager"] = run_point(pa, server, EAGER_TAGGER, "http", 1, lone.data,
                                               plan.window_ms, folder, gpu_index)  # fmt: skip
                result["c1_eager"]["workload"] = lone.key
                save()
            measure_points(later)
        except Exception as exc:  # noqa: BLE001 - what was measured is kept, the failure said
            result["error"] = f"{type(exc).__name__}: {exc}"[:800]
            result["server_log_tail"] = server.log_tail()
        finally:
            server.stop()
            result["server_notes"] = model_notes(server_log)
    result["partial"] = False
    save()
    print(table(result))
    print(f"\nwritten: {os.path.relpath(out)}")
    measured = {(p["workload"], p["protocol"], p["concurrency"]) for p in result["points"]
                if "error" not in p}  # fmt: skip
    required = {(w.key, p, c) for c in plan.first for w in work for p in ("http", "grpc")}
    failed = ("error" in result or any("error" in c for c in result["ceilings"].values())
              or any("error" in p for p in result["points"]) or not required <= measured)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
