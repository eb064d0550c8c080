"""``Batch``: one batch from the moment it leaves the queue until its
callers are answered, the record the scheduler, recovery, the watchdog and
the tracer all read (so none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorserve.batching.admission import Pending
from tensorserve.batching.collate import PaddedBatch
from tensorserve.batching.executor import BatchOutputs


@dataclass(eq=False)
class Batch:
    """One batch from the moment it leaves the queue until ``Scheduler._finish``."""

    entries: list[Pending]
    dispatched: float  # time.monotonic() when taken from the queue
    padded: PaddedBatch | None = None
    launched: Any = None
    outputs: BatchOutputs | None = None
    error: BaseException | None = None
    started: float = 0.0  # perf_counter() at launch
    seconds: float = 0.0
    instance: int = 0  # the instance it runs on
    overdue: bool = False  # the watchdog already acted on it
    # The watchdog gave up on it (or on the batch it was queued behind): its
    # callers are answered and it has left ``Scheduler.running``.
    abandoned: bool = False
    pad_seconds: float | None = None  # collate.pad's time (perf_counter), for the stats
    unpad_started: float = 0.0  # perf_counter() when un-padding began (for its span)
    unpad_seconds: float | None = None
    # A trial of a crash's suspects (batching.recovery.Trial): the crash's other
    # suspects, whose fate its outcome decides; None for an ordinary batch.
    rest: list[Pending] | None = None
