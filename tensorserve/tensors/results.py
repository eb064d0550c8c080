"""A forward's per-row output parameters, and one caller's result carrying
its share of them. Plain Python (no torch, no numpy at import): model code
and ``import tensorserve`` may use it for free.

    return tensorserve.WithParameters({"embedding": e}, {"norm": e.norm(dim=1)})

The runtime unwraps ``WithParameters`` (runtime/executor.py), the batcher
gives row ``i``'s values to the caller of row ``i`` (batching/results.py)
as a ``RowResult``, and each codec puts them in its response's
``parameters`` (docs/protocol.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WithParameters:
    """What a forward may return to send per-row output parameters back:
    ``outputs`` is anything a forward may return (a tensor, a dict of
    tensors, a list with one result per item), ``parameters`` maps a name to
    one value per row of the batch (a list, or a 1-D tensor or array) of
    booleans, integers, finite floats or strings."""

    outputs: Any
    parameters: Mapping[str, Any]


class RowResult(dict):  # type: ignore[type-arg]  # dict[str, np.ndarray]
    """One caller's un-padded outputs (output name -> array), with the output
    parameters the model returned for its row in ``parameters``. Only a
    model that returns ``WithParameters`` produces these; other results are
    plain dicts."""

    __slots__ = ("parameters",)

    def __init__(self, outputs: Mapping[str, Any], parameters: dict[str, Any]) -> None:
        super().__init__(outputs)
        self.parameters = parameters


def row_parameters(result: Mapping[str, Any]) -> dict[str, Any]:
    """A result's output parameters ({} for a plain result)."""
    return getattr(result, "parameters", None) or {}
