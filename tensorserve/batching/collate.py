"""Pure, synchronous padding and un-padding. No asyncio, no threads, no HTTP.

``pad`` stacks many callers' items into one preallocated tensor per feature,
filled with that feature's pad value; ``unpad`` slices every output row back
to its caller's true extents. Per item there is one vectorised copy (numpy
slice assignment); there is never a loop over elements.

The rule for un-padding: an output's variable axes, in order, take the
extents of its source input's variable axes, in order (``unpad_like``).
Fixed-shape outputs are returned whole.

A model's declared request parameters need no padding: ``Collator.pad``
gives the batch one column per parameter, each row's value in its row.

A bytes feature is padded the same way into a numpy object array (never a
torch tensor), its padding ``b""``: the model gets that array.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tensorserve.errors import ModelFailure
from tensorserve.repository.config import (
    DEFAULT_MAX_LENGTH,
    VARIABLE,
    InputSpec,
    ModelConfig,
    OutputSpec,
)
from tensorserve.tensors import dtypes
from tensorserve.tensors.dtypes import DType, Feature, bfloat16_bits, from_torch

Item = Mapping[str, np.ndarray]
Result = dict[str, np.ndarray]


@dataclass
class PaddedBatch:
    """One batch ready for the model: a host tensor per feature, plus the
    true extents of every item's variable axes (to un-pad with)."""

    features: dict[str, Feature]  # a torch tensor; bytes: a numpy object array
    extents: dict[str, np.ndarray]  # feature -> int64 array [batch, n_variable_axes]
    real_elements: int
    padded_elements: int
    # The longest item's variable extent (the product of its variable axes),
    # over every feature with one: the length the batch is padded to. None
    # without variable axes. Counted here, from the shapes pad reads anyway.
    longest: int | None = None
    # Declared request parameter -> one value per row ({}: the model declares none).
    parameters: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(next(iter(self.extents.values())))


def padded_shape(
    longest: Sequence[int] | np.ndarray, spec: InputSpec, pad_to_multiple_of: int | None = None
) -> list[int]:
    """The one rule for a padded size: the shape of one row of ``spec`` in a
    batch whose items reach ``longest`` on each axis. Variable axes are padded
    to the longest item, rounded up to ``pad_to_multiple_of`` but never past
    ``max_length`` (a model sized to it, a positional table, would fail the
    batch); fixed axes are as declared. ``pad`` allocates this;
    ``Collator.padded_elements`` (the element cap, the memory ceiling) and
    ``Collator.volume`` (the policies' budget, learnt or fixed) count it."""
    limit = spec.max_length or DEFAULT_MAX_LENGTH
    return [
        _round_up(int(longest[axis]), pad_to_multiple_of, limit) if dim == VARIABLE else dim
        for axis, dim in enumerate(spec.shape)
    ]


def _round_up(value: int, multiple: int | None, limit: int) -> int:
    if not multiple:
        return value
    return max(value, min(-(-value // multiple) * multiple, limit))


def batch_buffer(
    batch: int, row_shape: list[int], dt: DType, pin_memory: bool
) -> tuple[Feature, np.ndarray]:
    """(what the model gets, a numpy view of it to fill): a torch tensor, or
    for bytes one object array that is both."""
    if dt.is_bytes:
        array = np.empty((batch, *row_shape), dtype=object)
        return array, array
    if not pin_memory:  # numpy's allocation and a view: ~half torch.empty's cost, hot or cold
        host = np.empty((batch, *row_shape), dtype=dt.numpy)
        return dtypes.as_torch(host, dt), host
    buffer = torch.empty((batch, *row_shape), dtype=dt.torch_dtype, pin_memory=True)
    return buffer, from_torch(buffer)  # numpy view of the same memory


def pad(
    items: Sequence[Item],
    inputs: Sequence[InputSpec],
    *,
    pad_to_multiple_of: int | None = None,
    pin_memory: bool = False,
) -> PaddedBatch:
    """Pad validated items (shapes already checked against ``inputs``)."""
    batch = len(items)
    if batch == 1 and not pad_to_multiple_of and not pin_memory:
        return _single(items[0], inputs)
    features: dict[str, Feature] = {}
    extents: dict[str, np.ndarray] = {}
    real = padded = 0
    longest_item: int | None = None
    flat = _Rows()  # the last 1-D feature's lengths, which the next one often shares
    for spec in inputs:
        arrays = [item[spec.name] for item in items]
        if len(spec.shape) == 1:  # the common case (token ids, masks): plain lists, one mask
            buffer, host, lengths = flat.pad(arrays, spec, pad_to_multiple_of, pin_memory)
            features[spec.name] = buffer
            extents[spec.name] = lengths if spec.variable_axes else lengths[:, :0]
            if spec.variable_axes and batch:
                longest_item = max(longest_item or 0, flat.longest)
            real += flat.total
            padded += host.size
            continue
        shapes = np.array([a.shape for a in arrays], dtype=np.int64).reshape(batch, len(spec.shape))
        longest = shapes.max(axis=0) if batch else np.zeros(len(spec.shape), np.int64)
        row_shape = padded_shape(longest, spec, pad_to_multiple_of)
        buffer, host = batch_buffer(batch, row_shape, spec.dt, pin_memory)
        if bool((shapes == shapes[0]).all()) and list(shapes[0]) == row_shape:
            np.stack(arrays, out=host)  # nothing to pad: one copy
        else:
            host.fill(_pad_fill(spec))
            for row, array in zip(host, arrays):
                row[tuple(slice(0, n) for n in array.shape)] = array
        features[spec.name] = buffer
        extents[spec.name] = variable = shapes[:, list(spec.variable_axes)]
        if variable.size:
            longest_item = max(longest_item or 0, int(variable.prod(axis=1).max()))
        real += int(shapes.prod(axis=1).sum())
        padded += host.size
    return PaddedBatch(features, extents, real, padded, longest_item)


class _Rows:
    """Pads 1-D features. A model's 1-D inputs usually share their lengths
    (ids and their mask): the second reuses the first's lengths array and
    mask, so a batch of two costs little more than one (~1 us a call
    counts here: this runs once a batch on the scheduler's loop)."""

    __slots__ = ("key", "lengths", "longest", "mask", "total")

    def __init__(self) -> None:
        self.key: tuple[list[int], int] | None = None
        self.lengths = np.zeros((0, 1), np.int64)
        self.mask: np.ndarray | None = None
        self.total = self.longest = 0

    def pad(
        self,
        arrays: list[np.ndarray],
        spec: InputSpec,
        pad_to_multiple_of: int | None,
        pin_memory: bool,
    ) -> tuple[Feature, np.ndarray, np.ndarray]:
        counts = [len(a) for a in arrays]
        width = padded_shape([max(counts, default=0)], spec, pad_to_multiple_of)[0]
        buffer, host = batch_buffer(len(arrays), [width], spec.dt, pin_memory)
        if self.key is None or self.key[1] != width or self.key[0] != counts:
            self.key, self.mask, self.total = (counts, width), None, sum(counts)
            self.longest = max(counts, default=0)
            self.lengths = np.array(counts, dtype=np.int64).reshape(-1, 1)
        if counts.count(width) == len(counts):
            np.stack(arrays, out=host)  # nothing to pad: one copy
            return buffer, host, self.lengths
        if self.mask is None:
            self.mask = np.arange(width) < self.lengths
        host.fill(_pad_fill(spec))
        host[self.mask] = np.concatenate(arrays)  # every row's prefix in one assignment
        return buffer, host, self.lengths


def _pad_fill(spec: InputSpec) -> Any:
    """The pad value as the host array's scalar (bfloat16 as its bit pattern)."""
    if spec.dt.is_bytes:
        return b""
    if spec.dt.name == "bfloat16":
        return bfloat16_bits(np.float32(spec.pad_value))[()]  # the wire's one rounding rule
    return spec.dt.numpy.type(spec.pad_value)


def _single(item: Item, inputs: Sequence[InputSpec]) -> PaddedBatch:
    """A batch of one has nothing to pad: one copy per feature (a lone request
    at low load is the latency-critical case)."""
    features: dict[str, Feature] = {}
    extents, elements = {}, 0
    longest: int | None = None
    for spec in inputs:
        array = np.array(item[spec.name])  # owned and writable, as torch wants
        features[spec.name] = dtypes.as_feature(array[None], spec.dt)
        extents[spec.name] = np.array(
            [[array.shape[a] for a in spec.variable_axes]], dtype=np.int64
        )
        if spec.variable_axes:
            longest = max(longest or 0, math.prod(array.shape[a] for a in spec.variable_axes))
        elements += array.size
    return PaddedBatch(features, extents, elements, elements, longest)


def check_output(name: str, array: np.ndarray, spec: OutputSpec, batch: int) -> None:
    """Fail the batch with a sentence if the model's output cannot be un-padded."""
    if array.ndim != len(spec.shape) + 1 or array.shape[0] != batch:
        raise ModelFailure(
            f"output {name!r} has shape {list(array.shape)}; expected a batch of {batch} "
            f"items of shape {spec.shape}"
        )
    for axis, dim in enumerate(spec.shape):
        if dim != VARIABLE and array.shape[axis + 1] != dim:
            raise ModelFailure(
                f"output {name!r} axis {axis} has size {array.shape[axis + 1]}, config says {dim}"
            )


def ragged_rows(spec: OutputSpec, value: object, batch: int) -> Sequence[np.ndarray]:
    """A ragged output's rows, one per item of the batch, each of the declared
    rank and fixed sizes, or a sentence saying why not (``ModelFailure``)."""
    if not isinstance(value, (list, tuple)) or len(value) != batch:
        got = f"{len(value)} rows" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ModelFailure(
            f"ragged output {spec.name!r} must be a list of one tensor per row; got {got} "
            f"for a batch of {batch}"
        )
    for row in value:
        check_output(spec.name, row[np.newaxis], spec, 1)
    return value


def unpad(
    outputs: Mapping[str, np.ndarray | Sequence[np.ndarray]],
    batch: PaddedBatch,
    specs: Sequence[OutputSpec],
    sources: Mapping[str, str | None],
) -> list[Result]:
    """Slice each output row back to its item's true extents.

    ``sources`` maps an output name to the input it follows (``unpad_like``).
    The rows returned are views into the batch arrays: no copy is made here.

    A ``ragged`` output arrives as one array per row, each its own length
    (``ragged_rows``), and each row is taken as it is: it was never padded.
    This is the one place a batch's rows are cut out, ragged or not, so a
    batch with ragged outputs stays a batch up to here (no per-item results,
    which would skip the un-padding of its other outputs).
    """
    results: list[Result] = [{} for _ in range(batch.size)]
    for spec in specs:
        value = outputs[spec.name]
        if spec.ragged:
            for result, row in zip(results, ragged_rows(spec, value, batch.size)):
                result[spec.name] = row
            continue
        assert isinstance(value, np.ndarray)
        array = value
        check_output(spec.name, array, spec, batch.size)
        variable = spec.variable_axes
        if not variable:
            for result, row in zip(results, array):
                result[spec.name] = row
            continue
        source = sources[spec.name]
        assert source is not None  # guaranteed by config validation
        wanted = batch.extents[source][:, : len(variable)]
        if variable == (0,):  # the common case: one slice per row, lengths as plain ints
            lengths = wanted[:, 0].tolist()
            if max(lengths, default=0) > array.shape[1]:
                _too_short(spec.name, source, [array.shape[1]], [max(lengths)])
            for result, row, length in zip(results, array, lengths):
                result[spec.name] = row[:length]
            continue
        available = np.array([array.shape[axis + 1] for axis in variable])
        if (wanted > available).any():
            _too_short(spec.name, source, available.tolist(), wanted.max(axis=0).tolist())
        for result, row, lengths in zip(results, array, wanted):
            index = [slice(None)] * len(spec.shape)
            for axis, length in zip(variable, lengths):
                index[axis] = slice(0, int(length))
            result[spec.name] = row[tuple(index)]
    return results


def _too_short(name: str, source: str, available: list[int], needed: list[int]) -> None:
    raise ModelFailure(
        f"output {name!r} is shorter than input {source!r} on a variable axis: "
        f"padded sizes {available}, longest item needs {needed}"
    )


class Collator:
    """All the shape arithmetic of one model's batches, from its config: the
    batcher asks it how big items and batches are, and to pad and un-pad."""

    def __init__(self, config: ModelConfig, *, pin_memory: bool = False) -> None:
        self.inputs = config.input
        # The inputs a batch pads (a packed model's ragged ones are concatenated: packing.py).
        self.padded_inputs = [spec for spec in config.input if not spec.allow_ragged_batch]
        self.outputs = config.output
        self.sources = {out.name: config.unpad_source(out) for out in config.output}
        # The first input with variable axes stands for an item's size.
        self.primary = next((s for s in config.input if s.variable_axes), None)
        self._primary_axes = self.primary.variable_axes if self.primary is not None else ()
        self.pad_to_multiple_of = config.dynamic_batching.pad_to_multiple_of
        self.pin_memory = pin_memory
        self.parameter_names = [spec.name for spec in config.request_parameter]
        # What the largest batch pads to (every item at its limit): while the
        # element caps are above it, no batch needs counting.
        self.largest_batch_elements = max(1, config.max_batch_size) * sum(
            math.prod(padded_shape([s.max_length or DEFAULT_MAX_LENGTH] * len(s.shape), s))
            for s in config.input
        )

    def volumes(self, items: Sequence[Item]) -> list[int]:
        """Each item's padded size in the first variable input: the product of
        its variable extents, each rounded up to ``pad_to_multiple_of``
        (``padded_shape``), as it would be padded alone. The policies and the
        budget count a batch as its size times its largest volume, so the
        rounding counts against ``max_batch_tokens`` as it costs the model.
        One variable axis, no rounding (for every request admitted): its length."""
        if self.primary is None:
            return [1] * len(items)
        spec, axes, multiple = self.primary, self._primary_axes, self.pad_to_multiple_of
        if axes == (0,) and not multiple:
            return [len(item[spec.name]) for item in items]
        shapes = [item[spec.name].shape for item in items]
        padded = [padded_shape(shape, spec, multiple) if multiple else shape for shape in shapes]
        return [math.prod(shape[axis] for axis in axes) for shape in padded]

    def padded_elements(self, items: Sequence[Item]) -> int:
        """Elements ``pad(items)`` allocates, all features (``padded_shape``)."""
        total = 0
        for spec in self.padded_inputs:
            longest = [  # plain Python: this runs each time a batch forms, for a few items
                max(item[spec.name].shape[axis] for item in items) if dim == VARIABLE else dim
                for axis, dim in enumerate(spec.shape)
            ]
            total += len(items) * math.prod(padded_shape(longest, spec, self.pad_to_multiple_of))
        return total

    def pad(
        self, items: Sequence[Item], parameters: Sequence[Mapping[str, Any]] = ()
    ) -> PaddedBatch:
        """The padded batch; ``parameters``: each item's request parameter
        values (validated, defaults filled in), made into one column per
        declared parameter."""
        batch = pad(
            items,
            self.inputs,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pin_memory=self.pin_memory,
        )
        return self.with_parameters(batch, parameters)

    def with_parameters(
        self, batch: PaddedBatch, parameters: Sequence[Mapping[str, Any]]
    ) -> PaddedBatch:
        """``batch`` with one column per declared request parameter."""
        if self.parameter_names:
            batch.parameters = {
                name: [values[name] for values in parameters] for name in self.parameter_names
            }
        return batch

    def unpad(
        self, outputs: Mapping[str, np.ndarray | Sequence[np.ndarray]], batch: PaddedBatch
    ) -> list[Result]:
        return unpad(outputs, batch, self.outputs, self.sources)
