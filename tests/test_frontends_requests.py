"""A front end's request in the scheduler process (``frontends/requests.py``):
answered once all its items are in, failed at the first failure, and, once
over, freed by reference counting: a cycle between the request, its
entries and their slots would hold its results (views of a whole batch's
outputs: pinned host memory on a GPU) until a full collection."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tensorserve.batching.admission import Outcome, Pending
from tensorserve.batching.delivery import settle
from tensorserve.errors import ModelFailure
from tensorserve.frontends.requests import RemoteRequest, ReplySlot
from tensorserve.frontends.requests import one_item as RemoteItem


class Answers:
    """What the connection was told, in order."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, list[Any]]] = []
        self.failures: list[tuple[int, str]] = []
        self.calls = 0  # of reply_many and reply_rows
        self.rows: list[list[int]] = []  # each reply_rows call's request ids

    def reply(self, rid: int, results: list[Any]) -> None:
        self.replies.append((rid, results))

    def reply_many(self, replies: list[tuple[int, list[Any]]]) -> None:
        self.calls += 1
        self.replies.extend(replies)

    def reply_rows(self, rids: list[int], rows: list[Any]) -> None:
        self.calls += 1
        self.rows.append(rids)
        self.replies.extend((rid, [row]) for rid, row in zip(rids, rows))

    def fail(self, rid: int, exc: BaseException, **_: Any) -> None:
        self.failures.append((rid, str(exc)))


class Queue:
    """The model's batcher as a request sees it: which items were withdrawn
    (not the entries: a real batcher keeps none it withdrew)."""

    def __init__(self) -> None:
        self.withdrawn: list[Any] = []

    def withdraw(self, entries: list[Pending]) -> None:
        for entry in entries:  # as Batcher.withdraw: what is unanswered is cancelled
            entry.future.cancel()
        self.withdrawn.extend(entry.item for entry in entries)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees anything meanwhile."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def queued(
    answers: Answers, items: int, rid: int = 7, loop: asyncio.AbstractEventLoop | None = None
) -> tuple[RemoteRequest, list[ReplySlot], Queue]:
    request = RemoteRequest(answers, rid, items, f"caller-{rid}")  # type: ignore[arg-type]
    slots = [ReplySlot(request, i) for i in range(items)]
    request.entries = [
        Pending(item=i, volume=1, future=slot, loop=loop, enqueued=0.0, deadline=None)
        for i, slot in enumerate(slots)
    ]
    request.batcher = queue = Queue()  # type: ignore[assignment]
    return request, slots, queue


def queued_item(
    answers: Answers, rid: int, loop: asyncio.AbstractEventLoop | None = None
) -> tuple[RemoteItem, Queue]:
    """A one-item request as a run admits it: one object, its own future."""
    queue = Queue()
    item = RemoteItem(answers, rid, f"caller-{rid}", queue)  # type: ignore[arg-type]
    future: Any = item  # the future-like object the scheduler resolves
    item.entry = Pending(item=rid, volume=1, future=future, loop=loop, enqueued=0.0, deadline=None)
    return item, queue


def test_a_one_item_request_is_answered_once_and_leaves_nothing_for_the_collector(
    no_collector: None,
) -> None:
    answers = Answers()
    item, queue = queued_item(answers, 7)
    item.set_result({"out": np.full(2, 3)})
    assert [(rid, [r["out"].tolist() for r in rs]) for rid, rs in answers.replies] == [
        (7, [[3, 3]])
    ]
    assert item.done() and not item.cancel()  # answered: a late cancel changes nothing
    item.withdraw()
    assert queue.withdrawn == []
    del item
    assert gc.collect() == 0


def test_a_one_item_request_whose_caller_left_leaves_the_queue_once(no_collector: None) -> None:
    answers = Answers()
    item, queue = queued_item(answers, 8)
    item.withdraw()  # what a cancel from its front end does
    item.withdraw()
    assert queue.withdrawn == [8]
    assert item.cancelled() and item.entry is None
    failed, _ = queued_item(answers, 9)
    failed.set_exception(ModelFailure("row 0 is poisoned"))
    assert answers.failures == [(9, "row 0 is poisoned")] and failed.entry is None
    del item, failed
    assert gc.collect() == 0


def test_a_request_answered_whole_leaves_nothing_for_the_collector(no_collector: None) -> None:
    answers = Answers()
    request, slots, queue = queued(answers, 3)
    for i in (2, 0, 1):  # in any order: answered once all are in, in item order
        assert answers.replies == []
        slots[i].set_result({"out": np.full(2, i)})
    assert [(rid, [r["out"].tolist() for r in results]) for rid, results in answers.replies] == [
        (7, [[0, 0], [1, 1], [2, 2]])
    ]
    assert queue.withdrawn == []
    del request, slots
    assert gc.collect() == 0


def test_a_failed_request_withdraws_the_rest_and_leaves_nothing_for_the_collector(
    no_collector: None,
) -> None:
    answers = Answers()
    request, slots, queue = queued(answers, 3)
    slots[0].set_result({"out": np.zeros(2)})
    slots[1].set_exception(ModelFailure("row 1 is poisoned"))
    slots[2].set_result({"out": np.ones(2)})  # too late: the request has failed
    assert answers.failures == [(7, "row 1 is poisoned")]
    assert answers.replies == []
    assert queue.withdrawn == [0, 1, 2]
    del request, slots, queue
    assert gc.collect() == 0


async def test_a_batch_answers_each_connection_once_and_only_the_callers_still_waiting() -> None:
    """A batch's outcomes, settled on the loop its slots belong to, reach
    each connection in one call: the finished one-item requests as rows of
    one run, in batch order; a request with an item still to come, one
    whose caller left and one whose row failed are not among them (the
    failure is answered on its own, once); a request of two items, once
    whole, as a reply of its own."""
    loop = asyncio.get_running_loop()
    first, second = Answers(), Answers()
    one, _, _ = queued(first, 1, rid=1, loop=loop)
    two, _, _ = queued(first, 2, rid=2, loop=loop)  # its second item is in a later batch
    left, left_slots, _ = queued(first, 1, rid=3, loop=loop)
    poisoned, _, _ = queued(first, 1, rid=4, loop=loop)
    other, _, _ = queued(second, 1, rid=5, loop=loop)
    last, _, _ = queued(first, 1, rid=6, loop=loop)
    # One-item requests of a run are RemoteItems: the same batch mixes both kinds.
    run_item, _ = queued_item(first, 8, loop)
    run_left, _ = queued_item(first, 9, loop)
    run_poisoned, _ = queued_item(first, 10, loop)
    run_entries = [run_item.entry, run_left.entry, run_poisoned.entry]
    left_slots[0].cancel()
    run_left.withdraw()
    outcomes: list[Outcome] = [
        (one.entries[0], {"out": np.full(2, 1)}, False),
        (two.entries[0], {"out": np.full(2, 2)}, False),
        (left.entries[0], {"out": np.full(2, 3)}, False),
        (poisoned.entries[0], ModelFailure("row 3 is poisoned"), True),
        (other.entries[0], {"out": np.full(2, 5)}, False),
        (run_entries[0], {"out": np.full(2, 8)}, False),  # type: ignore[list-item]
        (run_entries[1], {"out": np.full(2, 9)}, False),  # type: ignore[list-item]
        (run_entries[2], ModelFailure("row 10 is poisoned"), True),  # type: ignore[list-item]
        (last.entries[0], {"out": np.full(2, 6)}, False),
    ]
    settle(outcomes)
    assert [(rid, [r["out"].tolist() for r in rs]) for rid, rs in first.replies] == [
        (1, [[1, 1]]),
        (8, [[8, 8]]),
        (6, [[6, 6]]),
    ]
    assert first.calls == 1 and first.rows == [[1, 8, 6]]
    assert first.failures == [(4, "row 3 is poisoned"), (10, "row 10 is poisoned")]
    assert run_item.entry is None and run_poisoned.entry is None  # no cycle left
    assert [(rid, [r["out"].tolist() for r in rs]) for rid, rs in second.replies] == [(5, [[5, 5]])]
    assert second.calls == 1
    settle([(two.entries[1], {"out": np.full(2, 7)}, False)])  # its last item: now it is whole
    assert first.replies[-1][0] == 2 and [r["out"][0] for r in first.replies[-1][1]] == [2, 7]
    settle(outcomes[:1])  # settled again (a race with a retry): nothing more is sent
    settle(outcomes[5:7])
    assert len(first.replies) == 4 and first.calls == 2


async def test_a_batch_of_futures_and_slots_answers_each_its_own_way_once() -> None:
    """``settle`` resolves an asyncio future itself and hands every reply
    slot of the batch to ``ReplySlot.deliver`` in one call: the one way a
    slot is answered (its ``set_result`` is that, for one)."""
    loop = asyncio.get_running_loop()
    answers = Answers()
    item, _ = queued_item(answers, 1, loop)
    other, _ = queued_item(answers, 2, loop)
    future: asyncio.Future[Any] = loop.create_future()
    plain = Pending(item=0, volume=1, future=future, loop=loop, enqueued=0.0, deadline=None)
    entries: list[Any] = [item.entry, plain, other.entry]
    settle([(e, {"out": np.full(2, i)}, False) for i, e in enumerate(entries)])
    assert future.result()["out"].tolist() == [1, 1]
    assert answers.calls == 1 and answers.rows == [[1, 2]]
    item.set_result({"out": np.zeros(2)})  # answered already: nothing more is sent
    assert answers.calls == 1 and item.done() and not item.cancelled()
