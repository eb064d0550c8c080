"""CUDA graphs over buckets: each padded batch replays the graph of its
(batch size, length) bucket instead of launching the forward's kernels one
by one (``compile = "reduce-overhead"``, or ``"auto"`` where the forward is
launch-bound). The buckets and the decisions are ``graph_buckets``'s; this
module holds the state and the torch calls:

    GraphSwitch     one per model, shared by its instances: graphs on or off
                    (auto: decided once, from one timing); a bucket whose
                    capture failed runs eager, and graphs go off for good
                    after a failure every bucket would meet (or failures at
                    two buckets), said in one log line
    GraphedForward  one per instance (its thread): per bucket, static input
                    buffers and the captured graph; pads a batch up to its
                    bucket, replays, slices each output back to the batch
    CudaGraphs      the capture backend on CUDA: the instance's stream and
                    one memory pool for all the instance's graphs
    CAPTURE_LOCK    one capture at a time in the process, and no emptied
                    cache during one (``empty_cache``)

A batch reaches ``GraphedForward`` padded as ever (``batching.collate``) and
leaves it with the padded batch's shapes, so un-padding per caller does not
change. Rows past the batch and positions past its length hold each input's
``pad_value`` (an attention mask's 0): the padded rows' outputs are sliced
off like any padding.

A graph's outputs are static buffers that its next replay overwrites. The
executor copies every output to the host on the instance's stream right
after the replay (``DeviceContext.to_host``), so the stream orders that copy
before the instance's next replay; nothing else may keep them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from tensorserve.repository.config import ModelConfig
from tensorserve.runtime.device import sticky_cuda_error
from tensorserve.runtime.graph_buckets import (
    Bucket,
    ForwardTimings,
    GraphPlan,
    graph_mode,
    graph_plan,
    launch_bound,
)
from tensorserve.tensors.dtypes import DTYPES

log = logging.getLogger(__name__)

Replay = Callable[[], Any]  # runs the captured forward again; returns its outputs

# Entering torch.cuda.graph synchronises and empties every device's cache,
# and emptying a cache while any capture is under way in the process trips
# torch's assert (captures_underway.empty(); "thread_local" does not help):
# torch allows one capture at a time per process. Each whole capture (its
# eager run too) and every cache the server empties hold this lock, so two
# instances' threads (several instances, models or GPUs) take turns.
CAPTURE_LOCK = threading.Lock()

# A capture that fails with these fails at every bucket: the forward syncs
# with the host (cudaErrorStreamCaptureUnsupported's text) or calls what a
# capture forbids. Any other failure (out of memory mid-capture can surface
# as cudaErrorStreamCaptureInvalidated) costs its bucket alone.
EVERY_BUCKET_FAILS = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported",
)
BUCKET_FAILURES_OFF = 2  # failed buckets after which graphs go off for the model


def empty_cache() -> None:
    """``torch.cuda.empty_cache`` between captures, never during one."""
    with CAPTURE_LOCK:
        torch.cuda.empty_cache()


class CaptureBackend(Protocol):
    """Turns a forward over static buffers into a replay of it. On CUDA a
    graph capture (``CudaGraphs``); a test injects one that calls the forward.
    ``reserved_bytes``: device memory its graphs' pool holds (0 where none)."""

    reserved_bytes: int

    def capture(self, forward: Callable[[], Any]) -> Replay: ...


class CudaGraphs:
    """Captures on the instance's stream, into one memory pool shared by the
    instance's graphs. A graph captured later may put its outputs where an
    earlier one keeps its scratch, so replaying the earlier one overwrites
    them: safe here because the graphs replay one at a time on the stream,
    and each replay's outputs are copied out before the next replay (the
    module's docstring). The static inputs are allocated outside the pool.
    The caller holds ``CAPTURE_LOCK`` (``GraphedForward``).

    ``reserved_bytes`` adds up what each capture grew the device's reserved
    memory by: the pool, whose free blocks no ordinary allocation can use
    (the executor's free-memory estimate leaves them out)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.pool = torch.cuda.graph_pool_handle()
        self.reserved_bytes = 0

    def capture(self, forward: Callable[[], Any]) -> Replay:
        # One eager run first, outside the capture: lazy initialisation (cuBLAS
        # handles, workspaces, autotuning) may not be captured.
        forward()
        graph = torch.cuda.CUDAGraph()
        device = self.stream.device
        before = 0
        # torch.cuda.graph synchronises the device and empties the caches
        # first: once per bucket, the price of capturing at its first batch.
        # thread_local: another instance's thread may launch, copy or wait
        # while this one captures; only this thread's forward is restricted.
        try:
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                # Measured inside: entering emptied the cache (host-side stats only).
                before = torch.cuda.memory_reserved(device)
                outputs = forward()
        except BaseException:
            # Leave the allocator routing nothing more into the pool (torch's
            # own exit may have failed before it did).
            if hasattr(torch._C, "_cuda_endAllocateToPool"):
                with contextlib.suppress(Exception):
                    torch._C._cuda_endAllocateToPool(device.index, self.pool)
            raise
        self.reserved_bytes += max(0, torch.cuda.memory_reserved(device) - before)

        def replay() -> Any:
            graph.replay()  # on the current stream: the instance's (DeviceContext.running)
            return outputs

        return replay


class GraphSwitch:
    """Whether a model's batches replay graphs: shared by its instances, so
    a decision is timed once and a failure turns graphs off for all of them
    with one log line (a replay of the wrong shape, a capture that fails
    at every bucket, or failed captures at two buckets: the batch, and every
    later one, runs eager; no caller sees it). A bucket whose capture failed
    for a reason of its own runs eager from then on, said once."""

    def __init__(self, label: str, plan: GraphPlan, measure_first: bool) -> None:
        self.label = label
        self.plan = plan
        self._lock = threading.Lock()
        self._decided: bool | None = None if measure_first else True
        self.off_reason: str | None = None
        self.eager_buckets: set[Bucket] = set()  # their capture failed: never tried again

    @property
    def on(self) -> bool:
        return self._decided is True and self.off_reason is None

    def decide(self, measure: Callable[[], ForwardTimings]) -> bool:
        """Graphs or not, from one timing (``graph_buckets.launch_bound``),
        logged with both times; the first instance to start times it, the
        others wait for its answer. A timing that fails leaves it eager,
        unless the CUDA context is lost (re-raised, undecided)."""
        with self._lock:
            if self._decided is None:
                try:
                    timings = measure()
                except Exception as exc:
                    if sticky_cuda_error(exc) is not None:
                        raise  # the context is lost: the executor's to say (DeviceLost)
                    self._decided = False
                    log.warning(
                        "model %r: compile = 'auto' runs eager: timing its forward failed: %s: %s",
                        self.label, type(exc).__name__, exc,
                    )  # fmt: skip
                    return False
                self._decided = launch_bound(timings)
                log.info(
                    "model %r: compile = 'auto' chose %s: GPU time %.3f ms, wall time %.3f ms "
                    "per batch at batch %d",
                    self.label,
                    "CUDA graphs" if self._decided else "eager (not launch-bound)",
                    timings.gpu_s * 1e3, timings.wall_s * 1e3, self.plan.batch_sizes[-1],
                )  # fmt: skip
            return self._decided

    def turn_off(self, reason: str) -> None:
        with self._lock:
            if self.off_reason is not None:
                return
            self.off_reason = reason
        log.warning("model %r runs eager from now on: %s", self.label, reason)

    def capture_failed(self, bucket: Bucket, exc: BaseException) -> None:
        """A failed capture: that bucket eager for good (one log line), or,
        for a failure every bucket would meet or at a second bucket, graphs off."""
        where = f"batch {bucket.batch}, lengths {[n for n in bucket.lengths if n is not None]}"
        cause = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if bucket in self.eager_buckets or self.off_reason is not None:
                return
            self.eager_buckets.add(bucket)
            failed = len(self.eager_buckets)
        if any(text in str(exc) for text in EVERY_BUCKET_FAILS):
            self.turn_off(f"capturing a CUDA graph at {where} failed: {cause}")
        elif failed >= BUCKET_FAILURES_OFF:
            self.turn_off(f"capturing CUDA graphs failed at {failed} buckets, the last at {where}: "
                          f"{cause}")  # fmt: skip
        else:
            log.warning("model %r: bucket at %s runs eager from now on: capturing its CUDA "
                        "graph failed: %s", self.label, where, cause)  # fmt: skip


def graph_switch(config: ModelConfig, device: torch.device, label: str) -> GraphSwitch | None:
    """The model's switch (None: it never replays graphs here, said once
    when the config asked for them and cannot have them)."""
    mode = graph_mode(config, device.type)
    if mode.why is not None:  # a warning where the config asked for graphs by name
        level = logging.WARNING if config.compile == "reduce-overhead" else logging.INFO
        log.log(level, "model %r: %s", label, mode.why)
    if mode.kind == "eager":
        return None
    return GraphSwitch(label, graph_plan(config), measure_first=mode.kind == "measure")


class GraphedForward:
    """One instance's forward through the graphs of its buckets. Used by the
    instance's thread alone: its static buffers and graphs are its own."""

    def __init__(
        self, model: Callable[..., Any], switch: GraphSwitch, backend: CaptureBackend,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.model = model
        self.switch = switch
        self.backend = backend
        self.device = device
        self.graphs: dict[Bucket, tuple[dict[str, torch.Tensor], Replay]] = {}
        # Whether the last call captured its bucket's graph: its time is the
        # capture's (an eager run and the capture), not a batch's.
        self.captured = False

    @property
    def reserved_bytes(self) -> int:
        """Device memory this instance's graphs hold apart (0 once dropped)."""
        return self.backend.reserved_bytes if self.graphs else 0

    def __call__(self, **features: Any) -> Any:
        self.captured = False
        if not self.switch.on:
            if self.graphs:  # off since: their pool and static buffers can go
                self.graphs.clear()
            return self.model(**features)
        shapes = {n: tuple(t.shape) for n, t in features.items() if isinstance(t, torch.Tensor)}
        bucket = self.switch.plan.bucket(shapes)
        if bucket is None or bucket in self.switch.eager_buckets:
            # Not a shape of the config's (the model's own error), or a failed bucket.
            return self.model(**features)
        captured = self.graphs.get(bucket) or self._capture(bucket)
        if captured is None:
            return self.model(**features)
        static, replay = captured
        self._fill(static, features)
        outputs = self._sliced(replay(), bucket, shapes)
        if outputs is None:
            return self.model(**features)
        return outputs

    def _capture(self, bucket: Bucket) -> tuple[dict[str, torch.Tensor], Replay] | None:
        static = self.static_inputs(bucket)
        try:
            with CAPTURE_LOCK:  # one capture at a time in the process
                if bucket in self.switch.eager_buckets or not self.switch.on:
                    return None  # another instance's capture failed meanwhile
                self.captured = True
                replay = self.backend.capture(lambda: self.model(**static))
        except Exception as exc:
            # A lost CUDA context is the executor's to say; out of memory is
            # the batch's (split and retried, the bucket tried again later).
            if sticky_cuda_error(exc) is not None or isinstance(exc, torch.OutOfMemoryError):
                raise
            self.switch.capture_failed(bucket, exc)
            return None
        self.graphs[bucket] = static, replay
        return static, replay

    def static_inputs(self, bucket: Bucket, fill: bool = False) -> dict[str, torch.Tensor]:
        """Fresh buffers of ``bucket``'s shapes: pad values (``fill``: each
        input's warm-up value, a timing's items)."""
        plan = self.switch.plan
        return {
            spec.name: torch.full(
                plan.bucket_shape(index, bucket),
                spec.warmup_value if fill else spec.pad_value,
                dtype=DTYPES[spec.dtype].torch_dtype,
                device=self.device,
            )
            for index, spec in enumerate(plan.inputs)
        }

    def time_eager(self, stream: torch.cuda.Stream) -> ForwardTimings:
        """The eager forward's timings at the plan's representative bucket
        (``measure_forward``), over items of warm-up values, taking turns with
        captures and other timings in this process."""
        inputs = self.static_inputs(self.switch.plan.representative(), fill=True)
        with CAPTURE_LOCK:  # no other instance's capture or timing on the GPU meanwhile
            return measure_forward(lambda: self.model(**inputs), stream)

    def _fill(self, static: Mapping[str, torch.Tensor], features: Mapping[str, Any]) -> None:
        """The batch into its bucket's buffers, the rest pad values (a
        previous batch's values must not leak into this one's padding)."""
        for spec in self.switch.plan.inputs:
            buffer, feature = static[spec.name], features[spec.name]
            if buffer.shape == feature.shape:
                buffer.copy_(feature, non_blocking=True)
                continue
            buffer.fill_(spec.pad_value)
            buffer[tuple(slice(0, n) for n in feature.shape)].copy_(feature, non_blocking=True)

    def _sliced(
        self, outputs: Any, bucket: Bucket, shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, torch.Tensor] | None:
        """Each output cut back from the bucket to the padded batch: its
        rows, and along an axis that follows an input, that input's padded
        length. None (graphs off) for outputs of another form or shape."""
        plan = self.switch.plan
        if isinstance(outputs, torch.Tensor) and len(plan.outputs) == 1:
            outputs = {plan.outputs[0].name: outputs}
        if not isinstance(outputs, Mapping):
            self.switch.turn_off(
                f"its forward returned {type(outputs).__name__}; graphs replay a tensor or a "
                f"dict of tensors"
            )
            return None
        sliced: dict[str, torch.Tensor] = {}
        for out in plan.outputs:
            tensor = outputs.get(out.name)
            if not isinstance(tensor, torch.Tensor) or tensor.ndim < 1:
                self.switch.turn_off(f"output {out.name!r} of its forward is not a tensor")
                return None
            cut = plan.output_cut(out, bucket, shapes)
            if any(axis >= tensor.ndim or tensor.shape[axis] != n for axis, n in cut.expected):
                self.switch.turn_off(
                    f"output {out.name!r} has shape {list(tensor.shape)} at batch {bucket.batch}, "
                    f"lengths {[n for n in bucket.lengths if n is not None]}: it does not follow "
                    f"the inputs' padding"
                )
                return None
            for axis, size in cut.keep:
                tensor = tensor.narrow(axis, 0, size)
            sliced[out.name] = tensor
        return sliced


def measure_forward(
    forward: Callable[[], Any], stream: torch.cuda.Stream, repeats: int = 5, rounds: int = 3
) -> ForwardTimings:
    """One batch's GPU time and wall time, eager, on the instance's stream,
    each the least of ``rounds`` x ``repeats`` forwards: the server loads its
    models at once, so another model's warm-up may share the GPU and the
    host with a timing, and only ever makes a forward look slower.
    Wall: ``repeats`` forwards launched back to back, then waited for (a
    round). GPU: every forward queued behind a kernel that keeps the device
    busy while the host launches them all, an event after each, so the gap
    between two events is one forward's work and none of its waiting for
    launches."""
    forward()  # lazy initialisation is no batch's time
    stream.synchronize()
    walls = []
    for _ in range(rounds):
        clock = time.perf_counter()
        for _ in range(repeats):
            forward()
        stream.synchronize()
        walls.append((time.perf_counter() - clock) / repeats)
    wall, count = min(walls), repeats * rounds
    # Sleep the device for about three times the launches' time (2 GHz
    # cycles; a slower clock sleeps longer, which only adds margin).
    torch.cuda._sleep(int(min(3 * max(walls) * count, 2.0) * 2e9))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
    events[0].record(stream)
    for event in events[1:]:
        forward()
        event.record(stream)
    events[-1].synchronize()
    gpu = min(a.elapsed_time(b) for a, b in itertools.pairwise(events)) / 1000.0
    return ForwardTimings(gpu_s=gpu, wall_s=wall)
