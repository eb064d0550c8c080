"""Admission and selection without threads or clocks: the queue is plain data,
and every time is made up."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.policy import Waiting, make_policy
from tensorserve.errors import DeadlineExceeded, ServerBusy


def entry(volume: int, enqueued: float = 0.0, deadline: float | None = None) -> Pending:
    return Pending(
        item=volume, volume=volume, future=Future(), loop=None, enqueued=enqueued, deadline=deadline
    )


def padded_elements(items: list[int]) -> int:
    """Items are their own lengths here: batch size x the longest."""
    return len(items) * max(items)


def make_queue(**options: object) -> AdmissionQueue:
    return AdmissionQueue(BatcherOptions(**options), padded_elements, name="toy")  # type: ignore[arg-type]


def test_a_request_is_admitted_whole_or_refused_whole() -> None:
    queue = make_queue(max_queue_size=4)
    queue.admit([entry(1), entry(2), entry(3)], 0.0)
    with pytest.raises(ServerBusy, match=r"model 'toy' queue is full \(3 items waiting, limit 4\)"):
        queue.admit([entry(4), entry(5)], 0.0)
    assert len(queue) == 3  # nothing of the refused request got in
    queue.admit([entry(4)], 0.0)
    assert len(queue) == 4


def test_eager_dispatch_is_due_at_once_and_an_empty_queue_never() -> None:
    queue = make_queue(dispatch="eager")
    assert queue.due_in(0.0, ahead=False, closing=False) == math.inf
    queue.admit([entry(1)], 0.0)
    assert queue.due_in(0.0, ahead=False, closing=False) == 0.0


def test_timer_dispatch_waits_for_the_oldest_items_delay_or_a_full_batch() -> None:
    queue = make_queue(dispatch="timer", max_queue_delay_ms=10, max_batch_size=3)
    queue.admit([entry(1, enqueued=100.0)], 0.0)
    assert queue.due_in(100.004, ahead=False, closing=False) == pytest.approx(0.006)
    assert queue.due_in(100.010, ahead=False, closing=False) == 0.0
    assert queue.due_in(100.004, ahead=False, closing=True) == 0.0  # closing: drain now
    queue.admit([entry(2, enqueued=100.001), entry(3, enqueued=100.002)], 0.0)
    assert queue.due_in(100.004, ahead=False, closing=False) == 0.0  # full


def test_ahead_of_a_busy_device_only_a_batch_that_cannot_grow_is_due() -> None:
    queue = make_queue(max_batch_size=4)
    queue.admit([entry(1), entry(1)], 0.0)
    assert queue.due_in(0.0, ahead=True, closing=False) == math.inf
    assert queue.take(0.0, leave_growing=True) == []  # could still grow: left waiting
    assert len(queue) == 2
    queue.admit([entry(1), entry(1)], 0.0)
    assert queue.due_in(0.0, ahead=True, closing=False) == 0.0


def test_a_batch_the_budget_cut_short_is_taken_even_when_it_could_grow() -> None:
    # A budget of 20 padded tokens: two items of 10 fit, three do not.
    queue = make_queue(max_batch_size=8, policy=make_policy("fifo", 20))
    items = [entry(10) for _ in range(3)]
    queue.admit(items, 0.0)
    assert queue.take(0.0, leave_growing=True) == items[:2]
    assert queue.take(0.0, leave_growing=True) == []  # the last one alone could grow
    assert queue.take(0.0) == items[2:]


def test_the_element_cap_leaves_the_newest_items_waiting() -> None:
    queue = make_queue(max_batch_size=8, max_batch_elements=30)
    items = [entry(5), entry(10), entry(7), entry(6)]
    queue.admit(items, 0.0)
    assert queue.take(0.0) == items[:3]  # 3 x 10 = 30 fits; 4 x 10 would not
    assert queue.take(0.0) == items[3:]
    assert queue.take(0.0) == []


def test_one_item_always_fits_the_element_cap() -> None:
    queue = make_queue(max_batch_elements=4)
    queue.admit([entry(100)], 0.0)
    assert [e.volume for e in queue.take(0.0)] == [100]


def test_batches_are_counted_against_the_cap_only_when_the_largest_could_pass_it() -> None:
    counted: list[int] = []

    def counting(items: list[int]) -> int:
        counted.append(len(items))
        return padded_elements(items)

    # Batches of up to 8 items of at most 10: 80 elements at most.
    queue = AdmissionQueue(BatcherOptions(max_batch_size=8, max_batch_elements=80), counting,
                           name="toy", largest_batch=80)  # fmt: skip
    items = [entry(10), entry(9), entry(10)]
    queue.admit(items, 0.0)
    assert queue.take(0.0) == items and counted == []  # under the cap whatever was chosen
    # A memory ceiling learnt below it (an out-of-memory batch): counted, and cut.
    queue.memory_limit = 20
    queue.admit(items, 0.0)
    assert queue.take(0.0) == items[:2] and counted
    assert padded_elements([e.volume for e in items[:2]]) <= 20


def test_the_length_aware_policy_groups_similar_lengths_and_an_overdue_item_goes_first() -> None:
    queue = make_queue(
        max_batch_size=2, max_queue_delay_ms=5, policy=make_policy("length_aware", None)
    )
    old, a, b, c = entry(100, enqueued=0.0), entry(3, 0.001), entry(90, 0.002), entry(4, 0.003)
    queue.admit([old, a, b, c], 0.0)
    # Not overdue yet: the two short ones form the tightest batch.
    assert queue.take(0.002) == [a, c]
    # Now the oldest is overdue: it must be in the batch.
    assert old in queue.take(0.010)


@given(
    volumes=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    withdrawn=st.sets(st.integers(0, 39)),
    takes=st.integers(1, 6),
)
@settings(max_examples=150, deadline=None)
def test_the_policy_reads_the_volumes_of_exactly_the_entries_still_waiting(
    volumes: list[int], withdrawn: set[int], takes: int
) -> None:
    """The queue keeps each waiting entry's volume beside it; after
    withdrawals and batches taken anywhere in the queue, each batch is what
    the length-aware policy picks from the entries still waiting."""
    policy = make_policy("length_aware", None)
    queue = make_queue(max_batch_size=4, max_queue_delay_ms=1e6, policy=policy)
    entries = [entry(v, enqueued=i * 1e-3) for i, v in enumerate(volumes)]
    queue.admit(entries, 0.0)
    queue.withdraw([e for i, e in enumerate(entries) if i in withdrawn])
    waiting = [e for i, e in enumerate(entries) if i not in withdrawn]
    for _ in range(takes):
        expected = [waiting[i] for i in policy.select(Waiting([e.volume for e in waiting]), 4)]
        assert queue.take(0.0) == expected
        waiting = [e for e in waiting if e not in expected]
        assert len(queue) == len(waiting)


def test_expire_answers_late_items_and_drops_those_whose_caller_left() -> None:
    queue = make_queue()
    live, late, gone = entry(1, deadline=10.0), entry(2, deadline=5.0), entry(3)
    gone.future.cancel()
    kept, expired = queue.expire([live, late, gone], now=6.0)
    assert kept == [live]
    assert [(e, type(err), failed) for e, err, failed in expired] == [
        (late, DeadlineExceeded, True)
    ]
    assert "model 'toy': item waited past its deadline" in str(expired[0][1])
    assert live.future.running()  # marked running: a late cancel() cannot race the result


# ---------------------------------------------------------------------- Retry-After
def full_queue_retry_after(queue: AdmissionQueue, now: float) -> float:
    """The Retry-After of a request as large as the whole queue, refused at ``now``."""
    with pytest.raises(ServerBusy) as refused:
        queue.admit([entry(1) for _ in range(queue.options.max_queue_size)], now)
    return refused.value.retry_after


def test_retry_after_is_the_queue_ahead_over_the_rate_a_backlog_drained() -> None:
    queue = make_queue(max_queue_size=40, max_batch_size=4)
    queue.admit([entry(1) for _ in range(40)], 0.0)
    assert full_queue_retry_after(queue, 0.0) == 1.0  # nothing measured: the lower bound
    for now in (1.0, 3.0, 5.0):  # 4 items every 2 s from a backlog: 2 items/s
        assert len(queue.take(now)) == 4
    # 28 wait: a request of 40 must wait for 28 to leave, 14 s at 2 items/s.
    assert full_queue_retry_after(queue, 5.0) == pytest.approx(14.0)


def test_idle_time_after_the_queue_emptied_does_not_slow_the_drain_rate() -> None:
    queue = make_queue(max_queue_size=40, max_batch_size=4)
    queue.admit([entry(1) for _ in range(8)], 0.0)
    queue.take(1.0)
    queue.take(3.0)  # 4 items in 2 s; the queue is empty
    queue.admit([entry(1) for _ in range(40)], 100.0)  # 97 s idle, then a burst
    queue.take(100.0)
    assert full_queue_retry_after(queue, 100.0) == pytest.approx(36 / 2)


def test_the_fields_of_an_entry_are_in_the_order_admission_passes_them() -> None:
    """``Batcher._enqueue`` builds each entry positionally (keywords cost a
    third more, per item): a field moved would pass a value as another."""
    from dataclasses import fields

    assert [f.name for f in fields(Pending)] == [
        "item", "volume", "future", "loop", "enqueued", "deadline", "reruns", "crashes",
        "priority", "parameters", "trace", "request", "answered", "queued",
        "out_of_memory",
    ]  # fmt: skip
