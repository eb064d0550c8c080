"""``[faults]``: what the batcher does when a batch fails (docs/reliability.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Faults(BaseModel):
    """What the batcher does when a batch fails (docs/reliability.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # a typo is an error

    split_failed_batches: bool = Field(
        True,
        description="Re-run a batch that raised in halves until the failure is pinned on the "
        "items that fail alone; every other caller gets its row (about 2*log2(B) extra runs).",
    )
    watchdog_ms: float | Literal["auto"] = Field(
        "auto",
        description="Longest one batch may run: past it a worker process is killed and "
        "replaced (the batch retried split); a thread's forward cannot be stopped, so its "
        "instance takes no batch until it returns (its callers are answered). auto: 50x the "
        "slowest batch, at least 30 s (off under torch.compile); 0: off.",
    )
    standby_worker: bool | Literal["auto"] = Field(
        "auto",
        description="isolation = 'process': keep a spare worker, so a crashed worker is "
        "replaced in milliseconds, not a model load (one spare, from the worker template, "
        "serves every model it loads). auto: on the CPU only (on a GPU a spare holds a CUDA "
        "context and its own copy of the weights).",
    )
    worker_template: bool = Field(
        True,
        description="isolation = 'process': fork workers from the server's one template "
        "process, which has imported torch and (on the CPU) loaded the model, so a new worker "
        "costs milliseconds, not a model load (runtime/template.py).",
    )

    @field_validator("watchdog_ms")
    @classmethod
    def _watchdog(cls, value: float | str) -> float | str:
        if value != "auto" and not (0 <= float(value) <= 86_400_000):
            raise ValueError(f"must be 'auto' or between 0 (off) and 86400000 ms, got {value}")
        return value
