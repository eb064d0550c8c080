"""Executors by kind: the one place that maps a model's ``isolation`` to
the executor that runs its batches.

    thread    instance threads in this process (``ThreadExecutor``; over several
              devices, ``PlacedExecutor``): a repository model loaded here, or
              a batch function handed to ``ServedModel.from_function``
    process   one worker process per instance (``ProcessExecutor``), which
              loads the repository model itself on its instance's device

A new kind (an ONNX Runtime session, a remote executor) is one builder
here and one entry in ``KINDS``; ``ServedModel`` asks for a kind by name
and never constructs an executor itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig
from tensorserve.repository.loader import ModelSource, load_model, resolve_version
from tensorserve.runtime.device import resolve_device
from tensorserve.runtime.executor import ThreadExecutor, on_device
from tensorserve.runtime.isolated import ProcessExecutor
from tensorserve.runtime.placement import PlacedExecutor, Placement


@dataclass(frozen=True)
class ExecutorRequest:
    """What a kind may need: the model's resolved config and placements, and
    either its repository ``source`` (and ``version``) or a loaded ``fn``."""

    name: str
    config: ModelConfig
    placements: Sequence[Placement]
    intra_op_threads: int
    source: ModelSource | None = None
    version: int | None = None
    fn: Callable[..., Any] | None = None


@dataclass(frozen=True)
class BuiltExecutor:
    executor: ThreadExecutor | ProcessExecutor  # PlacedExecutor: a ThreadExecutor
    version: int
    fn: Callable[..., Any] | None  # the model as it runs here (None: in its workers)


def _thread(request: ExecutorRequest) -> BuiltExecutor:
    fn, version, config = request.fn, request.version or 1, request.config
    if fn is None:
        assert request.source is not None
        loaded = load_model(request.source, request.version, config, request.intra_op_threads)
        fn, version = loaded.module, loaded.version
    if len(request.placements) > 1:
        placed = PlacedExecutor(
            fn, config, request.placements, request.intra_op_threads, name=request.name
        )
        return BuiltExecutor(placed, version, placed.fn)
    device = resolve_device(request.placements[0].device)
    fn = on_device(fn, config, device)
    executor = ThreadExecutor(
        fn, config, device,
        instance_count=config.instance_count, intra_op_threads=request.intra_op_threads,
        name=request.name,
    )  # fmt: skip
    return BuiltExecutor(executor, version, fn)


def _process(request: ExecutorRequest) -> BuiltExecutor:
    if request.source is None:
        raise ValueError(
            f"{request.name}: isolation = 'process' needs a repository model (its worker "
            f"process imports the model's model.py); use from_repository"
        )
    version = resolve_version(request.source, request.version)
    # Over several devices, each worker runs on its own instance's device.
    executor = ProcessExecutor(
        request.source,
        version,
        request.config,
        intra_op_threads=request.intra_op_threads,
        placements=request.placements,
    )
    executor.start()  # the workers load the model; a failure raises ConfigError
    return BuiltExecutor(executor, version, None)


KINDS: dict[str, Callable[[ExecutorRequest], BuiltExecutor]] = {
    "thread": _thread,
    "process": _process,
}


def build_executor(kind: str, request: ExecutorRequest) -> BuiltExecutor:
    """The executor of ``kind`` for the model (``ConfigError`` for a kind
    nobody registered)."""
    builder = KINDS.get(kind)
    if builder is None:
        raise ConfigError(
            f"{request.name}: no executor of kind {kind!r}; known: {', '.join(KINDS)}"
        )
    return builder(request)
