"""The scheduler's state machine, step by step, with a made-up clock: take a
batch when it is due, dispatch it (a second only if it cannot grow), complete
it, fail it, run its parts again first, restore a dead instance. The test
plays the instance: it sees each dispatched batch and completes it by hand,
and runs the scheduler's loop only between steps (no threads, no sleeps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tensorserve.batching.admission import BatcherOptions
from tensorserve.batching.batcher import Batcher
from tensorserve.batching.collate import Collator
from tensorserve.batching.policy import make_policy
from tensorserve.errors import DeadlineExceeded, ModelFailure, ModelNotReady, WorkerCrashed
from tensorserve.repository.config import parse_config
from tensorserve.runtime.executor import Executed

X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": -1.0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]


@dataclass
class Sent:
    x: np.ndarray  # the padded batch
    done: Callable[[Any, BaseException | None], None]

    @property
    def rows(self) -> list[float]:
        return [float(row[0]) for row in self.x]

    def succeed(self) -> None:
        self.done(Executed({"y": self.x * 2}, None), None)


@dataclass
class ScriptedInstance:
    """A ``LoopExecutor`` whose batches the test completes."""

    overlaps: bool = True
    instance_count: int = 1
    pin_memory: bool = False
    restarts: int = 0
    restart_seconds: float | None = None
    sent: list[Sent] = field(default_factory=list)
    repaired: list[int] = field(default_factory=list)
    lost: Callable[[int], None] | None = None  # the scheduler's (attach)

    def attach(self, loop: asyncio.AbstractEventLoop, lost: Callable[[int], None]) -> None:
        self.lost = lost

    def dispatch(self, features: dict[str, Any], instance: int, parameters: Any, done: Any) -> int:
        self.sent.append(Sent(np.asarray(features["x"]).copy(), done))
        return len(self.sent) - 1

    def detach(self) -> None:
        pass

    def abort(self, launched: Any, because: str) -> bool:
        return True

    def repair(self, instance: int) -> None:
        self.repaired.append(instance)

    def health(self) -> str | None:
        return None

    def free_memory_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def settle(loop: asyncio.AbstractEventLoop, action: Callable[[], Any] | None = None) -> Any:
    """Run ``action`` on the loop, then every callback it queued (completions
    are handled in callbacks of their own), and return what it returned."""

    async def step() -> Any:
        result = action() if action is not None else None
        for _ in range(5):
            await asyncio.sleep(0)
        return result

    return loop.run_until_complete(step())


def scheduler(
    loop: asyncio.AbstractEventLoop, instance: ScriptedInstance, clock: Clock, **options: Any
) -> Batcher:
    collator = Collator(parse_config({"input": X_IN, "output": Y_OUT}, "scripted"))
    batcher = Batcher(instance, collator, BatcherOptions(**options), clock=clock)
    return batcher.start(loop)


def item(value: float, length: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full(length, value, np.float32)}


def submit(loop: asyncio.AbstractEventLoop, batcher: Batcher, *values: float, **kw: Any) -> list:
    return settle(loop, lambda: batcher.submit_many([item(v) for v in values], loop=loop, **kw))


def test_a_batch_is_taken_when_due_and_each_caller_gets_its_own_row(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, dispatch="timer",
                        max_queue_delay_ms=10.0)
    futures = submit(loop, batcher, 1.0, 2.0)
    assert instance.sent == []  # not due: the batch may still grow
    clock.now += 0.011
    settle(loop, batcher.scheduler.wake)
    assert [sent.rows for sent in instance.sent] == [[1.0, 2.0]]
    settle(loop, instance.sent[0].succeed)
    assert [f.result()["y"].tolist() for f in futures] == [[2.0] * 3, [4.0] * 3]
    assert batcher.scheduler.wait_idle(0)


def test_a_second_batch_goes_behind_a_running_one_only_if_it_cannot_grow(loop) -> None:
    instance, clock = ScriptedInstance(overlaps=True), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=2, policy=make_policy("fifo", None))
    futures = submit(loop, batcher, 1.0, 2.0, 3.0, 4.0, 5.0)
    # [1, 2] runs; [3, 4] is full, so it is queued on the instance too; [5]
    # could still grow: it waits for the instance.
    assert [sent.rows for sent in instance.sent] == [[1.0, 2.0], [3.0, 4.0]]
    assert batcher.queue_depth == 1
    settle(loop, instance.sent[0].succeed)
    assert len(instance.sent) == 2  # [5] still waits behind the running [3, 4]
    settle(loop, instance.sent[1].succeed)
    assert [sent.rows for sent in instance.sent][2:] == [[5.0]]
    settle(loop, instance.sent[2].succeed)
    assert [f.result()["y"][0] for f in futures] == [2.0, 4.0, 6.0, 8.0, 10.0]


def test_an_instance_that_does_not_overlap_holds_one_batch(loop) -> None:
    instance, clock = ScriptedInstance(overlaps=False), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=2, policy=make_policy("fifo", None))
    submit(loop, batcher, 1.0, 2.0, 3.0, 4.0)
    assert len(instance.sent) == 1
    settle(loop, instance.sent[0].succeed)
    assert len(instance.sent) == 2


def test_a_failed_batch_runs_again_in_halves_first_each_alone(loop) -> None:
    instance, clock = ScriptedInstance(overlaps=True), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, policy=make_policy("fifo", None))
    futures = submit(loop, batcher, 1.0, 2.0, 3.0, 13.0)
    later = submit(loop, batcher, 7.0)  # queued: the instance holds a batch that could grow
    settle(loop, lambda: instance.sent[0].done(None, ModelFailure("poison")))
    # The halves run before the item that came later, one at a time.
    assert [sent.rows for sent in instance.sent][1:] == [[1.0, 2.0]]
    settle(loop, instance.sent[1].succeed)
    assert [sent.rows for sent in instance.sent][2:] == [[3.0, 13.0]]
    settle(loop, lambda: instance.sent[2].done(None, ModelFailure("poison")))
    assert [sent.rows for sent in instance.sent][3:] == [[3.0]]
    settle(loop, instance.sent[3].succeed)
    assert [sent.rows for sent in instance.sent][4:] == [[13.0]]
    settle(loop, lambda: instance.sent[4].done(None, ModelFailure("poison 13")))
    assert [sent.rows for sent in instance.sent][5:] == [[7.0]]  # only now the newcomer
    settle(loop, instance.sent[5].succeed)
    assert [f.result()["y"][0] for f in futures[:3]] == [2.0, 4.0, 6.0]
    with pytest.raises(ModelFailure, match="poison 13"):
        futures[3].result()
    assert later[0].result()["y"][0] == 14.0


def test_a_dead_instance_is_restored_before_its_unrun_batch_runs_again(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4)
    futures = submit(loop, batcher, 1.0, 2.0)
    crashed = WorkerCrashed("the worker process died before running this batch", ran=False)
    settle(loop, lambda: instance.sent[0].done(None, crashed))
    # repair runs off the loop, in the loop's executor: wait for it there.
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 2), 10))
    assert instance.repaired == [0]
    assert instance.sent[1].rows == [1.0, 2.0]
    settle(loop, instance.sent[1].succeed)
    assert [f.result()["y"][0] for f in futures] == [2.0, 4.0]


def _crash(instance: ScriptedInstance, index: int) -> Callable[[], None]:
    return lambda: instance.sent[index].done(None, WorkerCrashed("died", ran=True))


def test_a_crashs_suspects_run_alone_and_the_cleared_ride_with_new_items(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, policy=make_policy("fifo", None))
    killer, *good = submit(loop, batcher, 13.0, 1.0, 2.0, 3.0)
    settle(loop, _crash(instance, 0))
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 2), 10))
    # No restart measured yet: the suspects are tried one at a time, alone.
    assert instance.sent[1].rows == [13.0]
    later = submit(loop, batcher, 7.0)
    assert len(instance.sent) == 2  # nothing goes behind a trial
    settle(loop, _crash(instance, 1))  # it crashed alone: the killer; 1, 2, 3 are cleared
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 3), 10))
    # The cleared items lead the queue and ride in one batch with the newcomer.
    assert instance.sent[2].rows == [1.0, 2.0, 3.0, 7.0]
    settle(loop, instance.sent[2].succeed)
    with pytest.raises(ModelFailure, match="crashed the model's worker process"):
        killer.result()
    assert [f.result()["y"][0] for f in [*good, *later]] == [2.0, 4.0, 6.0, 14.0]
    assert instance.repaired == [0, 0]
    assert batcher.scheduler.wait_idle(0)


def test_nothing_goes_behind_a_trial_even_when_it_is_due(loop) -> None:
    """A batch sent behind a trial would share the trial's crash: the worker
    counts it against the oldest batch, and an innocent trial item could be
    failed for good. So an instance running a trial takes nothing else."""
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, policy=make_policy("fifo", None))
    killer, good = submit(loop, batcher, 13.0, 1.0)
    settle(loop, _crash(instance, 0))
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 2), 10))
    assert instance.sent[1].rows == [13.0]  # the trial, its rest [1.0] held
    later = submit(loop, batcher, 7.0, 8.0, 9.0, 10.0)  # a full batch: it cannot grow
    clock.now += 1.0
    settle(loop, batcher.scheduler.wake)
    assert len(instance.sent) == 2
    settle(loop, _crash(instance, 1))  # alone: the killer; 1.0 is cleared
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 3), 10))
    settle(loop, instance.sent[2].succeed)
    with pytest.raises(ModelFailure, match="crashed the model's worker process"):
        killer.result()
    for sent in instance.sent[3:]:
        settle(loop, sent.succeed)
    assert [f.result()["y"][0] for f in [good, *later]] == [2.0, 14.0, 16.0, 18.0, 20.0]


def test_a_trial_that_runs_answers_its_items_and_an_ordinary_batch_goes_next(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, policy=make_policy("fifo", None))
    first, *_others = submit(loop, batcher, 1.0, 2.0, 13.0)
    settle(loop, _crash(instance, 0))
    loop.run_until_complete(asyncio.wait_for(_until(lambda: len(instance.sent) == 2), 10))
    later = submit(loop, batcher, 7.0)
    settle(loop, instance.sent[1].succeed)  # the trial of [1.0] ran: answered
    assert first.result()["y"][0] == 2.0
    # The slot after a trial serves the queue; the next trial waits for it.
    assert [sent.rows for sent in instance.sent][2:] == [[7.0]]
    settle(loop, instance.sent[2].succeed)
    assert [sent.rows for sent in instance.sent][3:] == [[2.0]]
    assert later[0].result()["y"][0] == 14.0


def test_a_worker_lost_while_idle_is_repaired_before_any_batch_comes(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    scheduler(loop, instance, clock, max_batch_size=4)
    assert instance.lost is not None
    settle(loop, lambda: instance.lost(0))  # type: ignore[misc]
    loop.run_until_complete(asyncio.wait_for(_until(lambda: instance.repaired == [0]), 10))


def test_an_item_past_its_deadline_is_answered_and_never_dispatched(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=4, dispatch="timer",
                        max_queue_delay_ms=50.0)
    late, = submit(loop, batcher, 1.0, timeout=0.01)
    on_time, = submit(loop, batcher, 2.0)
    clock.now += 0.06
    settle(loop, batcher.scheduler.wake)
    assert [sent.rows for sent in instance.sent] == [[2.0]]
    with pytest.raises(DeadlineExceeded, match="waited past its deadline"):
        late.result()
    settle(loop, instance.sent[0].succeed)
    assert on_time.result()["y"][0] == 4.0


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


def test_a_close_that_times_out_answers_what_it_leaves_behind(loop) -> None:
    instance, clock = ScriptedInstance(), Clock()
    batcher = scheduler(loop, instance, clock, max_batch_size=1)
    running, queued = submit(loop, batcher, 1.0, 2.0)  # [1] on the instance, [2] behind it
    batcher.close(timeout=0.01)  # the instance never answers
    settle(loop)
    for future in (running, queued):
        with pytest.raises(ModelNotReady, match="closed before this item's batch finished"):
            future.result()
