#!/usr/bin/env python3
"""Check a GPU machine in one command (at most 5 minutes):

    python benchmarks/gpu_check.py [--device cuda:0|cpu] [--out PATH] [--repository PATH]

Against real ``tensorserve serve`` processes on a temporary copy of the
repository (every model on ``--device``, thread isolation, then process
isolation), and in-process where a check must look inside a batch:

    correctness             every model (and its .pt / .pt2 export, made here by
                            this machine's torch; an export that fails is a failed
                            check), and a BERT-base-size encoder written by
                            tensorserve_bench (full size on CUDA): one padded batch
                            of 64 random items against each item run alone on the
                            CPU (max abs error, within the tolerance of the dtype
                            the model computes in: tensorserve_bench/tolerance.py),
                            every output un-padded to its caller's shape
    many_callers            256 concurrent one-item HTTP callers (64 on a CPU) of
                            tagger, embedder and the encoder, each checking its own
                            rows against its item run alone on the CPU
    text_rows               strings in: the tokenizer's ids, and each ensemble
                            (text_tagger, text_embedder, text_bert_encoder) against
                            tokenizing then its model on the CPU, 32 texts at once
    output_parameters       200 rounds of the output parameters a model returns,
                            read back while a second stream keeps the GPU busy
    bad_input               an id past the vocabulary among good items: the good
                            ones are served, the server is ready again within seconds
    syncs_in_forward        (CUDA) host syncs inside forward, counted
    copies_per_batch        (CUDA) one host->device copy per input (and request
                            parameter), one device->host per output (and output
                            parameter), pinned (torch.profiler)
    event_waits_block       (CUDA) waiting for a batch sleeps, it does not spin
    batch_time_from_events  (CUDA) a batch's time is its GPU time (CUDA events)

and the load: items/s, p50/p99, GPU utilisation (NVML) and the server's CPU
per request for ``tagger`` and ``embedder`` at 1, 64 and 256 callers, the
model's max_batch_size 8, 32 and 128 (``--device cpu``: 1 and 64 callers,
8 and 32, shorter). It prints one table and writes one JSON object (default
benchmarks/results/gpu_check.json; ``--device cpu`` writes gpu_check_cpu.json,
so a committed GPU result is never overwritten), and writes it after each
phase too, marked ``"partial": true``: a run stopped by a time limit keeps
what it finished. Every check counts its comparisons (``compared``) and fails
at 0. Exit status 1 if any check failed. ``--device cpu`` runs every check that needs no CUDA in under two
minutes; CI runs it so.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tensorserve from this tree

from gpu_check_load import LoadPoint, run_point
from gpu_check_rows import many_callers, text_rows
from gpu_check_support import (
    ROOT,
    Check,
    CpuReference,
    ModelInfo,
    Server,
    discover_models,
    drift_hint,
    encode,
    export_variants,
    infer,
    make_items,
    max_abs_error,
    tolerance,
    write_repository,
)

CORRECTNESS_ITEMS = 64
PARAMETER_ROUNDS = 200
READY_WITHIN_S = 10.0
LOAD_MODELS = ("tagger", "embedder")
# (batch sizes, concurrencies, seconds measured, seconds of warm-up) per device kind.
LOAD_GRID = {"cuda": ((8, 32, 128), (1, 64, 256), 2.0, 0.5),
             "cpu": ((32,), (1, 64), 1.0, 0.3)}
CUDA_CHECKS = ("syncs_in_forward", "copies_per_batch", "event_waits_block", "batch_time_from_events")
# Concurrent one-item callers, each checking its own rows, per device kind; and for which models.
MANY_CALLERS = {"cuda": 256, "cpu": 64}
MANY_CALLER_MODELS = ("tagger", "embedder", "bert_encoder")
TOKENIZER_FILE = Path("tokenizer", "1", "tokenizer.json")  # in the checked repository
# The bench's BERT-base-size encoder (tensorserve_bench.encoder), written for the check:
# full size on CUDA (float16 there), 2 layers of d_model 64 on a CPU (seconds, not minutes).
ENCODER_LAYERS = {"cuda": (12, 768, 12), "cpu": (2, 64, 2)}


# ----------------------------------------------------------------- checks against a server
async def correctness(session: Any, server: Server, model: ModelInfo, isolation: str,
                      reference: CpuReference, rng: np.random.Generator, device: str) -> Check:
    items = make_items(model, CORRECTNESS_ITEMS, rng)
    reply = await infer(session, server.url, model.name, encode(items))
    if reply.status != 200:
        return Check("correctness", model.name, isolation, False, f"HTTP {reply.status}: {reply.error}")
    worst, scale, why = 0.0, 0.0, None
    for got, item in zip(reply.outputs, items, strict=True):
        error, magnitude, shape = max_abs_error(got, reference.expected(model, item))
        worst, scale, why = max(worst, error), max(scale, magnitude), why or shape
    bound = tolerance(model, device, scale)
    passed = why is None and worst <= bound
    detail = why or (f"max abs error {worst:.2e} (tolerance {bound:.1e}, "
                     f"{model.compute_dtype(device)}) over {len(reply.outputs)} items in one "
                     f"request, each un-padded to its own shape"
                     + ("" if passed else drift_hint(model, device, worst, scale)))
    return Check("correctness", model.name, isolation, passed, detail,
                 compared=0 if why else len(reply.outputs))


async def output_parameters(session: Any, server: Server, model: ModelInfo, isolation: str,
                            reference: CpuReference, rng: np.random.Generator, busy: bool,
                            device: str) -> Check:
    """Rounds of 8 items drawn from 32 whose parameters are known: every
    returned parameter equal to the CPU's, within float32 rounding."""
    pool = make_items(model, 32, rng)
    expected = [reference.expected(model, item) for item in pool]
    wrong, worst, compared = 0, 0.0, 0
    for _ in range(PARAMETER_ROUNDS):
        picked = rng.choice(len(pool), size=8, replace=False)
        reply = await infer(session, server.url, model.name, encode([pool[i] for i in picked]))
        if reply.status != 200:
            return Check("output_parameters", model.name, isolation, False,
                         f"HTTP {reply.status}: {reply.error}")
        for got, index in zip(reply.parameters, picked, strict=True):
            for name, want in expected[index].parameters.items():
                value = got.get(name)
                error = abs(float(value) - float(want)) if isinstance(value, (int, float)) else np.inf
                worst = max(worst, error)
                wrong += error > tolerance(model, device, abs(float(want)))
                compared += 1
    how = "while a second stream kept the GPU busy" if busy else "(no second stream on a CPU)"
    return Check("output_parameters", model.name, isolation, wrong == 0,
                 f"{wrong} wrong of {compared} parameters over {PARAMETER_ROUNDS} rounds {how}; "
                 f"max abs error {worst:.2e}", compared=compared)


async def bad_input(session: Any, server: Server, model: ModelInfo, isolation: str,
                    reference: CpuReference, rng: np.random.Generator, device: str) -> Check:
    """One request with an id past the vocabulary, sent with 8 one-item
    requests of good items (so they may share its batch); then readiness."""
    import aiohttp

    assert model.vocab_size is not None
    good = make_items(model, 9, rng)
    bad = dict(good.pop())
    ids_name = model.inputs[0]["name"]
    bad[ids_name] = bad[ids_name].copy()
    bad[ids_name][1] = model.vocab_size + 7
    replies = await asyncio.gather(
        infer(session, server.url, model.name, encode([bad])),
        *(infer(session, server.url, model.name, encode([item])) for item in good))
    bad_reply, good_replies = replies[0], replies[1:]
    problems = []
    compared = 0
    if bad_reply.status == 200:
        problems.append("the bad item was answered 200")
    for reply, item in zip(good_replies, good, strict=True):
        if reply.status != 200:
            problems.append(f"a good item got HTTP {reply.status}: {reply.error}")
            continue
        error, scale, shape = max_abs_error(reply.outputs[0], reference.expected(model, item))
        compared += shape is None
        if shape or error > tolerance(model, device, scale):
            problems.append(f"a good item's outputs are wrong ({shape or f'{error:.2e}'})")
    started = time.monotonic()
    while not (server.ready() and server.ready(model.name)):
        if time.monotonic() - started > READY_WITHIN_S:
            problems.append(f"not ready {READY_WITHIN_S:.0f} s later")
            break
        await asyncio.sleep(0.05)
    ready_s = time.monotonic() - started
    try:
        after = await infer(session, server.url, model.name, encode(good[:1]), timeout=30)
        if after.status != 200:
            problems.append(f"the next good request got HTTP {after.status}: {after.error}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        problems.append(f"the next good request failed: {type(exc).__name__}")
    detail = (f"bad item: HTTP {bad_reply.status} {bad_reply.error or ''}".strip()
              + f"; {len(good)} good items; ready after {ready_s:.2f} s")
    return Check("bad_input", model.name, isolation, not problems,
                 "; ".join(problems) + (" | " if problems else "") + detail, compared=compared)


def bad_input_model(models: Sequence[ModelInfo]) -> ModelInfo | None:
    """The model whose bad input is sent: ``tagger`` if served, else the
    first token model. One per server: on CUDA a device-side assert ruins
    the whole process's context, so a second model's verdict would be the
    first one's."""
    token_models = [m for m in models if m.vocab_size is not None and m.reference == m.name]
    return next((m for m in token_models if m.name == "tagger"), token_models[0] if token_models
                else None)


async def server_checks(server: Server, models: Sequence[ModelInfo], isolation: str,
                        reference: CpuReference, device: str, seed: int,
                        tokenizer_file: Path) -> list[Check]:
    import aiohttp

    rng = np.random.default_rng(seed)
    checks = []
    callers = MANY_CALLERS["cuda" if device.startswith("cuda") else "cpu"]
    tensor_models = [m for m in models if not is_text_model(m)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for model in tensor_models:
            checks.append(await _guarded(correctness(session, server, model, isolation, reference,
                                                     rng, device), "correctness", model, isolation))
        for model in (m for m in tensor_models if m.name in MANY_CALLER_MODELS):
            checks.append(await _guarded(many_callers(
                session, server, model, isolation, reference, rng, device, callers),
                "many_callers", model, isolation))
        for model in (m for m in models if is_text_model(m)):
            checks.append(await _guarded(text_rows(
                session, server, model, models, isolation, reference, tokenizer_file, rng, device),
                "text_rows", model, isolation))
        with_parameters = [m for m in models if m.config.get("request_parameter")]
        for model in with_parameters:
            busy: Any = None
            if device.startswith("cuda"):
                import torch
                from gpu_check_cuda import BusyStream

                busy = BusyStream(torch.device(device))
            with busy or _Nothing():
                checks.append(await _guarded(
                    output_parameters(session, server, model, isolation, reference, rng,
                                      busy is not None, device), "output_parameters", model,
                    isolation))
        target = bad_input_model(models)
        if target is not None:  # last: on CUDA it may leave this server broken
            checks.append(await _guarded(bad_input(session, server, target, isolation, reference,
                                                   rng, device), "bad_input", target, isolation))
    return checks


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def _guarded(check: Any, name: str, model: ModelInfo, isolation: str) -> Check:
    """A check that raised (a broken connection, a timeout) failed, saying why."""
    started = time.monotonic()
    try:
        result: Check = await check
    except Exception as exc:  # noqa: BLE001
        result = Check(name, model.name, isolation, False, f"{type(exc).__name__}: {exc}"[:300])
    result.seconds = time.monotonic() - started
    return result


# ----------------------------------------------------------------- the load
async def load_points(server: Server, models: Sequence[ModelInfo], batch_size: int,
                      concurrencies: Sequence[int], seconds: float, warmup: float,
                      gpu_index: int | None) -> list[LoadPoint]:
    import aiohttp

    rng = np.random.default_rng(batch_size)
    points = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for model in models:
            bodies = [encode([item]) for item in make_items(model, 256, rng)]
            for concurrency in concurrencies:
                points.append(await run_point(session, server, model.name, batch_size, bodies,
                                              concurrency, seconds, warmup, gpu_index))
    return points


# ----------------------------------------------------------------- the machine
def machine(device: str, commit: str | None) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {"device": "cpu: " + (platform.processor() or platform.machine()),
                             "driver": None, "cuda": torch.version.cuda, "torch": torch.__version__}
    if device.startswith("cuda"):
        facts["device"] = torch.cuda.get_device_name(torch.device(device))
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            facts["driver"] = driver.decode() if isinstance(driver, bytes) else driver
        except Exception:  # noqa: BLE001 - no NVML: ask nvidia-smi
            facts["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    facts["commit"] = commit or _run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]) or "unknown"
    facts["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return facts


def _run(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def unrunnable_onnx(models: Sequence[ModelInfo], device: str) -> tuple[list[ModelInfo], list[Check]]:
    """The ONNX models that cannot run on ``device`` here (no onnxruntime, or
    on CUDA no CUDA execution provider), each reported failed for both
    isolations: never passed, never silently run on the CPU."""
    onnx = [m for m in models if m.platform == "onnxruntime_onnx"]
    if not onnx:
        return [], []
    try:
        import onnxruntime

        providers, version = onnxruntime.get_available_providers(), onnxruntime.__version__
    except ImportError:
        providers, version = [], None
    if version is None:
        why = "onnxruntime is not installed (pip install 'tensorserve[onnx]')"
    elif device.startswith("cuda") and "CUDAExecutionProvider" not in providers:
        why = (f"ONNX Runtime {version} has no CUDAExecutionProvider (providers: "
               f"{', '.join(providers) or 'none'}): install onnxruntime-gpu; not run on {device}")
    else:
        return [], []
    return onnx, [Check("correctness", m.name, iso, False, why)
                  for m in onnx for iso in ("thread", "process")]


# ----------------------------------------------------------------- report
def table(result: dict[str, Any]) -> str:
    rows = [(f"{result['device']} | driver {result['driver']} | CUDA {result['cuda']} | "
             f"torch {result['torch']} | {result['commit'][:12]} | {result['date']}"), ""]
    rows.append(f"{'check':24} {'model':22} {'isolation':9} {'result':7} {'s':>5} detail")
    for check in result["checks"]:
        verdict = "pass" if check["passed"] else "FAIL"
        rows.append(f"{check['name']:24} {check['model']:22} {check['isolation']:9} {verdict:7} "
                    f"{check['seconds']:5.1f} {check['detail']}")
    for skipped in result["skipped"]:
        rows.append(f"{skipped['name']:24} {skipped['model']:22} {'-':9} {'skip':7} {'':5} "
                    f"{skipped['reason']}")
    rows += ["", (f"{'load':10} {'batch':>5} {'c':>4} {'items/s':>9} {'p50 ms':>8} "
                  f"{'p99 ms':>8} {'GPU %':>6} {'srv CPU us/req':>14} {'mean batch':>10} "
                  f"{'device items/s':>14}")]
    for p in result["load"]:
        util = "-" if p["gpu_util"] is None else f"{p['gpu_util']:.0f}"
        mean_batch = "-" if p.get("mean_batch") is None else f"{p['mean_batch']:.1f}"
        capacity = "-" if p.get("device_items_per_s") is None else f"{p['device_items_per_s']:.0f}"
        rows.append(f"{p['model']:10} {p['batch_size']:5} {p['concurrency']:4} {p['items_per_s']:9.0f} "
                    f"{p['p50_ms']:8.2f} {p['p99_ms']:8.2f} {util:>6} "
                    f"{p['server_cpu_us_per_request']:14.0f} {mean_batch:>10} {capacity:>14}")
    failed = sum(not c["passed"] for c in result["checks"])
    rows += ["", (f"{len(result['checks']) - failed} passed, {failed} failed, "
                  f"{len(result['skipped'])} skipped in {result['seconds']:.0f} s")]
    return "\n".join(rows)


def write_result(out: Path, result: dict[str, Any]) -> None:
    """The JSON object, replaced whole (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(out.name + ".tmp")
    scratch.write_text(json.dumps(result, indent=1) + "\n")
    scratch.replace(out)


# ----------------------------------------------------------------- main
def is_text_model(model: ModelInfo) -> bool:
    """An ensemble, or a model that takes strings: no random tensors for it."""
    return model.platform == "ensemble" or any(i["dtype"] == "bytes" for i in model.inputs)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="cuda:N or cpu (default: cuda:0 when CUDA is there, else cpu)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default: benchmarks/results/gpu_check.json, or "
                        "gpu_check_cpu.json with --device cpu)")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                        help="the model repository to check (default: model_repository)")
    parser.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse HEAD)")
    parser.add_argument("--no-load", action="store_true", help="skip the load part")
    args = parser.parse_args(argv)
    device = str(torch.device(args.device))
    if device == "cuda":
        device = "cuda:0"
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available here (use --device cpu)")
    out = args.out or ROOT / "benchmarks" / "results" / (
        "gpu_check.json" if kind == "cuda" else "gpu_check_cpu.json")
    started = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:  # seconds since the last phase ended, to see where time goes
        phases[name] = round(time.monotonic() - started - sum(phases.values()), 1)
        # What is known so far, on disk: a run stopped by its time limit (a lease, a
        # `timeout`) still leaves every phase it finished, marked "partial".
        write_result(out, {**result, "checks": [c.as_json() for c in checks],
                           "seconds": round(time.monotonic() - started, 1), "phases_s": phases,
                           "partial": True})
        print(f"[gpu_check] {name}: {phases[name]} s", file=sys.stderr, flush=True)

    result = {**machine(device, args.commit), "checks": [], "skipped": [], "load": []}
    checks: list[Check] = result["checks"]  # type: ignore[assignment]
    skipped: list[dict[str, str]] = result["skipped"]  # type: ignore[assignment]
    repository = args.repository.resolve()

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        work = Path(scratch)
        from tensorserve_bench.encoder import EncoderSize, write_encoder

        encoder_repository = work / "encoder"
        layers, d_model, heads = ENCODER_LAYERS[kind]
        # Its text ensemble runs the checked repository's own tokenizer (no copy), if any.
        write_encoder(encoder_repository, EncoderSize(layers, d_model, heads), seed=0,
                      text=(repository / TOKENIZER_FILE).is_file(), tokenizer_source=None)
        models = discover_models(repository) + discover_models(encoder_repository)
        phase("write the encoder")
        exports = export_variants(repository, [m for m in models if not is_text_model(m)],
                                  work / "exported", device)
        phase("export")
        skipped += [{"name": "export", "model": line.split(":")[0], "reason": line}
                    for line in exports.not_tried]
        checks += [Check("export", name, "-", False, why, compared=None)
                   for name, why in exports.failed]
        variants = exports.variants
        unrunnable, onnx_checks = unrunnable_onnx(models, device)
        checks += onnx_checks
        served = [m for m in [*models, *variants] if m not in unrunnable]
        reference = CpuReference(repository, encoder_repository)
        thread_repository = None
        for isolation in ("thread", "process"):
            # On a CPU the exported files are served in model threads only: the
            # process kind runs the same file loader, and a worker per model costs
            # a 2-core machine half a minute.
            models_here = [m for m in served if kind == "cuda" or isolation == "thread"
                           or m.reference == m.name]
            served_repository = write_repository(
                work / f"served_{isolation}", models_here,
                {"device": device, "isolation": isolation, "max_batch_size": CORRECTNESS_ITEMS},
                drop=["max_batch_tokens"],
                # The tokenizer runs where its config says (the host): strings, no tensors.
                per_model={"tokenizer": {"device": "cpu", "isolation": "thread"}})
            thread_repository = thread_repository or served_repository
            server = Server(served_repository, work / f"server_{isolation}.log")
            try:
                server.start()
                print(f"[gpu_check] {isolation} server ready in {server.ready_s:.1f} s",
                      file=sys.stderr, flush=True)
                # The same seed for both isolations: the same items, so the CPU's answers are reused.
                checks += asyncio.run(server_checks(server, models_here, isolation, reference,
                                                    device, 0, repository / TOKENIZER_FILE))
            except Exception as exc:  # noqa: BLE001 - a server that never started fails every check
                checks.append(Check("server_start", "*", isolation, False, str(exc)[-600:]))
            finally:
                server.stop()
            phase(f"server checks, {isolation}")

        if kind == "cuda":
            from gpu_check_cuda import (
                batch_time_from_events,
                copies_per_batch,
                event_waits_block,
                syncs_in_forward,
                worker_copies_per_batch,
            )

            assert thread_repository is not None
            torch_device = torch.device(device)
            tensor_models = [m for m in served if not is_text_model(m)]
            checks += syncs_in_forward(thread_repository, tensor_models, torch_device)
            checks += copies_per_batch(thread_repository, tensor_models)
            checks += worker_copies_per_batch(thread_repository, tensor_models, torch_device)
            checks += [event_waits_block(torch_device), batch_time_from_events(torch_device)]
            phase("in-process CUDA checks")
        else:
            skipped += [{"name": name, "model": "*", "reason": "skipped: needs CUDA"}
                        for name in CUDA_CHECKS]

        if not args.no_load:
            sizes, concurrencies, seconds, warmup = LOAD_GRID[kind]
            load_models = [m for m in served if m.name in LOAD_MODELS]
            gpu_index = torch.device(device).index if kind == "cuda" else None
            for size in sizes:
                load_repository = write_repository(
                    work / f"load_{size}", load_models, {"device": device, "max_batch_size": size},
                    drop=["max_batch_tokens"])
                server = Server(load_repository, work / f"load_{size}.log")
                try:
                    server.start()
                    points = asyncio.run(load_points(server, load_models, size, concurrencies,
                                                     seconds, warmup, gpu_index))
                    result["load"] += [p.as_json() for p in points]  # type: ignore[operator]
                except Exception as exc:  # noqa: BLE001
                    checks.append(Check("load", "*", f"bs={size}", False, str(exc)[-600:]))
                finally:
                    server.stop()
                phase(f"load, batch size {size}")

    result["checks"] = [c.as_json() for c in checks]
    result["seconds"] = round(time.monotonic() - started, 1)
    result["phases_s"] = phases
    result["partial"] = False
    print(table(result))
    write_result(out, result)
    print(f"\nwritten: {os.path.relpath(out)}")
    return 0 if all(c["passed"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
