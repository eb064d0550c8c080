"""The checks of benchmarks/gpu_check.py that need CUDA and look inside the
server's process: each one loads a model as the server does (the loader, or
``ServedModel``, the documented in-process API) and watches what a batch
does on the device.

    syncs_in_forward       host syncs while forward runs (set_sync_debug_mode)
    copies_per_batch       host<->device copies of one batch (torch.profiler):
                           one per input in, one per output out, all pinned; in a
                           model thread (ServedModel) and as a model worker runs
                           it (worker_copies_per_batch)
    event_waits_block      waiting for a batch sleeps the thread, not spins it
    batch_time_from_events a batch's reported time is the GPU's, even when
                           batches are launched ahead of each other
    BusyStream             a second stream that keeps the GPU busy (for the
                           output-parameter rounds)
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gpu_check_support import Check, ModelInfo, make_items, pad

if TYPE_CHECKING:
    from typing_extensions import Self

# How long the synthetic GPU work of the timing checks lasts.
WAIT_MS = 200.0
BATCH_MS = 40.0


def _padded_features(model: ModelInfo, count: int, device: torch.device, seed: int) -> dict[str, Any]:
    items = make_items(model, count, np.random.default_rng(seed))
    features: dict[str, Any] = {
        spec["name"]: torch.from_numpy(pad([i[spec["name"]] for i in items], spec.get("pad_value", 0)))
        .to(device) for spec in model.inputs}
    for name, value in model.request_parameters.items():
        features[name] = [value] * count  # as the executor hands a bool parameter to forward
    return features


SYNC_WARNING = "called a synchronizing CUDA operation"


def syncs_in_forward(repository: Path, models: Sequence[ModelInfo], device: torch.device) -> list[Check]:
    """Count the synchronising CUDA calls of one forward of 8 padded items
    (after a first, warm-up forward), with their source lines."""
    from tensorserve.repository.loader import discover, load_model, read_config
    from tensorserve.runtime.executor import on_device

    sources = discover(repository)
    checks = []
    for model in models:
        if model.platform == "onnxruntime_onnx" or model.name not in sources:
            continue
        try:
            source = sources[model.name]
            loaded = load_model(source, None, read_config(source, {"device": str(device)}))
            module = on_device(loaded.module, loaded.config, device)  # as a model thread does
            features = _padded_features(model, 8, device, seed=1)
            stream = torch.cuda.Stream(device)
            with torch.inference_mode(), torch.cuda.stream(stream):
                module(**features)
            torch.cuda.synchronize(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with torch.inference_mode(), torch.cuda.stream(stream):
                        module(**features)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(device)
            # Only the per-operation warning counts: turning the mode on also warns once
            # ("Synchronization debug mode is a prototype feature"), which is no sync.
            syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
            sites = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
            detail = f"{len(syncs)} host syncs in one forward" + (
                f" at {', '.join(sites[:6])}" if sites else "")
            checks.append(Check("syncs_in_forward", model.name, "thread", not syncs, detail))
        except Exception as exc:  # noqa: BLE001 - a model that cannot run is this check's failure
            checks.append(Check("syncs_in_forward", model.name, "thread", False, _reason(exc)))
    return checks


def copies_per_batch(served_repository: Path, models: Sequence[ModelInfo]) -> list[Check]:
    """Profile one batch of 8 items through ``ServedModel`` (the server's own
    path: collate, pinned staging, launch, collect) and count its copies."""
    from torch.profiler import ProfilerActivity, profile

    from tensorserve import ServedModel

    checks = []
    for model in models:
        if model.platform == "onnxruntime_onnx":
            continue
        try:
            items = make_items(model, 8, np.random.default_rng(2))
            parameters = model.request_parameters or None
            with ServedModel.from_repository(served_repository, model.name) as served:
                for _ in range(2):  # lazy initialisation and allocator growth stay out
                    served.infer_many_sync(items, timeout=120, parameters=parameters)
                before = served.stats.total_batches
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    results = served.infer_many_sync(items, timeout=120, parameters=parameters)
                torch.cuda.synchronize()
                batches = served.stats.total_batches - before
            # Kineto names a copy "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH
            # (Device -> Pageable)"...; device-to-device copies are not counted.
            names = [e.name.lower() for e in prof.events() if e.name.lower().startswith("memcpy")]
            to_device = [n for n in names if "htod" in n]
            to_host = [n for n in names if "dtoh" in n]
            pageable = [n for n in to_device + to_host if "pageable" in n]
            returned = len(getattr(results[0], "parameters", {}) or {})
            # Each request parameter's column reaches the device once too
            # (numbers: the executor; flags: the model, as embedder does).
            declared = len(model.config.get("request_parameter", []))
            want_in, want_out = len(model.inputs) + declared, len(model.outputs) + returned
            passed = (len(to_device) == want_in * batches and len(to_host) == want_out * batches
                      and not pageable)
            detail = (f"{batches} batch(es): {len(to_device)} host->device (want {want_in} per batch), "
                      f"{len(to_host)} device->host (want {want_out}), {len(pageable)} from pageable "
                      f"memory")
            checks.append(Check("copies_per_batch", model.name, "thread", passed, detail,
                                compared=batches))
        except Exception as exc:  # noqa: BLE001
            checks.append(Check("copies_per_batch", model.name, "thread", False, _reason(exc)))
    return checks


def worker_copies_per_batch(served_repository: Path, models: Sequence[ModelInfo],
                            device: torch.device) -> list[Check]:  # fmt: skip
    """The copies of one batch of 8 as a model worker (isolation = "process")
    runs it. A worker's copies cannot be profiled from the server's process,
    so its own batch function (``tensorserve.runtime.worker_main._run_batch``:
    the inputs staged in pinned memory, launched, collected, as each batch of
    its two in flight goes) runs here, on a thread of its own as in the worker,
    on a padded batch as it arrives from the server's socket (numpy arrays, in
    pageable memory), under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from tensorserve.repository.loader import discover, load_model, read_config
    from tensorserve.runtime import worker_main
    from tensorserve.runtime.executor import ThreadExecutor, on_device

    sources = discover(served_repository)
    checks = []
    for model in models:
        if model.platform == "onnxruntime_onnx" or model.name not in sources:
            continue
        found: dict[str, Any] = {}

        def run(model: ModelInfo = model, found: dict[str, Any] = found) -> None:
            try:
                source = sources[model.name]
                config = read_config(source, {"device": str(device)})
                module = on_device(load_model(source, None, config).module, config, device)
                executor = ThreadExecutor(module, config, device, name=model.name)
                executor.start_instance(0)  # its stream and inference mode, on this thread
                items = make_items(model, 8, np.random.default_rng(2))
                features = {spec["name"]: pad([i[spec["name"]] for i in items],
                                              spec.get("pad_value", 0)) for spec in model.inputs}
                parameters = {n: [v] * 8 for n, v in model.request_parameters.items()} or None
                for _ in range(2):  # lazy initialisation and allocator growth stay out
                    worker_main._run_batch(config, executor, features, parameters)
                torch.cuda.synchronize(device)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    found["reply"] = worker_main._run_batch(config, executor, features, parameters)
                torch.cuda.synchronize(device)
                found["names"] = [e.name.lower() for e in prof.events()
                                  if e.name.lower().startswith("memcpy")]  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported as this check's failure
                found["error"] = _reason(exc)

        thread = threading.Thread(target=run, name=f"worker-copies-{model.name}")
        thread.start()
        thread.join()
        if "error" in found:
            checks.append(Check("copies_per_batch", model.name, "process", False, found["error"]))
            continue
        header = found["reply"][0]
        if "error" in header:
            checks.append(Check("copies_per_batch", model.name, "process", False,
                                f"the batch failed: {header['error']}"[:300]))  # fmt: skip
            continue
        names = found["names"]
        to_device = [n for n in names if "htod" in n]
        to_host = [n for n in names if "dtoh" in n]
        pageable = [n for n in to_device + to_host if "pageable" in n]
        declared = len(model.config.get("request_parameter", []))
        returned = len(header.get("parameters") or {})
        want_in, want_out = len(model.inputs) + declared, len(model.outputs) + returned
        passed = len(to_device) == want_in and len(to_host) == want_out and not pageable
        detail = (f"as a worker runs a batch: {len(to_device)} host->device (want {want_in}), "
                  f"{len(to_host)} device->host (want {want_out}), {len(pageable)} from pageable "
                  f"memory")  # fmt: skip
        checks.append(Check("copies_per_batch", model.name, "process", passed, detail,
                            compared=len(to_device) + len(to_host)))  # fmt: skip
    return checks


def _sleep_cycles(device: torch.device, ms: float) -> tuple[int, float]:
    """Cycles of ``torch.cuda._sleep`` that last about ``ms`` on this GPU, and
    how long they lasted (CUDA events)."""
    torch.cuda.set_device(device)
    cycles = 1_000_000
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        took = start.elapsed_time(end)
        cycles = int(cycles * ms / max(took, 1e-3))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles, start.elapsed_time(end)


def _sleeping_model(device: torch.device, cycles: int, max_batch_size: int) -> Any:
    from tensorserve import ServedModel

    def forward(x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(cycles)  # GPU work of a known length on the instance's stream
        return x * 2

    return ServedModel.from_function(
        forward,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
        max_batch_size=max_batch_size, max_queue_delay_ms=1, device=str(device), isolation="thread",
    )


def event_waits_block(device: torch.device) -> Check:
    """One batch of ~200 ms of GPU work: the process's CPU time while its
    caller waits. A spinning wait burns a core for the whole batch."""
    try:
        cycles, gpu_ms = _sleep_cycles(device, WAIT_MS)
        item = {"x": np.arange(4, dtype=np.float32)}
        with _sleeping_model(device, cycles, 1) as served:
            served.infer_sync(item, timeout=60)
            cpu, wall = time.process_time(), time.perf_counter()
            served.infer_sync(item, timeout=60)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        share = cpu / wall
        return Check("event_waits_block", "-", "thread", share < 0.3,
                     f"CPU {1000 * cpu:.0f} ms over a {1000 * wall:.0f} ms wait for {gpu_ms:.0f} ms "
                     f"of GPU work ({100 * share:.0f}% of a core; a spinning event wait is ~100%)")
    except Exception as exc:  # noqa: BLE001
        return Check("event_waits_block", "-", "thread", False, _reason(exc))


def batch_time_from_events(device: torch.device) -> Check:
    """Batches of ~40 ms GPU work, 8 of them queued at once so that each is
    launched while the one before still runs: the reported batch time must
    be the batch's own GPU time, not the host time since its launch."""
    try:
        cycles, gpu_ms = _sleep_cycles(device, BATCH_MS)
        items = [{"x": np.full(4, i, dtype=np.float32)} for i in range(8)]
        with _sleeping_model(device, cycles, 1) as served:
            served.infer_many_sync(items[:2], timeout=60)
            served.stats.reset()
            served.infer_many_sync(items, timeout=60)
            reported = served.stats.snapshot(0)["avg_batch_duration_ms"]
        ratio = reported / gpu_ms
        return Check("batch_time_from_events", "-", "thread", 0.7 <= ratio <= 1.3,
                     f"reported {reported:.1f} ms per batch for {gpu_ms:.1f} ms of GPU work "
                     f"({ratio:.2f}x; host time since launch counts the batch queued ahead)")
    except Exception as exc:  # noqa: BLE001
        return Check("batch_time_from_events", "-", "thread", False, _reason(exc))


class BusyStream:
    """Matrix products on a stream of their own, back to back, until closed:
    the GPU is never idle, so a read that does not wait for its stream sees
    unfinished results."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-stream", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            a = torch.randn(4096, 4096, device=self.device)
            while not self._stop.is_set():
                for _ in range(8):
                    a = torch.tanh(a @ a)
                stream.synchronize()  # keep a bounded queue, not an unbounded one


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__
