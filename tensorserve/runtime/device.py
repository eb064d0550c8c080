"""Per-model-thread device handling: thread set-up, CUDA streams, copies.

Grad mode and inference mode are thread-local in torch, and so is the
OpenMP intra-op thread count: both are set on the model thread itself, never
inherited from the thread that loaded the model (see docs/threading.md).

On CUDA each instance owns a stream; inputs travel from pinned host memory
with ``non_blocking=True`` and outputs come back into pinned host memory,
with one synchronisation per batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from tensorserve.errors import ConfigError
from tensorserve.runtime.cpus import available_cpus
from tensorserve.runtime.cuda_diagnosis import cuda_missing


def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when present; asking for CUDA without one is a
    ``ConfigError`` that says why CUDA is missing (the model is FAILED)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available: {cuda_missing()}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) exist"
            )
    return device


class DeviceContext:
    """What one model instance (one thread) needs to run batches."""

    def __init__(self, device: torch.device, intra_op_threads: int | None = None) -> None:
        self.device = device
        self.intra_op_threads = intra_op_threads
        self.stream: torch.cuda.Stream | None = None

    def enter_thread(self) -> None:
        """Run once on each thread that runs the instance's batches, before its first."""
        if self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.stream is None:  # the instance's model and forward threads share it
                self.stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with torch.inference_mode(), stream_ctx:
            yield

    def to_device(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return dict(features)
        return {name: t.to(self.device, non_blocking=True) for name, t in features.items()}

    def to_host(
        self, outputs: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """Outputs on the host, and (on CUDA) the event that says the copies
        are done: the caller synchronises once per batch, when it needs them."""
        if self.device.type == "cpu":
            return {name: t.contiguous() for name, t in outputs.items()}, None
        host = {}
        for name, t in outputs.items():
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buffer.copy_(t, non_blocking=True)
            host[name] = buffer
        done = torch.cuda.Event()
        done.record(self.stream)
        return host, done


def default_intra_op_threads() -> int:
    """Intra-op threads for each model thread: every CPU this process may use
    but one, which is left to the event loop and the pipeline threads. On this
    project's 2-core machines one model thread plus a free core served 1.4x
    the items/s of two model threads fighting the HTTP stack for the cores
    (docs/threading.md). The CPUs are counted as a container sees them: its
    cpuset and its cgroup CPU quota (``runtime.cpus.available_cpus``), not
    the node's cores. The server's ``--intra-op-threads`` /
    ``TENSORSERVE_INTRA_OP_THREADS`` (``Settings``) overrides it."""
    return max(1, available_cpus() - 1)
