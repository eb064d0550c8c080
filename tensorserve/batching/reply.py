"""``Reply``: what a queued item's caller waits on when it is not a future.

A caller in a thread waits on a ``concurrent.futures.Future``, one on a loop
on an ``asyncio.Future``. A caller that answers many requests from one loop
(the scheduler process's end of the front ends, ``frontends/requests.py``)
gives each item a ``Reply`` instead: no future, no callback, no extra loop
round per item, and a whole batch's replies resolved in one call.

The scheduler treats a ``Reply`` as it treats a future: it asks ``done`` and
``cancelled``, a caller that leaves calls ``cancel``; and it answers it only
through ``delivery.settle``, which hands the replies of one batch, on their
own loop, to their class's ``deliver`` at once. ``deliver`` is the one way a
reply is resolved; ``set_result`` and ``set_exception`` are that, for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

# A reply's state: waiting, then answered or cancelled, once.
WAITING, ANSWERED, CANCELLED = 0, 1, 2


class Queued(Protocol):
    """A queued item as ``deliver`` gets it (``admission.Pending``): its
    ``future`` is the reply."""

    @property
    def future(self) -> Any: ...


# (the queued item, its result or exception, failed): an ``admission.Outcome``,
# handed over as it is (no tuple made per item).
Answer = tuple[Queued, Any, bool]


class Reply:
    """The future-like part the scheduler sees; subclasses say how a batch's
    replies reach their callers (``deliver``)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = WAITING

    def done(self) -> bool:
        return self.state != WAITING

    def cancelled(self) -> bool:
        return self.state == CANCELLED

    def cancel(self) -> bool:
        if self.state != WAITING:
            return False
        self.state = CANCELLED
        return True

    def set_result(self, value: Any) -> None:
        type(self).deliver([(_Alone(self), value, False)])

    def set_exception(self, exc: BaseException) -> None:
        type(self).deliver([(_Alone(self), exc, True)])

    @classmethod
    def deliver(cls, answers: Sequence[Answer]) -> None:
        """Answer each item whose reply (of this class) still waits, on the
        replies' loop; mark each answered."""
        raise NotImplementedError


class _Alone:
    """A reply answered by itself, as ``deliver`` takes it."""

    __slots__ = ("future",)

    def __init__(self, future: Reply) -> None:
        self.future = future
