"""Check one caller's item against the model's inputs *before* it joins a queue,
so a bad item is that caller's 400 and never a failed batch.

Every error message names the item index and the feature. Each rule has one
function that every protocol calls: ``shape_problem`` (rank, variable lengths,
fixed sizes; the OIP codec also calls it on a whole request's shape, to say
what is wrong in the request's own axis numbers), ``check_range`` (an input's
``min_value`` / ``max_value``) and ``priority_level`` (the OIP codec calls
``check_priority``, its first half, while decoding).
"""

from __future__ import annotations

import math
import reprlib
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeGuard

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import DEFAULT_MAX_LENGTH, VARIABLE, DynamicBatching, InputSpec
from tensorserve.repository.parameters import RequestParameterSpec, check_value
from tensorserve.repository.value_bounds import values_problem
from tensorserve.settings import DEFAULT_BYTES_LIMITS, BytesLimits
from tensorserve.tensors.bytes_tensor import bytes_array, check_byte_sizes, check_utf8
from tensorserve.tensors.dtypes import by_torch, from_torch
from tensorserve.tensors.wire_tensor import WireTensor
from tensorserve.wire.lists import array_from_list

if TYPE_CHECKING:
    import torch


class ShapeProblem(NamedTuple):
    """What is wrong with a shape; each caller words it in its own terms."""

    kind: Literal["rank", "length", "size"]
    axis: int  # in the shape's own numbering (-1 for a wrong rank)
    got: int  # the rank, or the axis's extent
    expected: list[int]  # the shape wanted, batch axis (-1) first when batched
    limit: int  # the longest a variable axis may be


def shape_problem(
    shape: Sequence[int], spec: InputSpec, *, batched: bool = False
) -> ShapeProblem | None:
    """The one shape rule, or None when ``shape`` keeps it: the declared rank,
    each variable axis between 1 and ``max_length``, each fixed axis its size.
    ``batched``: the shape has a leading batch axis, not checked here (the
    request's item count is checked against ``max_items``)."""
    expected = ([VARIABLE] if batched else []) + spec.shape
    limit = spec.max_length or DEFAULT_MAX_LENGTH
    if len(shape) != len(expected):
        return ShapeProblem("rank", -1, len(shape), expected, limit)
    for axis in range(int(batched), len(shape)):
        got, want = shape[axis], expected[axis]
        if want == VARIABLE:
            if not 1 <= got <= limit:
                return ShapeProblem("length", axis, got, expected, limit)
        elif got != want:
            return ShapeProblem("size", axis, got, expected, limit)
    return None


def most_values(spec: InputSpec) -> int:
    """The most values one item's ``spec`` input may hold: its shape, each
    variable axis at its ``max_length``. What the decoders bound a body by
    before they build its elements."""
    limit = spec.max_length or DEFAULT_MAX_LENGTH
    return math.prod(limit if d == VARIABLE else d for d in spec.shape)


def validate_tensor(
    value: np.ndarray | Any,
    spec: InputSpec,
    where: str,
    bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
) -> np.ndarray:
    dt = spec.dt
    if dt.is_bytes:
        array = _bytes_input(value, where, bytes_limits)
        if spec.utf8:
            check_utf8(array, where)
    else:
        array = _numeric_input(value, spec, where)
    problem = shape_problem(array.shape, spec)
    if problem is None:
        if spec.min_value is not None or spec.max_value is not None:
            check_range(array, spec, where)
        return array
    kind, axis, got, _, limit = problem
    if kind == "rank":
        message = (
            f"expected {len(spec.shape)} dimension(s) with shape {spec.shape}, "
            f"got shape {list(array.shape)}"
        )
    elif kind == "length":
        message = f"axis {axis} has length {got}; it must be between 1 and {limit}"
    else:
        message = f"axis {axis} has size {got}, expected {spec.shape[axis]} (shape {spec.shape})"
    raise InvalidInput(f"{where}: {message}")


def _bytes_input(value: Any, where: str, limits: BytesLimits) -> np.ndarray:
    """A bytes input: a typed bytes tensor, an object (or numpy string) array
    in-process, or a plain list of bin / str; each element at most
    ``limits.element`` bytes long, all together at most ``limits.item``."""
    if isinstance(value, WireTensor):
        if value.dtype != "bytes":
            raise InvalidInput(f"{where}: dtype {value.dtype} does not match the declared bytes")
        array = value.array
    elif _is_torch_tensor(value) or (
        isinstance(value, np.ndarray) and value.dtype.kind not in "OSU"
    ):
        raise InvalidInput(f"{where}: dtype {value.dtype} does not match the declared bytes")
    else:
        array = bytes_array(value, where)  # checks every element is bytes (or str)
    check_byte_sizes(array, limits.element, limits.item, where)
    return array


def _numeric_input(value: Any, spec: InputSpec, where: str) -> np.ndarray:
    dt = spec.dt
    if _is_torch_tensor(value):  # in-process callers
        known = by_torch(value.dtype)
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
        return value.array
    return array_from_list(value, dt, where, what="the list", v2=False)


def _is_torch_tensor(value: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a torch tensor, without importing torch: a
    process that never imported it (a front end) has none."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def check_range(array: np.ndarray, spec: InputSpec, where: str) -> None:
    """The one range rule (``repository.value_bounds``): every value of an
    item within the input's ``min_value`` / ``max_value``, else
    ``InvalidInput`` naming the input, the offending value and the bound."""
    problem = values_problem(array, spec.dt, spec.min_value, spec.max_value)
    if problem is not None:
        raise InvalidInput(f"{where}: {problem}")


def validate_item(
    item: Mapping[str, Any],
    inputs: Sequence[InputSpec],
    index: int,
    bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
) -> dict[str, np.ndarray]:
    """Return the item's arrays in the declared dtypes, or raise InvalidInput.
    A bytes input's elements are bounded by ``bytes_limits`` (the server's)."""
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
            item[spec.name], spec, f"item {index}, feature {spec.name!r}", bytes_limits
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


def check_priority(priority: Any) -> int | None:
    """A request's ``priority`` parameter: None (absent) or a non-negative
    integer, else ``InvalidInput``. The first half of ``priority_level``."""
    if priority is None or (
        isinstance(priority, int) and not isinstance(priority, bool) and priority >= 0
    ):
        return priority
    raise InvalidInput(
        f"parameters.priority must be a non-negative integer, got {reprlib.repr(priority)}"
    )


def priority_level(priority: Any, batching: DynamicBatching, model: str) -> int:
    """The one priority rule: a request's ``priority`` as the batcher's level,
    1 (highest) .. N with ``priority_levels = N``, 0 or None meaning the
    model's default level; 0 for a model without levels (any non-negative
    integer is accepted)."""
    priority = check_priority(priority)
    levels = batching.priority_levels
    if not levels:
        return 0
    if not priority:
        return batching.default_priority_level or levels
    if priority > levels:
        raise InvalidInput(
            f"parameters.priority must be 1 (highest) to {levels} for model {model!r} "
            f"(0: its default level), got {priority}"
        )
    return priority
