"""The latency target's controller (batching/target.py) and admission by
predicted wait, without threads or clocks: every cost and time is made up."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tensorserve.batching.admission import AdmissionQueue, BatcherOptions, Pending
from tensorserve.batching.policy import make_policy
from tensorserve.batching.target import LatencyTarget
from tensorserve.dataplane.lag import LoopLag
from tensorserve.errors import ServerBusy, WouldMissTarget


def entry(priority: int = 0) -> Pending:
    return Pending(item=1, volume=1, future=Future(), loop=None, enqueued=0.0, deadline=None,
                   priority=priority)


def sized(volume: int) -> Pending:
    return Pending(item=1, volume=volume, future=Future(), loop=None, enqueued=0.0, deadline=None)


def measured(target: LatencyTarget, items: int, seconds: float, batches: int = 4) -> None:
    """``batches`` batches of ``items`` that took ``seconds`` each, served on time."""
    for _ in range(batches):
        target.observe(items, seconds, [seconds] * items)


def drained(target: LatencyTarget, takes: list[tuple[int, float]], left: int = 10) -> None:
    """Batches taken from a queue that kept ``left`` items waiting: each
    (items, seconds since the previous take); the first one starts the clock."""
    now = 100.0
    for items, gap in takes:
        now += gap
        target.drain.taken(items, now, left)


def test_nothing_is_refused_until_batches_were_measured() -> None:
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    assert target.predicted_s(10_000, 1) is None
    assert target.would_miss(10_000, 1) is None
    measured(target, 8, 0.010, batches=LatencyTarget.MIN_BATCHES - 1)
    assert target.would_miss(10_000, 1) is None


def test_the_predicted_wait_is_the_queue_ahead_at_the_measured_rate_plus_one_batch() -> None:
    # Batches of 8 in 10 ms: 800 items/s an instance, before any backlog.
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    measured(target, 8, 0.010)
    assert target.predicted_s(79, 1) == pytest.approx(80 / 800 + 0.010)
    two = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=2)
    measured(two, 8, 0.010)
    assert two.predicted_s(79, 1) == pytest.approx(80 / 1600 + 0.010)


def test_a_long_queue_is_judged_by_how_fast_a_backlog_drained_not_by_the_last_small_batches() -> None:
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    drained(target, [(8, 0.0)] + [(8, 0.010)] * 4)  # a backlog: 8 items every 10 ms
    measured(target, 1, 0.005)  # then callers one at a time: 200 items/s, the latest
    # 40 queued drain as the backlog did: at 800/s, not at 200/s.
    batch_s = target.report()["batch_ms"] / 1000
    assert target.predicted_s(39, 1) == pytest.approx(40 / 800 + batch_s)
    assert target.report()["drain_items_per_s"] == pytest.approx(800)


def test_the_drain_rate_is_by_the_clock_not_by_the_models_own_seconds() -> None:
    # Batches of 8 the model runs in 1 ms, but taken from the backlog every
    # 4 ms: padding, transfer and un-padding around them are the limit.
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    measured(target, 8, 0.001)
    drained(target, [(8, 0.0)] + [(8, 0.004)] * 10)
    assert target.drain_rate() == pytest.approx(2000)


def test_big_batches_of_short_items_do_not_make_a_queue_of_every_length_look_fast() -> None:
    # Under a padded-volume budget, batches of 8 form only of short items
    # (4 ms) and long items go 2 at a time (10 ms): the queue drains at
    # 10 items per 14 ms, not at the 2,000 items/s of the short batches.
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    drained(target, [(8, 0.0)] + [(2, 0.004), (8, 0.010)] * 20)
    assert target.drain_rate() == pytest.approx(10 / 0.014, rel=0.05)


def test_only_the_time_after_a_take_that_left_items_waiting_counts() -> None:
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    target.drain.taken(2, 100.0, left=0)  # the queue emptied: the next 5 s were idle
    target.drain.taken(2, 105.0, left=3)
    assert target.drain.items_per_s() is None  # nothing drained from a backlog yet
    target.drain.taken(8, 105.01, left=3)
    assert target.drain_rate() == pytest.approx(800)


def test_until_a_backlog_was_seen_the_models_own_rate_stands_in() -> None:
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=2)
    measured(target, 2, 0.010)  # 200 items/s an instance: all that arrived
    assert target.drain_rate() == pytest.approx(400)
    drained(target, [(8, 0.0), (8, 0.010)])
    assert target.drain_rate() == pytest.approx(800)


def test_safety_is_bounded_so_latency_the_queue_does_not_cause_cannot_refuse_everything() -> None:
    target = LatencyTarget(100, max_batch_size=10, max_queue_delay_ms=5, instances=1)
    for _ in range(100):
        target.observe(10, 0.010, [1.0] * 10)  # every caller a second late, whatever is refused
    assert target.safety == LatencyTarget.SAFETY[1]
    # Still admitted: what drains within the target at the measured rate over the bound.
    # 1,000 items/s and 10 ms batches: 4 x (14 / 1000 + 0.010) = 0.096 s fits, 0.104 s does not.
    assert target.would_miss(13, 1) is None
    assert target.would_miss(15, 1) is not None


def test_a_request_is_refused_only_when_its_predicted_wait_exceeds_the_target() -> None:
    target = LatencyTarget(100, max_batch_size=8, max_queue_delay_ms=5, instances=1)
    measured(target, 8, 0.010)
    # 0.1 s allows (0.1 - 0.01) * 800 = 72 items, its own included.
    assert target.would_miss(71, 1) is None
    assert target.would_miss(72, 1) == pytest.approx(73 / 800 + 0.010)
    assert target.refused == 1


def test_the_batch_cap_shrinks_while_batches_take_over_a_quarter_of_the_target() -> None:
    target = LatencyTarget(40, max_batch_size=32, max_queue_delay_ms=5, instances=1)
    measured(target, 32, 0.020, batches=1)  # 20 ms > 40 / 4
    assert target.batch_cap == 25  # 32 x 0.8
    measured(target, 25, 0.012, batches=1)  # the average is still over 10 ms
    assert target.batch_cap == 20
    for _ in range(30):  # fast batches: it grows back, one at a time, to the maximum
        target.observe(4, 0.001, [0.001] * 4)
    assert target.batch_cap == 32


def test_the_queue_delay_is_at_most_a_tenth_of_the_target() -> None:
    assert LatencyTarget(20, 8, max_queue_delay_ms=5, instances=1).queue_delay_ms == 2
    assert LatencyTarget(200, 8, max_queue_delay_ms=5, instances=1).queue_delay_ms == 5


def test_safety_grows_while_callers_get_a_p99_over_the_aim_and_shrinks_when_well_under() -> None:
    target = LatencyTarget(100, max_batch_size=10, max_queue_delay_ms=5, instances=1)
    for _ in range(LatencyTarget.ADJUST_EVERY // 10):
        target.observe(10, 0.010, [0.085] * 10)  # p99 85 ms: on time, but over the aim (80%)
    assert target.safety == pytest.approx(1.2)
    assert target.report()["achieved_p99_ms"] == pytest.approx(85)
    target = LatencyTarget(100, max_batch_size=10, max_queue_delay_ms=5, instances=1)
    for _ in range(LatencyTarget.ADJUST_EVERY // 10):
        target.observe(10, 0.010, [0.070] * 10)  # within the aim's band: left alone
    assert target.safety == 1.0
    target = LatencyTarget(100, max_batch_size=10, max_queue_delay_ms=5, instances=1)
    for _ in range(LatencyTarget.ADJUST_EVERY // 10):
        target.observe(10, 0.010, [0.050] * 10)  # all well under the aim (55%)
    assert target.safety == pytest.approx(0.95)


def test_the_achieved_p99_is_of_the_last_window_of_items() -> None:
    target = LatencyTarget(100, max_batch_size=10, max_queue_delay_ms=5, instances=1)
    target.observe(10, 0.010, [0.5] * 10)  # old and slow
    for _ in range(LatencyTarget.WINDOW // 10):
        target.observe(10, 0.010, [0.001 * i for i in range(1, 11)])
    assert target.report()["achieved_p99_ms"] == pytest.approx(10)


def test_a_request_with_nothing_ahead_is_never_refused_even_by_a_model_slower_than_the_target() -> None:
    target = LatencyTarget(100, max_batch_size=1, max_queue_delay_ms=5, instances=1)
    measured(target, 1, 0.300)  # one item takes 300 ms
    assert target.would_miss(0, 1) is None
    assert target.would_miss(1, 1) == pytest.approx(2 / (1 / 0.3) + 0.3)


def test_a_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="target_p99_ms must be > 0"):
        LatencyTarget(0, 8, 5, 1)


# ---------------------------------------------------------------------- admission
def queue_with_target(**options: object) -> tuple[AdmissionQueue, LatencyTarget]:
    opts = BatcherOptions(target_p99_ms=100, **options)  # type: ignore[arg-type]
    target = LatencyTarget(100, opts.max_batch_size, opts.max_queue_delay_ms, 1)
    measured(target, 8, 0.010)  # 800 items/s: 72 items fit in the target
    return AdmissionQueue(opts, lambda items: len(items), name="toy", target=target), target


def test_admission_refuses_a_request_the_queue_ahead_would_make_late() -> None:
    queue, _ = queue_with_target(max_batch_size=8)
    queue.admit([entry() for _ in range(70)], 0.0)
    queue.admit([entry()], 0.0)  # 70 ahead: 71 items, on time
    with pytest.raises(WouldMissTarget) as refused:
        queue.admit([entry(), entry()], 0.0)  # 71 ahead: 73 items, late
    assert isinstance(refused.value, ServerBusy)  # retried later, as a full queue
    assert refused.value.code == "would_miss_target"
    assert "over its 100 ms latency target (71 items ahead)" in str(refused.value)
    assert 1.0 <= refused.value.retry_after <= 60.0
    assert len(queue) == 71  # nothing of the refused request got in
    queue.admit([entry()], 0.0)  # a smaller one still fits


def test_admission_counts_only_the_items_served_before_a_higher_priority_request() -> None:
    queue, _ = queue_with_target(max_batch_size=8, priority_levels=2)
    queue.admit([entry(priority=2) for _ in range(72)], 0.0)
    with pytest.raises(WouldMissTarget):
        queue.admit([entry(priority=2)], 0.0)
    queue.admit([entry(priority=1)], 0.0)  # nothing of level 1 ahead: on time


def test_the_queue_tells_the_target_each_take_and_what_it_left_waiting() -> None:
    queue, target = queue_with_target(max_batch_size=8)
    queue.admit([entry() for _ in range(20)], 0.0)
    assert len(queue.take(10.0)) == 8  # 12 left: the clock starts
    assert len(queue.take(10.01)) == 8  # 8 more 10 ms later, 4 left
    assert target.drain_rate() == pytest.approx(800)
    assert len(queue.take(10.02)) == 4  # the rest: the queue is empty
    queue.admit([entry()], 20.0)
    assert len(queue.take(20.0)) == 1  # after 10 s idle: not a drain of 1 item in 10 s
    assert target.drain_rate() == pytest.approx((0.95 * 8 + 4) / (0.95 * 0.01 + 0.01))


def test_a_queue_emptied_by_callers_that_left_stops_the_drain_clock() -> None:
    queue, target = queue_with_target(max_batch_size=8)
    waiting = [entry() for _ in range(12)]
    queue.admit(waiting, 0.0)
    taken = queue.take(10.0)  # 4 left waiting...
    queue.withdraw([e for e in waiting if e not in taken])  # ...whose callers left
    queue.admit([entry()], 20.0)
    queue.take(20.0)  # 10 s idle: no drain of 1 item in 10 s
    assert target.report()["drain_items_per_s"] == pytest.approx(800)  # still the model's own


def test_the_target_caps_the_batch_the_policy_may_take() -> None:
    queue, target = queue_with_target(max_batch_size=8)
    queue.admit([entry() for _ in range(8)], 0.0)
    target.batch_cap = 3
    assert len(queue.take(0.0)) == 3
    assert queue.batch_cap() == 3


def test_with_a_target_the_policy_chooses_among_the_oldest_batch_only() -> None:
    # Four long items, then eight short ones. Looking far into the queue, a
    # length-aware policy would take four short ones and leave the long ones
    # to be overtaken; a target's predicted wait is FIFO through the queue.
    def queue_of(target: bool) -> AdmissionQueue:
        policy = make_policy("length_aware", None)
        if target:
            return queue_with_target(max_batch_size=4, policy=policy)[0]
        return AdmissionQueue(BatcherOptions(max_batch_size=4, policy=policy), lambda items: len(items))

    for targeted, expected in ((True, 100), (False, 1)):
        queue = queue_of(targeted)
        queue.admit([sized(100) for _ in range(4)] + [sized(1) for _ in range(8)], 0.0)
        assert [e.volume for e in queue.take(0.0)] == [expected] * 4


def test_without_a_target_admission_is_unchanged() -> None:
    queue = AdmissionQueue(BatcherOptions(max_queue_size=10_000), lambda items: len(items))
    queue.admit([entry() for _ in range(5_000)], 0.0)
    assert queue.batch_cap() == 32


# ---------------------------------------------------------------------- the front end
def test_a_front_end_asks_before_reading_a_request_as_if_it_were_one_item_of_the_highest_level() -> None:
    queue, _ = queue_with_target(max_batch_size=8, priority_levels=2)
    queue.admit([entry(priority=2) for _ in range(100)], 0.0)
    queue.refuse_if_late(None, 1)  # nothing of level 1 ahead: it may be one, so it is read
    queue.admit([entry(priority=1) for _ in range(72)], 0.0)
    with pytest.raises(WouldMissTarget) as refused:
        queue.refuse_if_late(None, 1)  # 72 of level 1 ahead: late at any level
    assert "(72 items ahead); retry later" in str(refused.value)
    assert len(queue) == 172  # asking admits nothing


def test_the_loops_lag_is_taken_at_once_and_fades_when_it_ends() -> None:
    lag = LoopLag()
    lag.observe(0.100)
    assert lag.seconds == 0.100
    lag.observe(0.0)
    assert lag.seconds == pytest.approx(0.080)  # one tick on time: 0.8 of it remains
    for _ in range(30):
        lag.observe(0.0)
    assert lag.seconds < 0.001
    lag.observe(-0.001)  # a timer run early is on time
    assert lag.seconds >= 0.0


async def test_the_loops_lag_measures_a_loop_held_by_blocking_work() -> None:
    import asyncio
    import time

    lag = LoopLag()
    lag.start()
    try:
        ticked = asyncio.Event()
        await asyncio.sleep(2 * LoopLag.INTERVAL_S)
        time.sleep(0.060)  # noqa: ASYNC251 - blocks the loop on purpose: nothing else runs
        asyncio.get_running_loop().call_soon(ticked.set)  # after the late tick, which is due first
        await ticked.wait()
        assert lag.seconds >= 0.050
    finally:
        lag.stop()
