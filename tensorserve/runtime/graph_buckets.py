"""Which CUDA graph a padded batch replays, and whether a model gets graphs
at all: pure decisions from the config and given numbers (no torch, no
device), unit-tested on a CPU.

    graph_mode      compile + device + config -> eager, graphs, or measure
                    first (auto on CUDA), with the one sentence to log
    graph_plan      an eligible config -> its buckets and how each input is
                    padded and each output sliced back
    GraphPlan.bucket  a padded batch's shapes -> its (batch, lengths) bucket
    launch_bound    the auto rule: a forward's GPU and wall times -> graphs?

A CUDA graph replays fixed shapes at fixed addresses, so a model whose
batches vary in size and length gets one graph per bucket: the batch size
rounded up to a power of two (or ``max_batch_size``), each input's one
variable axis rounded up to a power of two (or its ``max_length``). A
ladder of powers of two bounds the graphs of a model to about
``log2(max_batch_size) x log2(max_length)`` buckets, each captured on first
use, and pads a batch by less than 2x on each axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tensorserve.repository.config import DEFAULT_MAX_LENGTH, ModelConfig
from tensorserve.repository.platforms import PLATFORMS

# The shortest length bucket: a tensor core's multiple, which a GPU's padded
# lengths already are (repository/device_defaults.py, GPU_PAD_MULTIPLE).
MIN_LENGTH_BUCKET = 8

# What a replay costs against the eager forward it replaces: a batch is padded
# up to its bucket, by up to 2x on the length axis; a length spread evenly
# over an octave pads by 2 ln 2 (~1.39x) on average. The auto rule asks the
# GPU time, so inflated, to stay under the eager wall time (not yet measured
# on the bundled models: the GPU run logs both timings).
BUCKET_PADDING = 2 * math.log(2)


def ladder(limit: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two from ``start`` below ``limit``, then ``limit`` itself:
    the sizes a dimension of at most ``limit`` is rounded up to."""
    steps = []
    size = start
    while size < limit:
        steps.append(size)
        size *= 2
    return (*steps, limit)


def round_up(value: int, steps: Sequence[int]) -> int | None:
    """The first step at least ``value`` (None: past the last)."""
    return next((step for step in steps if step >= value), None)


@dataclass(frozen=True)
class InputPlan:
    """How one input is padded up to a bucket."""

    name: str
    dtype: str  # as declared (a tensors.dtypes.DTYPES name)
    shape: tuple[int, ...]  # per item, as declared (-1: the variable axis)
    variable_axis: int | None  # its one variable axis, per item (None: all fixed)
    pad_value: float | int | bool  # rows past the batch, and past the length, hold it
    lengths: tuple[int, ...]  # the length ladder of its variable axis (() without one)
    warmup_value: float  # what a timing run's items hold


@dataclass(frozen=True)
class OutputPlan:
    """How one output is sliced back from its bucket to the padded batch."""

    name: str
    variable_axis: int | None  # per item; it follows ``source``'s variable axis
    source: str | None  # the input it follows (unpad_like)


@dataclass(frozen=True)
class Bucket:
    """The shapes one graph is captured at: a batch size, and one length per
    input (None for an input without a variable axis), in the plan's order."""

    batch: int
    lengths: tuple[int | None, ...]


@dataclass(frozen=True)
class OutputCut:
    """How one output of a bucket's graph is checked and cut back: each
    ``(axis, size)`` of ``expected`` is the bucket's (else the graph does not
    follow the inputs' padding), each of ``keep`` the padded batch's."""

    expected: tuple[tuple[int, int], ...]
    keep: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GraphPlan:
    """A model's buckets, from its config (``graph_plan``)."""

    inputs: tuple[InputPlan, ...]
    outputs: tuple[OutputPlan, ...]
    batch_sizes: tuple[int, ...]

    def bucket(self, shapes: Mapping[str, Sequence[int]]) -> Bucket | None:
        """The bucket of a padded batch with these feature shapes (batch
        first), or None when it has none: a shape that is not the declared
        one, or longer than the last bucket (the batch then runs eager)."""
        batch: int | None = None
        lengths: list[int | None] = []
        for spec in self.inputs:
            shape = shapes.get(spec.name)
            if shape is None or len(shape) != len(spec.shape) + 1:
                return None
            if batch is None:
                batch = int(shape[0])
            elif shape[0] != batch:
                return None
            fixed = all(size == dim for size, dim in zip(shape[1:], spec.shape) if dim != -1)
            if not fixed:
                return None
            if spec.variable_axis is None:
                lengths.append(None)
                continue
            length = round_up(int(shape[1 + spec.variable_axis]), spec.lengths)
            if length is None:
                return None
            lengths.append(length)
        size = round_up(batch or 0, self.batch_sizes) if batch else None
        if size is None:
            return None
        return Bucket(size, tuple(lengths))

    def bucket_shape(self, index: int, bucket: Bucket) -> tuple[int, ...]:
        """The static buffer's shape of input ``index`` at ``bucket``."""
        length = bucket.lengths[index]
        dims = [length if d == -1 and length is not None else d for d in self.inputs[index].shape]
        return (bucket.batch, *dims)

    def output_cut(
        self, out: OutputPlan, bucket: Bucket, shapes: Mapping[str, Sequence[int]]
    ) -> OutputCut:
        """Output ``out`` of ``bucket``'s graph, for a padded batch of these
        feature shapes: its rows, and the axis that follows an input's length."""
        batch = int(next(iter(shapes.values()))[0])
        expected, keep = [(0, bucket.batch)], [(0, batch)]
        if out.variable_axis is not None and out.source is not None:
            index = next(i for i, spec in enumerate(self.inputs) if spec.name == out.source)
            source_axis = self.inputs[index].variable_axis
            length = bucket.lengths[index]
            if source_axis is not None and length is not None:
                expected.append((1 + out.variable_axis, length))
                keep.append((1 + out.variable_axis, int(shapes[out.source][1 + source_axis])))
        return OutputCut(tuple(expected), tuple(keep))

    def representative(self) -> Bucket:
        """The bucket a timing runs at: a full batch at a middle length
        (of each input's own ladder), the shape a busy server runs most."""
        lengths = tuple(spec.lengths[len(spec.lengths) // 2] if spec.lengths else None
                        for spec in self.inputs)  # fmt: skip
        return Bucket(self.batch_sizes[-1], lengths)


def plan_problem(config: ModelConfig) -> str | None:
    """Why a model cannot run through bucketed CUDA graphs, as one sentence
    (None: it can). A graph replays fixed shapes over static buffers: every
    input must be a tensor padded along a batch axis and at most one
    variable axis, and every output a tensor whose shape follows them."""
    if not PLATFORMS[config.platform].python:
        return f"platform {config.platform!r} is not a model.py"
    if not config.batching:
        return "max_batch_size = 0: its requests have no batch axis to bucket"
    if config.request_parameter or config.batch_input or config.packed:
        return "it takes request parameters or packed batches, which are not tensors of a shape"
    for spec in config.input:
        if spec.dt.is_bytes:
            return f"input {spec.name!r} is bytes, not a tensor"
        if len(spec.variable_axes) > 1:
            return f"input {spec.name!r} has {len(spec.variable_axes)} variable axes (at most 1)"
    for out in config.output:
        if out.dt.is_bytes or out.ragged:
            return f"output {out.name!r} is bytes or ragged, not a tensor of the batch's shape"
        if len(out.variable_axes) > 1:
            return f"output {out.name!r} has {len(out.variable_axes)} variable axes (at most 1)"
    return None


def graph_plan(config: ModelConfig) -> GraphPlan:
    """The buckets of a model that ``plan_problem`` accepts."""
    inputs = tuple(
        InputPlan(
            name=spec.name,
            dtype=spec.dtype,
            shape=tuple(spec.shape),
            variable_axis=spec.variable_axes[0] if spec.variable_axes else None,
            pad_value=spec.pad_value,
            lengths=ladder(spec.max_length or DEFAULT_MAX_LENGTH, MIN_LENGTH_BUCKET)
            if spec.variable_axes
            else (),
            warmup_value=_number(spec.warmup_value),
        )
        for spec in config.input
    )
    outputs = tuple(
        OutputPlan(
            name=out.name,
            variable_axis=out.variable_axes[0] if out.variable_axes else None,
            source=config.unpad_source(out) if out.variable_axes else None,
        )
        for out in config.output
    )
    return GraphPlan(inputs, outputs, ladder(config.max_batch_size))


def _number(value: float | bytes) -> float:
    if isinstance(value, bytes):  # plan_problem admits no bytes input
        raise TypeError("a bytes input has no graph plan")
    return value


GraphKind = Literal["eager", "graphs", "measure"]


@dataclass(frozen=True)
class GraphMode:
    """How a model's batches run on a device: ``kind`` is eager, graphs
    (bucketed CUDA graphs) or measure (time the eager forward at load, then
    graphs if ``launch_bound``); ``why``: the one sentence to log, if any."""

    kind: GraphKind
    why: str | None = None


def graph_mode(config: ModelConfig, device_type: str) -> GraphMode:
    """The ``compile`` setting on ``device_type`` ("cpu", "cuda", ...).
    Only CUDA has graphs: "auto" is quietly off elsewhere, and an explicit
    "reduce-overhead" says once that it runs eager there."""
    mode = config.compile
    if mode not in ("auto", "reduce-overhead"):
        return GraphMode("eager")  # off, or torch.compile's own (executor.on_device)
    if device_type != "cuda":
        if mode == "auto":
            return GraphMode("eager")
        return GraphMode("eager", f"compile = 'reduce-overhead' runs eager on {device_type}: "
                                  f"CUDA graphs need a CUDA device")  # fmt: skip
    problem = plan_problem(config)
    if problem is not None:
        return GraphMode("eager", f"compile = {mode!r} runs eager: {problem}")
    return GraphMode("graphs" if mode == "reduce-overhead" else "measure")


@dataclass(frozen=True)
class ForwardTimings:
    """One eager forward at the representative bucket, per batch, on one stream."""

    gpu_s: float  # the device's own time (CUDA events, every launch queued ahead)
    wall_s: float  # launch to done, as a batch runs eager (the GPU may wait on launches)


def launch_bound(timings: ForwardTimings, padding: float = BUCKET_PADDING) -> bool:
    """Whether graphs beat the eager forward: a replay costs about the GPU's
    own time (no launches to wait on), at a bucket ``padding`` times the
    batch; the eager forward costs its wall time. A forward whose GPU time
    is under its wall time waited on its launches; graphs remove the wait."""
    return timings.gpu_s * padding < timings.wall_s
