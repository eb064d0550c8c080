"""Runs padded batches of a torch callable on its device, on each instance's thread.

``ThreadExecutor`` runs the batches of a model in this process (``isolation =
"thread"``, through ``batching/instances.py``) and of a worker process
(``isolation = "process"``). It sees padded tensors only; padding and
un-padding are ``batching.collate``'s:

    launch   one non_blocking host->device copy per feature, forward under
             inference_mode, outputs cast to their declared dtype and copied
             back to pinned host memory once per batch (queued on CUDA)
    collect  one synchronisation per batch; host arrays

A batch function returns one tensor (a single output), a dict of output name
-> tensor (a ``ragged`` output: a list of one tensor per row, runtime/ragged.py),
or a list with one entry per item, an Exception failing that item alone; any
of these may be wrapped in ``tensorserve.WithParameters`` with per-row output
parameters. Bytes never go through torch: a bytes feature is a numpy object
array of ``bytes`` (``[batch, *item_shape]``), a bytes output such an array or
nested lists of ``bytes`` / ``str``. Each declared request parameter is one
more keyword argument, one value per row: a 1-D int64 / float32 tensor on the
device, or a list (bool, string); a model that declares none gets the
features only.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorserve.errors import BatchOutOfMemory, DeviceLost, ModelFailure
from tensorserve.repository.config import TORCH_COMPILE_MODES, ModelConfig, OutputSpec
from tensorserve.runtime.device import CONTEXT_LOSS, DeviceContext, sticky_cuda_error
from tensorserve.runtime.graphs import CudaGraphs, GraphedForward, empty_cache, graph_switch
from tensorserve.runtime.ragged import join_rows, split_rows
from tensorserve.tensors.bytes_tensor import bytes_output
from tensorserve.tensors.dtypes import Feature, host_array
from tensorserve.tensors.results import WithParameters


def on_device(
    fn: Callable[..., Any], config: ModelConfig, device: torch.device
) -> Callable[..., Any]:
    """The model moved to its device and, if the config asks, ``torch.compile``d
    (compiled lazily per shape: the warm-up grid pays for it before ready).
    ``compile = "auto"`` and ``"reduce-overhead"`` are the executor's own
    bucketed CUDA graphs (``runtime/graphs.py``), made per instance."""
    if hasattr(fn, "to"):
        fn = fn.to(device)
    if config.compile in TORCH_COMPILE_MODES:
        fn = torch.compile(fn, mode=None if config.compile == "default" else config.compile)
    return fn


@dataclass
class Executed:
    """A batch's outputs on the host (``batching.executor.BatchOutputs``)."""

    batched: dict[str, Any] | None  # one array per output, batch first (ragged: a list)
    per_item: list[Any] | None  # or: each item's host arrays, or its Exception
    seconds: float | None = None  # the model's own time, when known better
    parameters: dict[str, list[Any]] | None = None  # per-row output parameters
    captured: bool = False  # it captured a CUDA graph: its seconds are no batch's cost


@dataclass
class Launched:
    """A batch queued on the device (on a CPU: already run).

    Nothing of it may be read on the host before ``done`` (on CUDA): the
    outputs, the per-item results and the output parameters are all written
    by the instance's stream, which the host and the default stream do not
    wait for."""

    host: dict[str, Feature] | None  # batched outputs, ragged rows (pinned, filling on CUDA)
    done: torch.cuda.Event | None  # recorded after the last of the batch's work (CUDA)
    per_item: list[Any] | None
    parameters: Mapping[str, Any] | None = None  # as the model returned them
    started: torch.cuda.Event | None = None  # recorded before the forward (CUDA)
    seconds: float | None = None  # the forward's time, where launch ran it (a CPU)
    captured: bool = False  # the forward captured its bucket's CUDA graph first


class ThreadExecutor:
    def __init__(
        self,
        fn: Callable[..., Any],
        config: ModelConfig,
        device: torch.device,
        *,
        instance_count: int = 1,
        intra_op_threads: int | None = None,
        name: str = "model",
    ) -> None:
        self.fn = fn
        self.models = [fn] * instance_count  # each instance's (PlacedExecutor: its device's copy)
        self.instance_count = instance_count
        self.outputs = config.output
        # Numeric outputs go through torch to the host; bytes outputs never do.
        batched = [spec for spec in config.output if not spec.ragged]
        self._tensor_outputs = [spec for spec in batched if not spec.dt.is_bytes]
        self._bytes_outputs = [spec for spec in batched if spec.dt.is_bytes]
        self._ragged = [spec for spec in config.output if spec.ragged]
        self._rows_from = next((s.name for s in config.input if not s.allow_ragged_batch), None)
        self.parameter_specs = {spec.name: spec for spec in config.request_parameter}
        self._contexts = [DeviceContext(device, intra_op_threads) for _ in range(instance_count)]
        # On CUDA, launch returns once the work is queued: the scheduler pads and
        # hands over the next full batch while this one runs.
        self.overlaps = self.pin_memory = device.type == "cuda"
        self.restarts = 0  # a thread is never replaced
        self.restart_seconds: float | None = None
        self.label = name  # for messages
        # Bucketed CUDA graphs (None: eager): one switch for the model, and
        # each instance's own graphs, made on its thread (start_instance).
        self._graphs = graph_switch(config, device, name)
        self._forwards: dict[int, Callable[..., Any]] = {}

    def abort(self, launched: Launched, because: str) -> bool:
        return False  # a forward in a thread of this process cannot be stopped

    def repair(self, instance: int) -> None:
        """Nothing to restore: the instance lives in this process."""

    def health(self) -> str | None:
        """A lost CUDA context (``device.CONTEXT_LOSS``) is the one thing that
        stops a thread executor for good."""
        return CONTEXT_LOSS.describe()

    def devices(self) -> list[torch.device]:
        """Each instance's device, in the batcher's instance order."""
        return [context.device for context in self._contexts]

    def free_memory_bytes(self) -> int | None:
        """The least any instance's device has (None: a CPU among them),
        less its graphs' pools: batches form under one ceiling."""
        held: dict[torch.device, int] = dict.fromkeys(self.devices(), 0)
        for instance, forward in self._forwards.items():
            if isinstance(forward, GraphedForward):
                held[self._contexts[instance].device] += forward.reserved_bytes
        known = [free_device_bytes(device, graphs) for device, graphs in held.items()]
        return None if None in known else min(b for b in known if b is not None)

    def start_instance(self, instance: int) -> None:
        context = self._contexts[instance]
        context.enter_thread()
        stream = context.stream
        if self._graphs is None or stream is None:
            return  # eager: the model itself
        forward = GraphedForward(
            self.models[instance], self._graphs, CudaGraphs(stream), context.device
        )
        try:
            with context.running():  # compile = "auto": timed once, on this instance's stream
                self._graphs.decide(lambda: forward.time_eager(stream))
        except Exception as exc:
            self._raise_if_sticky(exc)  # the timing lost the context: DeviceLost
            raise
        self._forwards[instance] = forward

    def launch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None = None,
    ) -> Launched:
        """Queue the batch on the device (on a CPU this runs it to the end).
        Out of memory: the caches are freed, then ``BatchOutOfMemory`` (the
        batcher splits the batch and lowers its ceiling). A sticky CUDA
        error: ``DeviceLost``, now and for every later batch."""
        if CONTEXT_LOSS.reason is not None:
            raise DeviceLost(f"model {self.label!r}: {CONTEXT_LOSS.describe()}")
        try:
            return self._launch(features, instance, parameters)
        except Exception as exc:
            self._raise_if_sticky(exc)
            if not is_out_of_memory(exc):
                raise
            reason = f"{type(exc).__name__}: {exc}"
        # Outside the handler: the exception's frames (and the tensors they
        # hold) are gone before the garbage, then the CUDA cache, are freed.
        # The young generations only: the failed forward's cycles are recent,
        # and a full collection holds the GIL for the whole process's heap
        # (it stalled the scheduler's loop 116-132 ms in every out-of-memory
        # cell of benchmarks/fault_matrix.py); the next automatic full
        # collection finds anything older.
        gc.collect(1)
        if self._contexts[instance].device.type == "cuda":
            empty_cache()  # never while another instance captures a graph
        raise BatchOutOfMemory(reason)

    def _launch(
        self,
        features: dict[str, Feature],
        instance: int,
        parameters: Mapping[str, list[Any]] | None,
    ) -> Launched:
        context = self._contexts[instance]
        on_cuda = context.stream is not None
        with context.running():
            # The batch's time is the device's: CUDA events on the instance's
            # stream (a batch launched ahead waits behind the previous one,
            # which a host clock from launch to collect would count as its own).
            started = context.record() if on_cuda else None
            clock = time.perf_counter()
            arguments = context.to_device(features)
            if parameters:  # a model that declares none gets exactly its features
                arguments.update(self._parameter_arguments(parameters, context))
            forward = self._forwards.get(instance, self.models[instance])
            result = forward(**arguments)
            captured = isinstance(forward, GraphedForward) and forward.captured
            returned = None
            if isinstance(result, WithParameters):
                result, returned = result.outputs, context.columns_to_host(result.parameters)
            if isinstance(result, (list, tuple)):
                done = context.record() if on_cuda else None
                seconds = None if on_cuda else time.perf_counter() - clock
                return Launched(None, done, list(result), returned, started, seconds, captured)
            named = named_outputs(result, self.outputs)
            # A padded feature's first axis is the batch's rows; a packed one has no
            # batch axis (with only packed inputs, un-packing counts a ragged output's rows).
            size = features[self._rows_from].shape[0] if self._rows_from is not None else None
            rows, string_rows = split_rows(named, self._ragged, size)
            cast = {
                s.name: _as_dtype(named[s.name], s.dt.torch_dtype) for s in self._tensor_outputs
            }
            tensors, done = context.to_host({**cast, **rows})  # rows behind the same event
            host: dict[str, Feature] = {**tensors, **string_rows}
            for spec in self._bytes_outputs:
                host[spec.name] = bytes_output(named[spec.name], spec.name)
        seconds = None if on_cuda else time.perf_counter() - clock
        return Launched(host, done, None, returned, started, seconds, captured)

    def _raise_if_sticky(self, exc: BaseException) -> None:
        """A sticky CUDA error lost this process's CUDA context: say so once
        (readiness and liveness fail from now on) and fail the batch with
        ``DeviceLost``, which is never split and retried here: every retry
        would fail the same way. In a worker process the worker exits instead
        (worker_main.py) and its replacement has a fresh context."""
        reason = sticky_cuda_error(exc)
        if reason is None:
            return
        CONTEXT_LOSS.lose(reason, self.label)
        raise DeviceLost(f"model {self.label!r}: {CONTEXT_LOSS.describe()}") from exc

    def _parameter_arguments(
        self, columns: Mapping[str, list[Any]], context: DeviceContext
    ) -> dict[str, Any]:
        """Each declared parameter as forward gets it: numbers as one 1-D
        tensor on the device, booleans and strings as the list."""
        arguments: dict[str, Any] = {}
        for name, values in columns.items():
            spec = self.parameter_specs[name]
            if spec.numeric:
                dtype = torch.int64 if spec.type == "int" else torch.float32
                # Pinned on CUDA: the copy to the device is queued, not made
                # through a pageable staging buffer.
                pinned = context.stream is not None
                arguments[name] = torch.tensor(values, dtype=dtype, pin_memory=pinned)
            else:
                arguments[name] = list(values)
        return context.to_device(arguments)  # the lists stay as they are

    def collect(self, launched: Launched) -> Executed:
        """Wait for the device (one synchronisation per batch); host arrays.
        Everything the batch produced is read only after its ``done`` event:
        output parameters and per-item results too, which a read on another
        stream (``.tolist()``, ``.cpu()``) would otherwise take stale."""
        try:
            seconds = launched.seconds
            if launched.done is not None:
                launched.done.synchronize()
                if launched.started is not None:
                    seconds = launched.started.elapsed_time(launched.done) / 1000.0
            returned = launched.parameters
            parameters = None if returned is None else output_parameters(returned)
            if launched.per_item is not None:
                items = [self._item_result(entry) for entry in launched.per_item]
                return Executed(None, items, seconds, parameters, launched.captured)
        except Exception as exc:
            self._raise_if_sticky(exc)  # an asynchronous CUDA error surfaces here
            raise
        assert launched.host is not None
        host = {name: host_array(t) for name, t in launched.host.items()}
        batched = join_rows(host, [s.name for s in self._ragged])
        return Executed(batched, None, seconds, parameters, launched.captured)

    def _item_result(self, entry: Any) -> Any:
        """One entry of a per-item result list, as host arrays (or the item's Exception)."""
        if isinstance(entry, BaseException):
            return entry  # fails this item alone
        named = named_outputs(entry, self.outputs)
        return {  # an item's own row of a ragged output too: it is one row
            spec.name: bytes_output(named[spec.name], spec.name)
            if spec.dt.is_bytes
            else host_array(
                torch.as_tensor(named[spec.name]).detach().cpu().to(spec.dt.torch_dtype)
            )
            for spec in self.outputs
        }

    def close(self) -> None:
        """Nothing to release: the instances' threads are the scheduler's."""


def output_parameters(returned: Mapping[str, Any]) -> dict[str, list[Any]]:
    """A forward's per-row output parameters as plain lists of JSON scalars
    (they go into msgpack and JSON as they are), or a sentence saying why not.
    The batcher checks there is one value per row."""
    if not isinstance(returned, Mapping):
        raise ModelFailure(
            f"WithParameters.parameters must map a name to one value per row, got "
            f"{type(returned).__name__}"
        )
    columns: dict[str, list[Any]] = {}
    for name, values in returned.items():
        if not isinstance(name, str):
            raise ModelFailure(f"output parameter names must be strings, got {name!r:.40}")
        if isinstance(values, (torch.Tensor, np.ndarray)):
            values = values.tolist() if values.ndim == 1 else values
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise ModelFailure(
                f"output parameter {name!r} must be one value per row (a list or a 1-D "
                f"tensor), got {type(values).__name__}"
            )
        for row, value in enumerate(values):
            if not _scalar(value):
                raise ModelFailure(
                    f"output parameter {name!r}, row {row}: {value!r:.40} is not a boolean, an "
                    f"integer, a finite number or a string"
                )
        columns[name] = list(values)
    return columns


def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)  # JSON has no NaN or infinity
    return isinstance(value, (bool, int, str))


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's CUDA (and MPS) out-of-memory error, or the CPU allocator's."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def free_device_bytes(device: torch.device, graphs: int = 0) -> int | None:
    """Memory a batch could still use on ``device``: free, plus what torch's
    caching allocator holds unused, less the ``graphs`` bytes its CUDA graphs'
    pools reserve, whose free blocks no batch can use (None on a CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached - graphs))  # the pools' free blocks are cached ones


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """No ``.to`` call when it is one already: ~20 us on a thread that wakes cold."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def named_outputs(result: Any, outputs: list[OutputSpec]) -> Mapping[str, Any]:
    """The model's return value as output name -> tensor, or a sentence saying
    why it is not one."""
    lone_bytes = len(outputs) == 1 and outputs[0].dt.is_bytes
    if isinstance(result, torch.Tensor) or (isinstance(result, np.ndarray) and lone_bytes):
        if len(outputs) != 1:
            raise ModelFailure(
                f"model returned one tensor but the config declares "
                f"{len(outputs)} outputs; return a dict"
            )
        return {outputs[0].name: result}
    if isinstance(result, Mapping):
        missing = [s.name for s in outputs if s.name not in result]
        if missing:
            raise ModelFailure(f"model did not return output(s) {', '.join(missing)}")
        return result
    raise ModelFailure(
        f"model returned {type(result).__name__}; expected a tensor, a dict of tensors, "
        f"or a list with one result per item"
    )
