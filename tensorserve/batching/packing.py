"""Pure, synchronous packing and un-packing: Triton's ragged batching. No
asyncio, no threads, no HTTP.

A model whose inputs set ``allow_ragged_batch`` gets a ``PackedCollator``
(``make_collator``) in place of the padding ``Collator``, so the padded
path runs exactly as before. For a packed batch:

* ``pack``: each ragged input's items are concatenated along their one
  variable axis, with no batch dimension ([5, 8] and [3, 8] make [8, 8]);
  the other inputs are padded or stacked as ever (``collate.pad``); each
  ``[[batch_input]]`` is built once here, from the items' shapes, and
  travels with the batch as one more feature (to a worker process too);
* ``unpack``: an output that follows a ragged input comes back concatenated
  along its variable axis and is cut into each caller's rows by that
  input's lengths; a total that is not their sum fails the batch with a
  sentence naming the output. Every other output is un-padded as ever.

Nothing is padded, so real and padded elements are equal (efficiency 1.0),
and a batch's volume for the budget is the sum of its items' lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorserve.batching.collate import (
    Collator,
    Item,
    PaddedBatch,
    Result,
    batch_buffer,
    pad,
    unpad,
)
from tensorserve.errors import ModelFailure
from tensorserve.repository.config import VARIABLE, InputSpec, ModelConfig, OutputSpec
from tensorserve.repository.ragged_config import BatchInputSpec


def make_collator(config: ModelConfig, *, pin_memory: bool = False) -> Collator:
    """The collator a model's batches go through: packing where an input is
    ragged, padding otherwise."""
    if config.packed:
        return PackedCollator(config, pin_memory=pin_memory)
    return Collator(config, pin_memory=pin_memory)


def batch_input_values(kind: str, shapes: np.ndarray) -> np.ndarray:
    """One ``[[batch_input]]``'s values for a batch whose source items have
    ``shapes`` ([B, rank] int64), as Triton defines each kind (counts are
    elements: the product of an item's shape)."""
    counts = shapes.prod(axis=1)
    if kind == "BATCH_ELEMENT_COUNT":
        return counts
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        return np.cumsum(counts)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        return np.concatenate(([0], np.cumsum(counts)))
    if kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
        # Only its shape tells (Triton leaves the values unset; zeros here).
        return np.zeros(int(counts.max(initial=0)), np.int64)
    if kind == "BATCH_ITEM_SHAPE":
        return shapes
    if kind == "BATCH_ITEM_SHAPE_FLATTEN":
        return shapes.reshape(-1)
    raise ValueError(f"unknown batch_input kind {kind!r}")  # the config's Literal allows none


def pack(
    items: Sequence[Item],
    inputs: Sequence[InputSpec],
    batch_inputs: Sequence[BatchInputSpec] = (),
    *,
    pad_to_multiple_of: int | None = None,
    pin_memory: bool = False,
) -> PaddedBatch:
    """The batch for a model with ragged inputs (validated items). Its
    ``extents`` hold each ragged input's item lengths ([B, 1]), as a padded
    input's hold its true extents, so ``unpack`` and ``unpad`` read the same."""
    padded_specs = [spec for spec in inputs if not spec.allow_ragged_batch]
    if padded_specs:
        batch = pad(
            items, padded_specs, pad_to_multiple_of=pad_to_multiple_of, pin_memory=pin_memory
        )
    else:
        batch = PaddedBatch({}, {}, 0, 0)
    shapes: dict[str, np.ndarray] = {}
    for spec in inputs:
        if not spec.allow_ragged_batch:
            continue
        arrays = [item[spec.name] for item in items]
        (axis,) = spec.variable_axes
        shapes[spec.name] = item_shapes = np.array(
            [a.shape for a in arrays], dtype=np.int64
        ).reshape(len(arrays), len(spec.shape))
        lengths = item_shapes[:, axis]
        packed = [int(lengths.sum()) if a == axis else d for a, d in enumerate(spec.shape)]
        buffer, host = batch_buffer(packed[0], packed[1:], spec.dt, pin_memory)
        np.concatenate(arrays, axis=axis, out=host)
        batch.features[spec.name] = buffer
        batch.extents[spec.name] = lengths.reshape(-1, 1)
        batch.real_elements += host.size
        batch.padded_elements += host.size
        batch.longest = max(batch.longest or 0, int(lengths.max(initial=0)))
    for described in batch_inputs:
        values = batch_input_values(described.kind, shapes[described.source])
        buffer, host = batch_buffer(
            values.shape[0], list(values.shape[1:]), described.dt, pin_memory
        )
        host[...] = values
        batch.features[described.target_name] = buffer
    return batch


def unpack(
    spec: OutputSpec, array: np.ndarray, lengths: Sequence[int], source: str
) -> list[np.ndarray]:
    """A packed output cut into each item's rows along its variable axis
    (views, no copy), or ``ModelFailure`` naming the output when its shape
    is not the declared one with the lengths' sum on that axis."""
    (axis,) = spec.variable_axes
    total = sum(lengths)
    expected = [total if d == VARIABLE else d for d in spec.shape]
    if list(array.shape) != expected:
        raise ModelFailure(
            f"output {spec.name!r} has shape {list(array.shape)}; packed like input "
            f"{source!r} it must be {expected}: axis {axis} the sum of the batch's "
            f"{len(lengths)} lengths"
        )
    rows, start = [], 0
    index: list[Any] = [slice(None)] * array.ndim
    for length in lengths:
        index[axis] = slice(start, start + length)
        rows.append(array[tuple(index)])
        start += length
    return rows


class PackedCollator(Collator):
    """A ``Collator`` for a model with ragged inputs: packs (``pack``) and
    un-packs (``unpack``); its item volume is the first ragged input's length
    and a batch's volume their sum (the policies' ``packed``)."""

    def __init__(self, config: ModelConfig, *, pin_memory: bool = False) -> None:
        super().__init__(config, pin_memory=pin_memory)
        self.batch_inputs = config.batch_input
        ragged = {spec.name for spec in config.input if spec.allow_ragged_batch}
        self.primary = self._ragged_primary = next(s for s in config.input if s.allow_ragged_batch)
        self._primary_axes = self.primary.variable_axes
        # Outputs that follow a ragged input (unpad_like, [[batch_output]]): un-packed.
        self.packed_outputs = [
            out
            for out in config.output
            if out.variable_axes and not out.ragged and self.sources[out.name] in ragged
        ]
        self._other_outputs = [out for out in config.output if out not in self.packed_outputs]

    def volumes(self, items: Sequence[Item]) -> list[int]:
        (axis,) = self._primary_axes
        name = self._ragged_primary.name
        return [item[name].shape[axis] for item in items]

    def padded_elements(self, items: Sequence[Item]) -> int:
        """Elements ``pack(items)`` allocates: the ragged inputs' own, and the
        padded inputs' as ``Collator.padded_elements`` counts them."""
        ragged = [spec.name for spec in self.inputs if spec.allow_ragged_batch]
        return super().padded_elements(items) + sum(
            item[name].size for name in ragged for item in items
        )

    def pad(
        self, items: Sequence[Item], parameters: Sequence[Mapping[str, Any]] = ()
    ) -> PaddedBatch:
        batch = pack(
            items,
            self.inputs,
            self.batch_inputs,
            pad_to_multiple_of=self.pad_to_multiple_of,
            pin_memory=self.pin_memory,
        )
        return self.with_parameters(batch, parameters)

    def unpad(
        self, outputs: Mapping[str, np.ndarray | Sequence[np.ndarray]], batch: PaddedBatch
    ) -> list[Result]:
        results = unpad(outputs, batch, self._other_outputs, self.sources)
        for spec in self.packed_outputs:
            value = outputs[spec.name]
            if not isinstance(value, np.ndarray):
                raise ModelFailure(f"output {spec.name!r} must be one tensor, packed")
            source = self.sources[spec.name]
            assert source is not None  # packed_outputs follow a ragged input
            lengths = batch.extents[source][:, 0].tolist()
            for result, row in zip(results, unpack(spec, value, lengths, source)):
                result[spec.name] = row
        return results
