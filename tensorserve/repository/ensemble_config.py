"""``[[ensemble_scheduling.step]]``: the steps of a ``platform = "ensemble"``
model, in Triton's shape (docs/model-repository.md, "Ensembles").

    [[ensemble_scheduling.step]]
    model_name = "tokenizer"
    model_version = -1                       # -1: whichever version is served
    input_map = { TEXT = "TEXT" }            # the step model's input = an ensemble tensor
    output_map = { input_ids = "ids" }       # the step model's output -> an ensemble tensor

Only the schema lives here, with what one config can check alone. Whether
the steps fit together and fit their models (a model that exists, a tensor
that some step produces, dtypes and ranks that agree, no cycle) needs the
other models' configs: ``tensorserve/ensemble/graph.py`` checks it at load.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EnsembleStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field(min_length=1, description="The repository model this step runs.")
    model_version: int = Field(
        -1, ge=-1, description="The version it must be serving; -1: whichever it serves."
    )
    input_map: dict[str, str] = Field(
        min_length=1,
        description="The step model's input name -> the ensemble tensor it is given (an "
        "ensemble input, or another step's output_map value).",
    )
    output_map: dict[str, str] = Field(
        min_length=1,
        description="The step model's output name -> the ensemble tensor it becomes (an "
        "ensemble output, or a later step's input).",
    )

    @field_validator("input_map", "output_map")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not key or not name for key, name in value.items()):
            raise ValueError("every name in a map must be non-empty")
        return value


class EnsembleScheduling(BaseModel):
    """``[ensemble_scheduling]``: the steps, in any order (they run as a graph)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: list[EnsembleStep] = Field(
        min_length=1, description="The steps; each runs as soon as every tensor it takes exists."
    )
