"""Packed batches in ``config.toml``, with Triton's schema: an input with
``allow_ragged_batch = true`` is packed (its items concatenated along their
one variable axis, no batch dimension), ``[[batch_input]]`` tensors describe
the packed batch to the forward, and ``[[batch_output]]`` (or ``unpad_like``
on a ragged input) splits a packed output back into each caller's rows.

The kinds, for a batch of B items of a source input, counting elements as
Triton does (an item of shape [5, 8] counts 40; a 1-D item, its tokens):

==========================================  =========  ===============================
kind                                        shape      values
==========================================  =========  ===============================
BATCH_ELEMENT_COUNT                         [B]        each item's element count
BATCH_ACCUMULATED_ELEMENT_COUNT             [B]        the running sum of those
BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO   [B + 1]    0, then the running sum
BATCH_MAX_ELEMENT_COUNT_AS_SHAPE            [max]      zeros: only the shape says it
BATCH_ITEM_SHAPE                            [B, rank]  each item's shape
BATCH_ITEM_SHAPE_FLATTEN                    [B * rank] the same, flattened
==========================================  =========  ===============================

``ragged_problem`` is the one check at load, as one sentence naming the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from tensorserve.repository.parameters import RequestParameterSpec
from tensorserve.repository.tensor_specs import InputSpec, OutputSpec
from tensorserve.tensors.dtypes import DTYPES, DType

BatchInputKind = Literal[
    "BATCH_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE",
    "BATCH_ITEM_SHAPE_FLATTEN",
]


class _Strict(BaseModel):
    # Typos in config.toml are errors, not silently ignored keys.
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchInputSpec(_Strict):
    """Triton's ``batch_input``: a tensor the server builds for each packed
    batch, passed to the forward as the keyword argument ``target_name``."""

    kind: BatchInputKind = Field(description="What it holds (Triton's kinds; the table above).")
    target_name: str = Field(min_length=1, description="The forward's keyword argument.")
    data_type: Literal["int32", "int64", "float32"] = Field(
        "int32", description="Its dtype (Triton: TYPE_INT32 or TYPE_FP32)."
    )
    source_input: list[str] = Field(
        min_length=1, max_length=1, description="The one ragged input it describes."
    )

    @property
    def name(self) -> str:
        return self.target_name

    @property
    def dt(self) -> DType:
        return DTYPES[self.data_type]

    @property
    def source(self) -> str:
        return self.source_input[0]


class BatchOutputSpec(_Strict):
    """Triton's ``batch_output``: each output in ``target_name`` comes back
    concatenated and is split into each caller's rows by the lengths of
    ``source_input`` (the same as ``unpad_like`` on a ragged input)."""

    kind: Literal["BATCH_SCATTER_WITH_INPUT_SHAPE"] = Field(
        description="The one kind Triton defines: scatter like the input's shape."
    )
    target_name: list[str] = Field(min_length=1, description="The outputs it splits.")
    source_input: list[str] = Field(
        min_length=1, max_length=1, description="The ragged input whose lengths split them."
    )


class Packing(Protocol):
    """What the check reads of a model's config (``config.ModelConfig``,
    which calls it: the config imports this module, not back)."""

    @property
    def platform(self) -> str: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def input(self) -> Sequence[InputSpec]: ...
    @property
    def output(self) -> Sequence[OutputSpec]: ...
    @property
    def request_parameter(self) -> Sequence[RequestParameterSpec]: ...
    @property
    def batch_input(self) -> Sequence[BatchInputSpec]: ...
    @property
    def batch_output(self) -> Sequence[BatchOutputSpec]: ...


def ragged_problem(config: Packing) -> str | None:
    """Why packing cannot work as ``config`` asks, as one sentence, or None."""
    ragged = {spec.name for spec in config.input if spec.allow_ragged_batch}
    if config.platform == "ensemble" and (ragged or config.batch_input or config.batch_output):
        return "an ensemble packs nothing itself: allow_ragged_batch belongs to its step models"
    for spec in config.input:
        if not spec.allow_ragged_batch:
            continue
        if len(spec.variable_axes) != 1:
            return (
                f"input {spec.name!r}: allow_ragged_batch = true concatenates items along "
                f"their one variable (-1) axis, but shape {spec.shape} has "
                f"{len(spec.variable_axes)}"
            )
        if config.max_batch_size < 1:
            return (
                f"input {spec.name!r}: allow_ragged_batch = true packs batches of items; "
                f"it needs max_batch_size >= 1"
            )
    # The forward's other keyword arguments: a batch input must not shadow one.
    names = {spec.name: f"input {spec.name!r}" for spec in config.input}
    names |= {p.name: f"request_parameter {p.name!r}" for p in config.request_parameter}
    for batch_input in config.batch_input:
        name = batch_input.target_name
        if name in names:
            return f"batch_input {name!r}: target_name is already the name of {names[name]}"
        names[name] = "a batch_input"
        if batch_input.source not in ragged:
            return (
                f"batch_input {name!r}: source_input {batch_input.source!r} is not an input "
                f"with allow_ragged_batch = true"
            )
    declared = {spec.name: spec for spec in config.output}
    for batch_output in config.batch_output:
        source = batch_output.source_input[0]
        if source not in ragged:
            return (
                f"batch_output: source_input {source!r} is not an input with "
                f"allow_ragged_batch = true"
            )
        for name in batch_output.target_name:
            out = declared.get(name)
            if out is None:
                return f"batch_output: target_name {name!r} is not a declared output"
            if out.unpad_like not in (None, source):
                return (
                    f"output {name!r}: unpad_like = {out.unpad_like!r} contradicts "
                    f"batch_output's source_input {source!r}"
                )
    return None


def scatter_sources(batch_outputs: Sequence[BatchOutputSpec]) -> dict[str, str]:
    """Output name -> the ragged input whose lengths split it (``[[batch_output]]``)."""
    return {name: spec.source_input[0] for spec in batch_outputs for name in spec.target_name}
