"""Per-request parameters a model declares (``[[request_parameter]]`` in
config.toml) and the one strict check of a value against its declaration,
shared by the config's defaults and every request's values (``wire.validate``).

    [[request_parameter]]
    name = "normalize"        # the forward's keyword argument
    type = "bool"             # bool | int | float | string
    default = true            # none: every request must give it

A request's value reaches ``forward`` as one value per row of the batch: a
1-D tensor on the model's device for ``int`` (int64) and ``float``
(float32), a list for ``bool`` and ``string`` (docs/model-repository.md).
"""

from __future__ import annotations

import keyword
import math
import reprlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Request parameters the server reads itself (either protocol, or Triton's):
# they keep their meaning and a model may not declare them.
RESERVED_PARAMETERS = frozenset(
    {
        "timeout",
        "timeout_ms",
        "priority",
        "binary_data_output",
        "binary_data",
        "binary_data_size",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "headers",
        "classification",
        "shared_memory_region",
        "shared_memory_byte_size",
        "shared_memory_offset",
    }
)
INT64 = (-(1 << 63), (1 << 63) - 1)
FLOAT32_MAX = 3.4028234663852886e38
DEFAULT_STRING_LENGTH = 256
# Bound on a declared max_length: a string parameter is a setting, not a payload.
MAX_STRING_LENGTH = 1 << 16

ParameterType = Literal["bool", "int", "float", "string"]
Value = bool | int | float | str


class RequestParameterSpec(BaseModel):
    """One ``[[request_parameter]]``: a value each request may (or, without a
    default, must) give, passed to ``forward`` row by row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        min_length=1, description="The request's parameters key; the forward's keyword argument."
    )
    type: ParameterType = Field(
        description="bool and string reach forward as a list per batch; int and float as a "
        "1-D int64 / float32 tensor on the model's device."
    )
    default: Value | None = Field(
        None,
        description="The value of a request that gives none; unset: the parameter is required.",
    )
    max_length: int = Field(
        DEFAULT_STRING_LENGTH,
        ge=1,
        le=MAX_STRING_LENGTH,
        description="string: the longest value accepted, in characters.",
    )

    @field_validator("name")
    @classmethod
    def _usable_name(cls, value: str) -> str:
        if not value.isidentifier() or keyword.iskeyword(value):
            raise ValueError(f"{value!r} is not a Python identifier (it is a keyword argument)")
        if value in RESERVED_PARAMETERS:
            raise ValueError(
                f"{value!r} is reserved by the server (parameters.{value} keeps its meaning)"
            )
        return value

    @model_validator(mode="after")
    def _default_fits(self) -> RequestParameterSpec:
        if self.default is not None:
            problem = check_value(self, self.default)
            if problem is not None:
                raise ValueError(f"request parameter {self.name!r}: default {problem}")
        return self

    @property
    def required(self) -> bool:
        return self.default is None

    @property
    def numeric(self) -> bool:
        """Passed to forward as a tensor (int64 or float32), not a list."""
        return self.type in ("int", "float")

    def describe(self) -> str:
        """What a value must be, for error messages."""
        return {
            "bool": "a boolean",
            "int": "an integer (int64)",
            "float": "a finite number (float32)",
            "string": f"a string of at most {self.max_length} characters",
        }[self.type]


def check_value(spec: RequestParameterSpec, value: Any) -> str | None:
    """None if ``value`` is a valid ``spec.type``, else what is wrong with it
    ("must be ..., got ..."). Strict: no bool for a number, no number for a
    bool, no string for anything else, no float for an int; a float must be
    finite and fit float32 (it becomes one), an int int64."""
    kind = spec.type
    if kind == "bool":
        ok = isinstance(value, bool)
    elif isinstance(value, bool):
        ok = False  # True is an int to Python, not a number to a caller
    elif kind == "int":
        ok = isinstance(value, int) and INT64[0] <= value <= INT64[1]
    elif kind == "float":
        ok = isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= FLOAT32_MAX
    else:
        ok = isinstance(value, str) and len(value) <= spec.max_length
    if ok:
        return None
    if kind == "string" and isinstance(value, str):
        return f"must be {spec.describe()}, got one of {len(value)}"
    return f"must be {spec.describe()}, got {reprlib.repr(value)}"
