"""Check one caller's item against the model's inputs *before* it joins a queue,
so a bad item is that caller's 400 and never a failed batch.

Every error message names the item index and the feature.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import DEFAULT_MAX_LENGTH, VARIABLE, InputSpec
from tensorserve.repository.parameters import RequestParameterSpec, check_value
from tensorserve.tensors.dtypes import BY_TORCH, from_torch
from tensorserve.tensors.wire_tensor import WireTensor
from tensorserve.wire.lists import array_from_list


def validate_tensor(value: np.ndarray | Any, spec: InputSpec, where: str) -> np.ndarray:
    dt = spec.dt
    if isinstance(value, torch.Tensor):  # in-process callers
        known = BY_TORCH.get(value.dtype)
        if known is None:
            raise InvalidInput(
                f"{where}: torch dtype {value.dtype} does not match the declared {dt.name}"
            )
        value = WireTensor(known.name, from_torch(value.detach().cpu()))
    elif isinstance(value, np.ndarray):
        value = WireTensor(value.dtype.name, value)
    if isinstance(value, WireTensor):
        # Typed data is never silently cast: a mismatch is the caller's bug.
        if value.dtype != dt.name:
            raise InvalidInput(
                f"{where}: dtype {value.dtype} does not match the declared {dt.name}"
            )
        array = value.array
    else:
        array = array_from_list(value, dt, where, what="the list", v2=False)
    if array.ndim != len(spec.shape):
        raise InvalidInput(
            f"{where}: expected {len(spec.shape)} dimension(s) with shape {spec.shape}, "
            f"got shape {list(array.shape)}"
        )
    limit = spec.max_length or DEFAULT_MAX_LENGTH
    for axis, (got, want) in enumerate(zip(array.shape, spec.shape)):
        if want == VARIABLE:
            if not 1 <= got <= limit:
                raise InvalidInput(
                    f"{where}: axis {axis} has length {got}; it must be between 1 and {limit}"
                )
        elif got != want:
            raise InvalidInput(
                f"{where}: axis {axis} has size {got}, expected {want} (shape {spec.shape})"
            )
    return array


def validate_item(
    item: Mapping[str, Any], inputs: Sequence[InputSpec], index: int
) -> dict[str, np.ndarray]:
    """Return the item's arrays in the declared dtypes, or raise InvalidInput."""
    if not isinstance(item, Mapping):
        raise InvalidInput(f"item {index}: expected a map of feature name to tensor")
    declared = {spec.name for spec in inputs}
    unexpected = sorted(str(k) for k in item if k not in declared)
    if unexpected:
        raise InvalidInput(
            f"item {index}: unexpected feature(s) {', '.join(map(repr, unexpected))}; "
            f"the model takes {', '.join(repr(s.name) for s in inputs)}"
        )
    result: dict[str, np.ndarray] = {}
    for spec in inputs:
        if spec.name not in item:
            raise InvalidInput(f"item {index}: missing feature {spec.name!r}")
        result[spec.name] = validate_tensor(
            item[spec.name], spec, f"item {index}, feature {spec.name!r}"
        )
    return result


def validate_parameters(
    given: Mapping[str, Any] | None, specs: Sequence[RequestParameterSpec], model: str
) -> dict[str, Any]:
    """A request's values of the model's declared parameters, defaults filled
    in, or InvalidInput naming the parameter. Other keys are not looked at:
    the server's own (timeout, priority, ...) are read by the codecs, and
    unknown ones are ignored, as before parameters could be declared."""
    given = given or {}
    values: dict[str, Any] = {}
    for spec in specs:
        if spec.name not in given or given[spec.name] is None:
            if spec.required:
                raise InvalidInput(
                    f"parameters.{spec.name} is required by model {model!r}: {spec.describe()}"
                )
            values[spec.name] = spec.default
            continue
        value = given[spec.name]
        problem = check_value(spec, value)
        if problem is not None:
            raise InvalidInput(f"parameters.{spec.name} {problem}")
        values[spec.name] = value
    return values
