"""A front end's request in the scheduler process: ``RemoteItem`` (a
request of one item, most of them: its own future and its own request),
else ``RemoteRequest`` (its items' results as they come, answered once all
are in) and a ``ReplySlot`` per item (what the model's scheduler resolves
in place of a future)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensorserve.batching.admission import Outcome, Pending
from tensorserve.batching.batcher import Batcher

if TYPE_CHECKING:
    from tensorserve.frontends.hub import Connection


class _Slot:
    """What a model's scheduler calls on an item's future, for the two kinds
    below, resolved on this loop in place of an ``asyncio.Future``: no
    future, no callback, no extra loop round per item."""

    __slots__ = ("_state",)
    _state: int  # 0 waiting, 1 done, 2 cancelled: each kind sets it first

    def done(self) -> bool:
        return self._state != 0

    def cancelled(self) -> bool:
        return self._state == 2

    def cancel(self) -> bool:
        if self._state:
            return False
        self._state = 2
        return True

    @staticmethod
    def deliver_many(outcomes: Sequence[Outcome]) -> None:
        """Resolve a batch's slots and ``RemoteItem``s at once
        (``batching/delivery.py`` calls this for outcomes whose futures are
        all of these two kinds): each connection then gets the replies the
        batch finished in one call, not one per request through three more.
        The one-item requests whose row is a plain result go as rows of one
        run (``Connection.reply_rows``): a batch's rows all hold the same
        outputs."""
        finished: dict[Connection, tuple[list[int], list[Any], list[tuple[int, list[Any]]]]] = {}
        for entry, value, failed in outcomes:
            future: RemoteItem | ReplySlot = entry.future  # type: ignore[assignment]
            if future._state:  # its caller left meanwhile
                continue
            if failed:  # answered on its own, as one failure alone would be
                future.set_exception(value)
                continue
            future._state = 1
            if type(future) is RemoteItem:
                future.entry = None
                rid, connection, results = future.rid, future.connection, None
            else:
                request = future._request  # type: ignore[union-attr]
                if not request.answered(future._index, value):  # type: ignore[union-attr]
                    continue  # items of it are still to come
                rid, connection = request.rid, request.connection
                results = None if len(request.results) == 1 else request.results
            replies = finished.get(connection)
            if replies is None:
                finished[connection] = replies = ([], [], [])
            if results is None and type(value) is dict:
                replies[0].append(rid)
                replies[1].append(value)
            else:
                replies[2].append((rid, results or [value]))
        for connection, (rids, rows, others) in finished.items():
            if rids:
                connection.reply_rows(rids, rows)
            if others:
                connection.reply_many(others)


class ReplySlot(_Slot):
    """One item's answer, of a request of several items (``RemoteRequest``)."""

    __slots__ = ("_index", "_request")

    def __init__(self, request: RemoteRequest, index: int) -> None:
        self._request, self._index, self._state = request, index, 0

    def set_result(self, value: Any) -> None:
        self._state = 1
        request = self._request
        if request.answered(self._index, value):
            request.connection.reply(request.rid, request.results)

    def set_exception(self, exc: BaseException) -> None:
        self._state = 1
        self._request.failed(exc)


class RemoteRequest:
    """One front end's request in this process: its items' results as they
    come, answered once all are in (or at its first failure)."""

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

    def __init__(self, connection: Connection, rid: int, items: int, request_id: str) -> None:
        self.connection, self.rid = connection, rid
        self.request_id = request_id  # its caller's: on the lines logged about it here
        self.results: list[Any] = [None] * items
        self.left = items
        self.entries: list[Pending] = []
        self.batcher: Batcher | None = None
        self.finished = False

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


class RemoteItem(_Slot):
    """A front end's request of one item in this process: the future its
    model's scheduler resolves (``_Slot``'s methods) and the request a
    cancel withdraws (``RemoteRequest.withdraw``), as one object. Most
    requests are one item, and each object a request needs here is paid
    for on the one process that caps a GPU: a ``RemoteRequest``, its
    results and entries lists and a ``ReplySlot`` would be four."""

    __slots__ = ("batcher", "connection", "entry", "request_id", "rid")

    def __init__(self, connection: Connection, rid: int, request_id: str, batcher: Batcher) -> None:
        self.connection, self.rid, self.request_id = connection, rid, request_id
        self.batcher, self._state = batcher, 0
        self.entry: Pending | None = None  # while queued or running

    def set_result(self, value: Any) -> None:
        self._state, self.entry = 1, None  # its entry holds it: no cycle to collect
        self.connection.reply(self.rid, [value])

    def set_exception(self, exc: BaseException) -> None:
        self._state, self.entry = 1, None
        self.connection.fail(self.rid, exc, request_id=self.request_id)

    def withdraw(self) -> None:
        """Leave the queue now, if still in it (its caller left)."""
        entry, self.entry = self.entry, None
        if entry is not None:
            self.batcher.withdraw([entry])
