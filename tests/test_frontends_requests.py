"""A front end's request in the scheduler process (``frontends/requests.py``):
answered once all its items are in, failed at the first failure, and, once
over, freed by reference counting: a cycle between the request, its
entries and their slots would hold its results (views of a whole batch's
outputs: pinned host memory on a GPU) until a full collection."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tensorserve.batching.admission import Pending
from tensorserve.errors import ModelFailure
from tensorserve.frontends.requests import RemoteRequest, ReplySlot


class Answers:
    """What the connection was told, in order."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, list[Any]]] = []
        self.failures: list[tuple[int, str]] = []

    def reply(self, rid: int, results: list[Any]) -> None:
        self.replies.append((rid, results))

    def fail(self, rid: int, exc: BaseException, **_: Any) -> None:
        self.failures.append((rid, str(exc)))


class Queue:
    """The model's batcher as a request sees it: which items were withdrawn
    (not the entries: a real batcher keeps none it withdrew)."""

    def __init__(self) -> None:
        self.withdrawn: list[Any] = []

    def withdraw(self, entries: list[Pending]) -> None:
        self.withdrawn.extend(entry.item for entry in entries)


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees anything meanwhile."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def queued(answers: Answers, items: int) -> tuple[RemoteRequest, list[ReplySlot], Queue]:
    request = RemoteRequest(answers, 7, items, "caller-7")  # type: ignore[arg-type]
    slots = [ReplySlot(request, i) for i in range(items)]
    request.entries = [
        Pending(item=i, volume=1, future=slot, loop=None, enqueued=0.0, deadline=None)
        for i, slot in enumerate(slots)
    ]
    request.batcher = queue = Queue()  # type: ignore[assignment]
    return request, slots, queue


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
