"""A front end's request in the scheduler process, and what each of its
items is answered in.

``ReplySlot`` is the one thing a model's scheduler resolves for a front
end's item, in place of a future (a ``batching/reply.py`` ``Reply``), and
``ReplySlot.deliver`` the one way it is resolved: ``delivery.settle`` hands
it a batch's slots on this loop at once, so each front end gets the replies
the batch finished in one call, not one per request.

- A request of one item (most of them) is its slot alone
  (``one_item``): the slot is also what a cancel withdraws. Each
  object a request needs is paid for on the one process that caps a GPU.
- A request of several items is a ``RemoteRequest``, which collects its
  slots' results (``RemoteRequest.slots``) and is answered once all are in,
  or failed at its first failure.

A slot answers through its front end's ``Answerer`` (``hub.Connection``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tensorserve.batching.admission import Pending
from tensorserve.batching.batcher import Batcher
from tensorserve.batching.reply import ANSWERED, WAITING, Answer, Reply


class Answerer(Protocol):
    """A front end, as its requests answer it (``hub.Connection``)."""

    def reply_rows(self, rids: Sequence[int], rows: Sequence[dict[str, Any]]) -> None: ...

    def reply_many(self, replies: Sequence[tuple[int, Sequence[Any]]]) -> None: ...

    def fail(
        self,
        rid: int,
        exc: BaseException,
        *,
        admitted: bool = True,
        request_id: str | None = None,
    ) -> None: ...


class ReplySlot(Reply):
    """One item's answer: of a request of one item (``request`` None; the
    slot holds its queue entry, for a cancel), or of a ``RemoteRequest``."""

    __slots__ = ("batcher", "connection", "entry", "index", "request", "request_id", "rid")

    def __init__(self, request: RemoteRequest, index: int) -> None:
        self.state, self.index = WAITING, index
        self.request: RemoteRequest | None = request  # None: a request of one item
        self.connection, self.rid = request.connection, request.rid
        self.request_id = request.request_id
        self.batcher: Batcher | None = None  # a request of one item's: its queue
        self.entry: Pending | None = None

    @classmethod
    def deliver(cls, answers: Sequence[Answer]) -> None:
        """Answer a batch's slots, those still waited for. The requests each
        slot finished go to its front end in one call: the one-item requests
        whose row is a plain result as rows of one run
        (``Answerer.reply_rows``: a batch's rows all hold the same outputs),
        the rest in one ``reply_many``. A failure is answered on its own, as
        one failure alone would be."""
        finished: dict[Answerer, tuple[list[int], list[Any], list[tuple[int, list[Any]]]]] = {}
        waiting, answered = WAITING, ANSWERED  # locals: this runs for every item
        for entry, value, failed in answers:
            slot: ReplySlot = entry.future
            if slot.state != waiting:  # its caller left meanwhile
                continue
            slot.state = answered
            request = slot.request
            if request is None:
                slot.entry = None  # its entry holds it: no cycle to collect
                if failed:
                    slot.connection.fail(slot.rid, value, request_id=slot.request_id)
                    continue
                results = None
            elif failed:
                request.failed(value)
                continue
            elif not request.answered(slot.index, value):
                continue  # items of it are still to come
            else:
                results = None if len(request.results) == 1 else request.results
            replies = finished.get(slot.connection)
            if replies is None:
                finished[slot.connection] = replies = ([], [], [])
            if results is None and type(value) is dict:
                replies[0].append(slot.rid)
                replies[1].append(value)
            else:
                replies[2].append((slot.rid, results or [value]))
        for connection, (rids, rows, others) in finished.items():
            if rids:
                connection.reply_rows(rids, rows)
            if others:
                connection.reply_many(others)

    def withdraw(self) -> None:
        """Leave the queue now, if still in it (its caller left): a request
        of one item."""
        entry, self.entry = self.entry, None
        if entry is not None and self.batcher is not None:
            self.batcher.withdraw([entry])


def one_item(connection: Answerer, rid: int, request_id: str, batcher: Batcher) -> ReplySlot:
    """The slot of a request of one item, which is the request itself: no
    ``RemoteRequest``, no lists (its ``entry`` is set once queued)."""
    slot = ReplySlot.__new__(ReplySlot)
    slot.state, slot.request, slot.index = WAITING, None, 0
    slot.connection, slot.rid, slot.request_id = connection, rid, request_id
    slot.batcher, slot.entry = batcher, None  # entry: while queued or running
    return slot


class RemoteRequest:
    """One front end's request of several items in this process: its items'
    results as they come, answered once all are in (or at its first failure)."""

    __slots__ = (
        "batcher",
        "connection",
        "entries",
        "finished",
        "left",
        "request_id",
        "results",
        "rid",
    )

    def __init__(self, connection: Answerer, rid: int, items: int, request_id: str) -> None:
        self.connection, self.rid = connection, rid
        self.request_id = request_id  # its caller's: on the lines logged about it here
        self.results: list[Any] = [None] * items
        self.left = items
        self.entries: list[Pending] = []
        self.batcher: Batcher | None = None
        self.finished = False

    def slots(self) -> list[ReplySlot]:
        """A slot per item, in order."""
        return [ReplySlot(self, i) for i in range(len(self.results))]

    def answered(self, index: int, value: Any) -> bool:
        """Record an item's result; True if that finished the request (its
        caller replies with ``results``)."""
        self.results[index] = value
        self.left -= 1
        if self.left == 0 and not self.finished:
            self.finished = True
            # Nothing left to withdraw; and its entries hold its slots, which
            # hold it: a cycle that would keep its results (views of the
            # batch's outputs) alive until a full collection.
            self.entries = []
            return True
        return False

    def failed(self, exc: BaseException) -> None:
        if not self.finished:  # the first failure fails the request, as infer_many does
            self.finished = True
            self.connection.fail(self.rid, exc, request_id=self.request_id)
            self.withdraw()

    def withdraw(self) -> None:
        """Whatever is still queued leaves the queue now."""
        self.finished = True
        if self.batcher is not None:
            self.batcher.withdraw(self.entries)
        self.entries = []
