"""Per-instance device handling: thread set-up, CUDA streams, copies.

Grad mode and inference mode are thread-local in torch, and so is the
OpenMP intra-op thread count: both are set on each instance thread itself, never
inherited from the thread that loaded the model (see docs/threading.md).

On CUDA each instance owns a stream; inputs travel from pinned host memory
with ``non_blocking=True`` and outputs come back into pinned host memory,
with one synchronisation per batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from tensorserve.errors import ConfigError
from tensorserve.host import available_cpus
from tensorserve.runtime.cuda_diagnosis import cuda_missing
from tensorserve.tensors.dtypes import Feature

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """The device a model runs on, always with an index on CUDA.

    ``auto`` means CUDA when present; asking for CUDA without one is a
    ``ConfigError`` that says why CUDA is missing (the model is FAILED). A
    bare ``cuda`` (``auto``, ``--device cuda``, ``TENSORSERVE_DEVICE=cuda``)
    becomes ``cuda:0``, the first GPU the process sees: ``torch.cuda.set_device``
    and NVML raise on a device without an index ("Expected a torch.device with
    a specified index"). Not ``torch.cuda.current_device()``: it would give
    this process a CUDA context even when every model runs in worker processes."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available: {cuda_missing()}")
    if device.index is None:
        return torch.device("cuda", 0)
    if device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
        )
    return device


# CUDA errors that leave the process's CUDA context unusable for good: every
# later kernel launch or copy fails with the same error, and nothing but a new
# process clears it (a device-side assert, say a token id past an embedding's
# size, or an illegal memory access). Matched on torch's message, which quotes
# cudaGetErrorString, because torch raises them as plain RuntimeErrors (or, since
# 2.8, torch.AcceleratorError, which also covers errors that are not sticky).
STICKY_CUDA_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "operation not supported on global/shared address space",
    "invalid program counter",
    "hardware stack error",
    "uncorrectable ECC error encountered",
)


def sticky_cuda_error(exc: BaseException) -> str | None:
    """The reason, when ``exc`` is a CUDA error that broke this process's
    CUDA context for good (None: any other error, which fails only its batch)."""
    if not isinstance(exc, RuntimeError):  # torch.AcceleratorError is one
        return None
    text = str(exc)
    if "CUDA error" not in text and not isinstance(exc, getattr(torch, "AcceleratorError", ())):
        return None
    if not any(sticky in text for sticky in STICKY_CUDA_ERRORS):
        return None
    return f"{type(exc).__name__}: {text.strip().splitlines()[0]}"


class ContextLoss:
    """Whether this process's CUDA context is lost (one per process: the CUDA
    context is). Set once by the executor that met a sticky CUDA error; read by
    every executor (a lost context fails every model on CUDA here), readiness
    and liveness, which fail so that the platform restarts the process: the
    only way to get a working context back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reason: str | None = None

    def lose(self, reason: str, model: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = f"model {model!r} met {reason}"
        log.error(
            "the CUDA context of this process is lost: %s; every model on CUDA in this process "
            "now fails, and readiness and liveness fail so that the platform restarts it "
            '(isolation = "process" confines such an error to one worker, which is replaced)',
            self.reason,
        )

    def describe(self) -> str | None:
        """Why nothing runs on CUDA in this process any more (None: it runs)."""
        if self.reason is None:
            return None
        return (
            f"the CUDA context of this server process is lost ({self.reason}); only a restart "
            f"recovers it, so readiness and liveness fail"
        )

    def clear(self) -> None:
        """For tests: a new process would start with a working context."""
        with self._lock:
            self.reason = None


CONTEXT_LOSS = ContextLoss()


class DeviceContext:
    """What one model instance (one thread) needs to run batches."""

    def __init__(self, device: torch.device, intra_op_threads: int | None = None) -> None:
        self.device = device
        self.intra_op_threads = intra_op_threads
        self.stream: torch.cuda.Stream | None = None
        self._entered = threading.local()  # .mode: the inference mode a thread holds for good

    def enter_thread(self) -> None:
        """Run once on each thread that runs the instance's batches, before its first."""
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        if self.device.type == "cuda":
            exact_float32()
            torch.cuda.set_device(self.device)  # indexed: resolve_device's
            if self.stream is None:  # one per instance, made once (its launch thread's)
                self.stream = torch.cuda.Stream(self.device)
        # Inference mode for the thread's life: per batch, on a thread that wakes
        # cold for each (its forward slept, or waited on the GPU), it cost ~35 us.
        self._entered.mode = mode = torch.inference_mode()  # per thread: gone with it
        mode.__enter__()

    def running(self) -> contextlib.ExitStack[bool | None]:
        """A batch's context, entered: inference mode (unless on for good) and the CUDA stream."""
        context = contextlib.ExitStack()
        if getattr(self._entered, "mode", None) is None:
            context.enter_context(torch.inference_mode())
        if self.stream is not None:
            context.enter_context(torch.cuda.stream(self.stream))
        return context

    def to_device(self, features: Mapping[str, Feature]) -> dict[str, Feature]:
        """Tensors onto the device; a bytes feature (a numpy object array) stays on the host."""
        if self.device.type == "cpu":
            return dict(features)
        return {
            name: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t
            for name, t in features.items()
        }

    def to_host(
        self, outputs: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Outputs on the host, and (on CUDA) the event that says the copies
        are done: the caller synchronises once per batch, when it needs them."""
        if self.device.type == "cpu":
            return {name: t.contiguous() for name, t in outputs.items()}, None
        host = {name: self._pinned_copy(t) for name, t in outputs.items()}
        return host, self.record()

    def columns_to_host(self, columns: Any) -> Any:
        """A batch's per-row output parameters (``WithParameters``), each device
        tensor queued for pinned host memory as the outputs are (before the
        batch's event), so reading them costs no blocking copy per parameter;
        anything else is left for ``output_parameters`` to judge."""
        if self.stream is None or not isinstance(columns, Mapping):
            return columns
        return {
            name: self._pinned_copy(v)
            if isinstance(v, torch.Tensor) and v.device.type != "cpu"
            else v
            for name, v in columns.items()
        }

    def _pinned_copy(self, t: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buffer.copy_(t, non_blocking=True)
        return buffer

    def record(self) -> torch.cuda.Event:
        """An event after everything queued so far on the instance's stream.
        ``blocking=True``: waiting on it sleeps the thread instead of spinning
        a core, which a GPU pod's CPU limit cannot spare. ``enable_timing=True``:
        a batch's time is ``started.elapsed_time(done)`` between two of these,
        and torch raises there unless both events were created timing."""
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        done.record(self.stream)
        return done


def pinned(features: Mapping[str, Feature]) -> dict[str, Feature]:
    """Host tensors copied into pinned memory, for a batch that arrived in
    pageable memory (a worker's socket buffer): ``to_device``'s non_blocking
    copy from pageable memory goes through CUDA's own staging buffer and
    returns only once it is done, so the host could not queue the next batch
    meanwhile. The buffers come from torch's caching host allocator, and may
    be dropped as soon as the batch is launched: the allocator records the
    stream of each non_blocking copy made from a buffer and hands the buffer
    out again only once that copy is done. Bytes features stay as they are."""
    staged: dict[str, Feature] = {}
    for name, t in features.items():
        if isinstance(t, torch.Tensor):
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buffer.copy_(t)
            t = buffer
        staged[name] = t
    return staged


def exact_float32() -> None:
    """Float32 math for float32 models on CUDA: torch leaves cuDNN's TF32 on
    by default (convolutions, RNNs), which rounds each product's operands to
    10 bits. On an H200 that put the GRU tagger's rows 2.1e-4 off its
    float32 forward on a CPU, twice float32's bound (gpu_check, 2026-11-28):
    a caller of a float32 model gets float32 results; a model that wants
    TF32's speed says so in its own code. Process-wide, like the flags."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def default_intra_op_threads() -> int:
    """Intra-op threads for each instance thread: every CPU this process may
    use (``host.available_cpus``: the container's cpuset and CPU quota) but one,
    left to the event loop. On 2 cores one forward thread plus a free core served
    1.4x the items/s of two intra-op threads fighting the HTTP stack for the
    cores (docs/threading.md). ``--intra-op-threads`` overrides it."""
    return max(1, available_cpus() - 1)
