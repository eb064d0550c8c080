"""``[dynamic_batching]`` of a model's config.toml: how its items are queued
and batched (batching/admission.py turns it into ``BatcherOptions``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tensorserve.settings import BOUNDS, check_batch_tokens


class _Strict(BaseModel):
    # Typos in config.toml are errors, not silently ignored keys.
    model_config = ConfigDict(extra="forbid", frozen=True)


# Server-wide settings that are defaults, not overrides: a model's own value wins.
DEFAULTS_ONLY = frozenset({"target_p99_ms"})


class DynamicBatching(_Strict):
    max_queue_delay_ms: float = Field(
        5.0, **BOUNDS["max_queue_delay_ms"], description="Longest an item waits for company."
    )
    dispatch: Literal["eager", "timer"] = Field(
        "eager",
        description="eager: dispatch as soon as the model is idle; timer: wait until the batch "
        "is full or the oldest item has waited max_queue_delay_ms.",
    )
    policy: Literal["fifo", "length_aware"] = Field(
        "length_aware", description="Which waiting items form the next batch."
    )
    max_batch_tokens: int | Literal["auto"] = Field(
        "auto",
        description="Budget on padded volume per batch (batch x padded item size; a packed "
        "model's: the items' summed lengths). auto: on "
        "a CPU learnt from what the model's batches cost per element (batching/budget.py), on "
        "a GPU max_batch_size items of full length (repository/device_defaults.py); "
        "0: no budget.",
    )
    pad_to_multiple_of: int | None = Field(
        None,
        ge=1,
        description="Round each padded variable axis up to a multiple of this (never past "
        "max_length). Unset: none on a CPU; on a GPU 8, or 64 with compile = max-autotune "
        "(torch.compile captures a CUDA graph per shape), so it captures few; 1: never round.",
    )
    max_queue_size: int = Field(4096, ge=1, description="Items waiting beyond this get ServerBusy.")
    max_batch_elements: int = Field(
        1 << 26,
        ge=1,
        description="Hard cap on the elements one padded batch allocates (all features): "
        "items of very different shapes (a tall image and a wide one) are not batched "
        "into one huge padded tensor.",
    )
    priority_levels: int = Field(
        0,
        ge=0,
        le=16,
        description="Triton's priority levels: 0 = none; N: a request's parameters.priority "
        "is 1 (highest) .. N, and higher levels are taken first when a batch forms.",
    )
    default_priority_level: int = Field(
        0,
        ge=0,
        le=16,
        description="The level of a request that gives none (or 0); 0 = the lowest level.",
    )

    target_p99_ms: float | None = Field(
        None,
        **BOUNDS["target_p99_ms"],
        description="The p99 latency (admission to batch end) to keep: batch size and queue "
        "delay adapt to it, and a request the queue ahead would make late is refused at "
        "once (503 would_miss_target). Unset: no target.",
    )

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        # None in a config is "no budget", as before "auto" existed (from_function's
        # keyword); an override of None (from_repository, the settings) never gets
        # here: it keeps the config's own value.
        return 0 if value is None else check_batch_tokens(value)

    @model_validator(mode="after")
    def _priorities(self) -> DynamicBatching:
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level {self.default_priority_level} is not one of the "
                f"{self.priority_levels} priority_levels"
            )
        return self
