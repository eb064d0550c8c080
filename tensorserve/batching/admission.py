"""Admission and selection: the queue of one model, as plain data.

No threads, no locks, no clocks of its own: the scheduler holds its lock
around every call and passes ``now`` in, so all of it is unit-tested with
made-up times (tests/test_admission.py).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from tensorserve.batching.drain import DrainRate
from tensorserve.batching.policy import BatchPolicy, FifoPolicy, Waiting
from tensorserve.batching.reply import Reply
from tensorserve.batching.stats import RequestTally
from tensorserve.batching.target import LatencyTarget
from tensorserve.errors import DeadlineExceeded, RequestTooLarge, ServerBusy, WouldMissTarget

# How far into the queue a policy looks (a multiple of max_batch_size): enough
# to find items of similar length, bounded so selection stays cheap.
WINDOW_BATCHES = 16
# With a latency target, a shorter look: the policy takes the oldest item
# once it is overdue, but fills the batch from anywhere in its window, so an
# item in a 16-batch window can be overtaken for 16 batches, and the target's
# predicted wait (FIFO through the queue ahead) is off at the tail (measured
# on the tagger at 1.5x: server p99 184 ms against a 150 ms target).
TARGET_WINDOW_BATCHES = 1
RETRY_AFTER_S = (1.0, 60.0)  # the bounds of a refusal's Retry-After, in seconds
# The parameters of an item whose model declares none: one shared empty map.
NO_PARAMETERS: Mapping[str, Any] = MappingProxyType({})


@dataclass
class BatcherOptions:
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    dispatch: str = "eager"  # "eager" | "timer"
    policy: BatchPolicy = field(default_factory=FifoPolicy)
    max_queue_size: int = 4096
    max_batch_elements: int | None = None  # hard cap on one padded batch's elements
    # Faults (batching.recovery, batching.watchdog): re-run a failed batch in
    # halves; the longest one batch may run (None: off; "auto": see watchdog.py).
    split_failed_batches: bool = True
    watchdog_s: float | str | None = "auto"
    # Triton's priority levels: 0 = none; else Pending.priority is 1 (highest)..N.
    priority_levels: int = 0
    # The p99 latency to keep (batching.target); None: no target, today's batching.
    target_p99_ms: float | None = None

    def __post_init__(self) -> None:
        if self.dispatch not in ("eager", "timer"):
            raise ValueError(f"dispatch must be 'eager' or 'timer', not {self.dispatch!r}")
        if self.max_queue_delay_ms < 0:
            raise ValueError("max_queue_delay_ms must be >= 0")
        self.max_batch_size = max(1, self.max_batch_size)


def retry_after_s(seconds: float | None) -> float:
    """The ``Retry-After`` of a refusal, from the seconds until there is room
    (None: not yet measured), clamped to ``RETRY_AFTER_S``."""
    low, high = RETRY_AFTER_S
    return low if seconds is None else min(high, max(low, seconds))


@dataclass(eq=False, slots=True)
class Pending:
    """One queued item and the future its caller waits on."""

    item: Any
    volume: int  # padded-size proxy, for length-aware policies
    future: Future | asyncio.Future[Any] | Reply
    loop: asyncio.AbstractEventLoop | None  # set for asyncio futures
    enqueued: float  # time.monotonic()
    deadline: float | None
    reruns: int = 0  # times sent again whole because its worker died before running it
    crashes: int = 0  # batches it was in whose worker died running them (or hung)
    priority: int = 0  # its priority level: 1 is the highest (0: no levels)
    # Its request's values of the model's declared parameters (shared by the
    # request's items), passed to forward in its row: they travel with the
    # entry, so a batch split in recovery keeps each row's values.
    parameters: Mapping[str, Any] = field(default_factory=lambda: NO_PARAMETERS)
    trace: Any = None  # its request's trace context, when traced (batching/tracer.py)
    # Shared by the items of a request of several, which Triton's statistics
    # count once (batching/stats.py); None for a one-item request.
    request: RequestTally | None = None
    # Set by ``delivery.settle``, the one place a caller is answered: an entry
    # answered once is never answered again nor run again (a batch the
    # watchdog gave up on, whose forward raises later, is not retried).
    answered: bool = False
    queued: bool = False  # in its model's queue (AdmissionQueue), not withdrawn or taken
    out_of_memory: int = 0  # batches it was in that ran out of memory

    def caller_left(self) -> bool:
        """True if nobody waits for this item's answer any more: it was
        answered, or its caller cancelled or timed out. For a thread's future
        this also marks it running, so a later cancel() cannot race with the
        result."""
        if self.answered:
            return True
        if self.loop is None:
            future = cast(Future, self.future)  # a thread's caller: a concurrent future
            if future.running():  # claimed before: a batch retried (recovery)
                return False
            return future.done() or not future.set_running_or_notify_cancel()
        # Read from another thread: a stale "not yet" only runs an item whose
        # caller is about to leave; its result is then dropped.
        return self.future.done()


Outcome = tuple[Pending, Any, bool]  # (entry, result or exception, failed)


class AdmissionQueue:
    """The waiting items of one model, oldest first."""

    def __init__(
        self,
        options: BatcherOptions,
        padded_elements: Callable[[list[Any]], int],
        name: str = "model",
        target: LatencyTarget | None = None,
        largest_batch: int | None = None,
    ) -> None:
        self.options = options
        self._largest_batch = largest_batch  # padded elements any batch may reach (collate)
        self.target = target  # the latency target's controller, if the model has one
        self.name = name
        self._padded_elements = padded_elements  # of a batch of these items (collate)
        # Withdrawn entries stay in ``_waiting`` (``queued`` False) until the
        # front is read or they are half of it: a withdrawal costs O(1), not a
        # rebuild of the queue (4,096 one-item timeouts took 1.09 s of the loop).
        self._waiting: list[Pending] = []
        self._volumes: list[int] = []  # each one's volume: what the policy reads every batch
        self._withdrawn = 0  # entries of _waiting no longer queued
        # (deadline, admission number, entry) of the entries with a deadline,
        # soonest first: a full queue finds what expired without a scan.
        self._deadlines: list[tuple[float, int, Pending]] = []
        self._admitted = 0
        # How fast this queue drains, for Retry-After; with a target, the
        # target's, which predicts from the same estimate. Written only here.
        self.drain_rate = target.drain if target is not None else DrainRate()
        # A ceiling on padded elements learned from out-of-memory failures
        # (batching.recovery.MemoryCeiling), below the configured cap.
        self.memory_limit: int | None = None

    def __len__(self) -> int:
        return len(self._waiting) - self._withdrawn

    def make_room(self, incoming: int, now: float) -> list[Outcome]:
        """Before ``admit``: if ``incoming`` more items would not fit, the
        items past their deadline leave the queue; their outcomes
        (``DeadlineExceeded``), which the caller must settle."""
        if len(self) + incoming <= self.options.max_queue_size:
            return []
        return self.expired(now)

    def admit(self, entries: Sequence[Pending], now: float) -> None:
        """Queue a request's entries, all or none: ``RequestTooLarge`` if they
        could never fit, ``ServerBusy`` (with a retry estimate) if not now.
        Only live items count (``make_room`` first drops the expired)."""
        limit = self.options.max_queue_size
        if len(entries) > limit:
            raise RequestTooLarge(
                f"model {self.name!r}: a request of {len(entries)} items can never be queued "
                f"(the queue holds at most {limit}); send at most {limit} items per request"
            )
        if len(self) + len(entries) > limit:
            ahead = len(self) + len(entries) - limit
            raise ServerBusy(
                f"model {self.name!r} queue is full ({len(self)} items waiting, "
                f"limit {limit}); retry later",
                retry_after=retry_after_s(self.drain_rate.seconds_for(ahead)),
            )
        if self.target is not None:  # late: refused now, not queued (batching.target)
            self.refuse_if_late(entries[0].priority, len(entries))
        self._waiting.extend(entries)
        self._volumes.extend([entry.volume for entry in entries])
        for entry in entries:
            entry.queued = True
            if entry.deadline is not None:
                self._admitted += 1
                heapq.heappush(self._deadlines, (entry.deadline, self._admitted, entry))
        if len(self._deadlines) > 2 * len(self) + 64:  # taken entries' deadlines: forget them
            self._deadlines = [d for d in self._deadlines if d[2].queued]
            heapq.heapify(self._deadlines)

    def requeue(self, entries: Sequence[Pending]) -> None:
        """Put entries taken before back at the queue's head, oldest first (a
        crashed batch's cleared items: batching.recovery): they were admitted
        once, so no limit refuses them, and they ride in the next batch."""
        self._waiting[:0] = entries
        self._volumes[:0] = [entry.volume for entry in entries]
        for entry in entries:
            entry.queued = True
            if entry.deadline is not None:
                self._admitted += 1
                heapq.heappush(self._deadlines, (entry.deadline, self._admitted, entry))

    def refuse_if_late(self, level: int | None, items: int, count: bool = True) -> None:
        """``WouldMissTarget`` if ``items`` at priority ``level`` would miss the
        latency target. ``level`` None: the highest there is, which has the
        fewest ahead: a front end asks so before it reads a request, when
        refusing costs least. Reads the queue without the lock: a request's
        own admission asks again, under it."""
        assert self.target is not None
        if self.options.priority_levels:  # served before it: its level and higher (1 is highest)
            level = 1 if level is None else level
            ahead = sum(1 for p in self._waiting if p.priority <= level and p.queued)
        else:
            ahead = len(self)
        predicted = self.target.would_miss(ahead, items, count)
        if predicted is None:
            return
        target_s = self.target.target_s
        raise WouldMissTarget(
            f"model {self.name!r} would answer in ~{1000 * predicted:.0f} ms, over its "
            f"{1000 * target_s:.0f} ms latency target ({ahead} items ahead); retry later",
            retry_after=retry_after_s(predicted - target_s),
        )

    def batch_cap(self) -> int:
        """The most items the next batch may hold: the target's cap, if any."""
        cap = self.options.max_batch_size
        return min(cap, self.target.batch_cap) if self.target is not None else cap

    def _queue_delay_s(self) -> float:
        delay = self.options.max_queue_delay_ms
        return (min(delay, self.target.queue_delay_ms) if self.target is not None else delay) / 1000

    def expired(self, now: float) -> list[Outcome]:
        """Remove the waiting entries past their deadline; their outcomes
        (``DeadlineExceeded``: a caller with a deadline but no timer of its
        own, ``submit_many(timeout=...)``, is answered by this). O(log n) an
        item, from the deadlines' heap."""
        heap, found = self._deadlines, {}
        while heap and heap[0][0] < now:
            entry = heapq.heappop(heap)[2]
            if entry.queued:  # a requeued entry is in the heap twice: once in found
                found[id(entry)] = entry
        expired = list(found.values())
        self.withdraw(expired)
        return [(entry, self._deadline_error(), True) for entry in expired]

    def _deadline_error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"model {self.name!r}: item waited past its deadline")

    def withdraw(self, entries: Sequence[Pending]) -> None:
        """Remove these entries if they still wait (a caller that left, or
        timed out): their slots are free at once. O(1) an entry: each is
        marked, and leaves the list when the front is read (``_purge_front``)
        or once the withdrawn are half of it."""
        for entry in entries:
            if entry.queued:
                entry.queued = False
                self._withdrawn += 1
        if self._withdrawn and 2 * self._withdrawn >= len(self._waiting):
            self._purge_front(len(self._waiting))
        if not self._waiting:
            self.drain_rate.emptied()

    def _purge_front(self, live: int) -> None:
        """Drop the withdrawn entries from the front of the queue until
        ``live`` queued ones lead it (or the queue ends): the policy's window
        and the oldest item's age are read there. Each withdrawn entry is
        dropped once: O(1) an entry, amortised (and one move of the list)."""
        if not self._withdrawn:
            return
        waiting, end, kept = self._waiting, 0, 0
        while end < len(waiting) and kept < live:
            kept += waiting[end].queued
            end += 1
        front = [p for p in waiting[:end] if p.queued]
        if len(front) < end:
            self._withdrawn -= end - len(front)
            waiting[:end] = front
            self._volumes[:end] = [p.volume for p in front]

    def due_in(self, now: float, *, ahead: bool, closing: bool) -> float:
        """Seconds until a batch should be formed: 0 now, ``math.inf`` not
        until something changes (the batcher is notified).

        ``ahead``: the asking instance still has a batch on the device, so a
        batch that could still grow would only wait for the device (``take``
        still forms one the policy cut short of what is waiting)."""
        self._purge_front(1)
        if not self._waiting:
            return math.inf
        if len(self) >= self.batch_cap() or closing:
            return 0.0
        if ahead:
            return math.inf
        if self.options.dispatch == "eager":
            return 0.0
        return max(0.0, self._waiting[0].enqueued + self._queue_delay_s() - now)

    def take(self, now: float, *, leave_growing: bool = False) -> list[Pending]:
        """Remove the policy's choice from the queue (empty if nothing waits).
        With ``leave_growing``, take nothing if the policy would take
        everything waiting: a batch that could still grow."""
        if not self:
            return []
        positions = self._window(now)  # indices into the queue, in the order to prefer
        head = isinstance(positions, range)  # the queue's head: slices
        window = self._waiting[: len(positions)] if head else [self._waiting[i] for i in positions]
        volumes = self._volumes[: len(positions)] if head else [self._volumes[i] for i in positions]
        waiting = Waiting(volumes, window[0].enqueued <= now - self._queue_delay_s())
        chosen = sorted(self.options.policy.select(waiting, self.batch_cap()))
        chosen = self._within_element_cap(window, chosen)
        if leave_growing and len(chosen) == len(self):
            return []
        # From the back, in place: not a new list of all that stays.
        for position in sorted((positions[i] for i in chosen), reverse=True):
            del self._waiting[position], self._volumes[position]
        self.drain_rate.taken(len(chosen), now, len(self))
        taken = [window[i] for i in chosen]
        for entry in taken:
            entry.queued = False
        return taken

    def _window(self, now: float) -> Sequence[int]:
        """The queue positions the policy may choose from. Without priority
        levels: the oldest ``WINDOW_BATCHES`` batches' worth. With them: the
        highest levels first (oldest first within a level), cut at the level
        that fills one batch, so the policy groups lengths only within what
        priority allows. An item half-way to its deadline ranks above every
        level: a lower level cannot starve past its deadline."""
        opts = self.options
        if self.target is None:
            size = WINDOW_BATCHES * opts.max_batch_size
        else:
            size = TARGET_WINDOW_BATCHES * self.batch_cap()
        # Priority levels rank the whole queue: every withdrawn entry leaves.
        self._purge_front(len(self._waiting) if opts.priority_levels else size)
        if not opts.priority_levels:
            return range(min(size, len(self._waiting)))

        def rank(i: int) -> tuple[int, int]:
            p = self._waiting[i]
            urgent = p.deadline is not None and 2 * now >= p.enqueued + p.deadline
            return (0 if urgent else p.priority, i)

        # A heap, not a sort: the window is a small part of a long queue.
        ranked = heapq.nsmallest(size, range(len(self._waiting)), key=rank)
        if len(ranked) > opts.max_batch_size:
            boundary = rank(ranked[opts.max_batch_size - 1])[0]
            ranked = [i for i in ranked if rank(i)[0] <= boundary]
        return ranked

    def _within_element_cap(self, window: list[Pending], chosen: list[int]) -> list[int]:
        """Leave the newest items waiting until the padded batch fits the cap
        (items of very different shapes could otherwise pad to a huge tensor).
        One item always fits: its own size is bounded by validation."""
        caps = [c for c in (self.options.max_batch_elements, self.memory_limit) if c is not None]
        if not caps or (self._largest_batch or math.inf) <= min(caps):
            return chosen
        cap = min(caps)
        while len(chosen) > 1 and self._padded_elements([window[i].item for i in chosen]) > cap:
            chosen.pop()
        return chosen

    def drain(self) -> list[Pending]:
        """Remove and return everything waiting."""
        waiting = [p for p in self._waiting if p.queued]
        for entry in waiting:
            entry.queued = False
        self._waiting, self._volumes, self._withdrawn, self._deadlines = [], [], 0, []
        self.drain_rate.emptied()
        return waiting

    def expire(self, entries: Sequence[Pending], now: float) -> tuple[list[Pending], list[Outcome]]:
        """(live entries, outcomes for those past their deadline). Entries
        whose caller left are dropped: nobody waits for an answer."""
        live: list[Pending] = []
        expired: list[Outcome] = []
        for entry in entries:
            if entry.caller_left():
                continue
            if entry.deadline is not None and now > entry.deadline:
                expired.append((entry, self._deadline_error(), True))
                continue
            live.append(entry)
        return live, expired
