"""Delivery: settling callers' futures with their results, from any thread.

A ``concurrent.futures.Future`` (a caller in a thread) is resolved where the
result is. An ``asyncio.Future`` belongs to its loop and may only be resolved
on that loop's thread: its outcomes are grouped per loop and handed over with
one ``call_soon_threadsafe`` per batch and loop (not one wake-up of the loop
per item), or resolved at once when the code already runs on that loop (the
scheduler's own loop: every server request's). A ``Reply`` (``reply.py``,
the front ends' items in the scheduler process) is resolved by its class's
``deliver``, all of a batch's on one loop in one call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from concurrent import futures

from tensorserve.batching.admission import Outcome
from tensorserve.batching.reply import Reply


def settle(outcomes: Sequence[Outcome]) -> None:
    """Deliver every outcome to its caller, exactly once: the one way a
    queued item is answered. An entry already answered is skipped (its
    outcome recorded on it, ``Pending.answered``), as is a caller that left.
    Called on the scheduler's loop, its one owner, so the mark needs no lock."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for outcome in outcomes:
        entry = outcome[0]
        if entry.answered:
            continue
        entry.answered = True
        loop = entry.loop
        if loop is None:
            _deliver([outcome])
        else:
            by_loop.setdefault(loop, []).append(outcome)
    for loop, batch in by_loop.items():
        if asyncio._get_running_loop() is loop:
            _deliver(batch)  # the scheduler runs on this loop: no self-pipe round
            continue
        with contextlib.suppress(RuntimeError):  # the loop is closed: its callers are gone
            loop.call_soon_threadsafe(_deliver, batch)


def _deliver(outcomes: Sequence[Outcome]) -> None:
    # Replies (batching/reply.py) go to their class's ``deliver``, a batch's
    # at once; futures are resolved one by one.
    replies: dict[type[Reply], list[Outcome]] = {}
    kind: type[Reply] | None = None  # the last reply's, whose list is ``answers``
    answers: list[Outcome] = []
    for outcome in outcomes:
        entry, value, failed = outcome
        future = entry.future
        if isinstance(future, Reply):
            if type(future) is not kind:
                kind = type(future)
                answers = replies.setdefault(kind, [])
            answers.append(outcome)
            continue
        # A caller that gave up (timeout, disconnect) may have cancelled meanwhile.
        if future.done():
            continue
        try:
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)
        except (asyncio.InvalidStateError, futures.InvalidStateError):  # pragma: no cover
            pass  # raced with cancel(): the caller has left, nothing to deliver
    for kind, answers in replies.items():
        kind.deliver(answers)
