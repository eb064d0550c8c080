"""One tensor of a model's ``config.toml``: its name, dtype and shape, and
what an input (padding, bounds, text, packing) or an output (un-padding)
adds. Below ``config`` so that the modules that judge tensors
(``output_rules``, ``value_bounds``, ``ragged_config``) need no import of
the whole model's schema.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from tensorserve.repository.value_bounds import bounds_problem
from tensorserve.tensors.dtypes import DTYPES, DType

VARIABLE = -1


class _Strict(BaseModel):
    # Typos in config.toml are errors, not silently ignored keys.
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    name: str = Field(min_length=1, description="Feature name; the model's keyword argument.")
    dtype: str = Field(
        description="numpy dtype name, bfloat16, or bytes (KServe v2 BYTES: forward gets a "
        "numpy object array of bytes)."
    )
    shape: list[int] = Field(description="Per-item shape without the batch dim; -1 = variable.")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; expected one of {', '.join(DTYPES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d == 0 or d < VARIABLE for d in value):
            raise ValueError(f"every dimension must be positive or -1, got {value}")
        return value

    @property
    def dt(self) -> DType:
        return DTYPES[self.dtype]

    @property
    def variable_axes(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.shape) if d == VARIABLE)


class InputSpec(TensorSpec):
    pad_value: float | int | bool = Field(
        0, description='Value this feature is padded with (a bytes feature: always b"").'
    )
    max_length: int | None = Field(
        None, ge=1, description="Upper bound on every variable axis (default: server's limit)."
    )
    # Strict: a number, not true (1) nor a string.
    min_value: StrictInt | StrictFloat | None = Field(
        None,
        description="Smallest value an item may hold (integer and float inputs): a smaller "
        "one is that caller's 400, checked before it is queued (unset: no bound).",
    )
    max_value: StrictInt | StrictFloat | None = Field(
        None,
        description="Largest value an item may hold, e.g. an embedding's vocab_size - 1: a "
        "larger one is that caller's 400, never an out-of-range index in a batch.",
    )

    utf8: bool = Field(
        False,
        description="A bytes input whose every element must be UTF-8 text (a tokenizer's): "
        "an element that is not is that caller's 400, naming the input, before it is queued.",
    )
    allow_ragged_batch: bool = Field(
        False,
        description="Pack this input (Triton's ragged batching): the batch's items are "
        "concatenated along their one -1 axis, with no batch dimension, and never padded.",
    )

    @model_validator(mode="after")
    def _bounds_fit(self) -> InputSpec:
        problem = bounds_problem(self.dt, self.min_value, self.max_value)
        if problem is None and self.utf8 and not self.dt.is_bytes:
            problem = f"utf8 = true is for a bytes input, not {self.dtype}"
        if problem is not None:
            raise ValueError(f"input {self.name!r}: {problem}")
        return self

    @property
    def warmup_value(self) -> int | float | bytes:
        """What a synthetic item (warm-up, a timing run) holds: 1, or the
        nearest value the input accepts (a warm-up request is validated as
        any request is); b"1" for bytes."""
        if self.dt.is_bytes:
            return b"1"
        value: int | float = 1
        if self.min_value is not None:
            value = max(value, self.min_value)
        if self.max_value is not None:
            value = min(value, self.max_value)
        return value


class OutputSpec(TensorSpec):
    unpad_like: str | None = Field(
        None,
        description="Input whose variable axes, in order, give this output's variable axes. "
        "Defaults to the first input with variable axes.",
    )
    ragged: bool = Field(
        False,
        description="The model returns this output as a list of one tensor per row, each its "
        "own length (a tokenizer's ids); each row is returned as it is. Needs a -1 axis; "
        "no unpad_like.",
    )

    @property
    def variable_length(self) -> bool:
        """Its rows may differ in length from item to item (a -1 axis)."""
        return any(d == -1 for d in self.shape)
