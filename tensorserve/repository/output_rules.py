"""How an output comes back to its caller, checked when a config loads.

An output with variable axes is un-padded like an input (``unpad_like``, or
the first input with variable axes): that input needs as many variable axes.
A ``ragged = true`` output comes back from the model as one tensor per row,
each its own length (what a tokenizer returns), and each row is taken as it
is: it needs a -1 axis to be ragged on, and has nothing to un-pad like.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


# What the check reads of the config's specs (``config.InputSpec``,
# ``config.OutputSpec``, which call it: the config imports this, not back).
class WithAxes(Protocol):
    @property
    def variable_axes(self) -> tuple[int, ...]: ...


class Output(WithAxes, Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def ragged(self) -> bool: ...
    @property
    def unpad_like(self) -> str | None: ...


def output_problem(out: Output, source: str | None, inputs: Mapping[str, WithAxes]) -> str | None:
    """Why ``out`` cannot be returned as configured, as one sentence, or None.
    ``source``: the input it is un-padded like (``ModelConfig.unpad_source``)."""
    if out.ragged:
        if not out.variable_axes:
            return f"output {out.name!r}: ragged = true needs a -1 axis, got shape {out.shape}"
        if out.unpad_like is not None:
            return f"output {out.name!r}: ragged = true takes each row as it is; drop unpad_like"
        return None
    if not out.variable_axes:
        return None
    if source is None:
        return f"output {out.name!r} has variable axes but no input has any to follow"
    if source not in inputs:
        return f"output {out.name!r}: unpad_like names unknown input {source!r}"
    if len(inputs[source].variable_axes) < len(out.variable_axes):
        return (
            f"output {out.name!r} has {len(out.variable_axes)} variable axes but "
            f"input {source!r} has only {len(inputs[source].variable_axes)}"
        )
    return None
