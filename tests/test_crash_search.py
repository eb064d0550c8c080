"""A crash's search, planned step by step with made-up batches (no threads,
no workers): only suspects run in trials, one trial at a time; a trial that
runs answers its items, one that crashes clears the rest of its crash's
suspects, which go back to the queue to ride with new items; only the item
that kills a worker alone fails (batching/recovery.py, batching/culprit.py)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from tensorserve.batching.admission import Pending
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.recovery import Plan, Recovery, Reruns, Trial
from tensorserve.batching.results import Batch
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import ModelFailure, WorkerCrashed

SWAP_S = 0.035  # a standby worker taking over (docs/reliability.md)


def _flat() -> BatchCostModel:
    """Taught that a forward costs 100 ms whatever its size (a GPU)."""
    model = BatchCostModel()
    for _ in range(4):
        for size in range(1, 17):
            model.observe(size, 8, 0.1)
    return model


def _entries(values: range | list[int]) -> list[Pending]:
    return [Pending(v, 8, Future(), None, 0.0, None) for v in values]


def _crashed(entries: list[Pending], rest: list[Pending] | None = None) -> Batch:
    return Batch(entries, 0.0, error=WorkerCrashed("died", ran=True), rest=rest)


@dataclass
class Search:
    """Plays the scheduler: runs each trial (a crash if it holds a killer),
    and keeps what each plan answers, clears and trials."""

    recovery: Recovery
    killers: set[int]
    trials_run: list[list[int]] = field(default_factory=list)
    answered: dict[int, str] = field(default_factory=dict)  # item: "ok" or the error
    cleared: list[int] = field(default_factory=list)
    deaths: int = 0

    def take(self, plan: Plan) -> list[Trial]:
        assert not plan.retries
        for entry, outcome, failed in plan.outcomes:
            assert entry.item not in self.answered, "answered twice"
            self.answered[entry.item] = str(outcome) if failed else "ok"
        self.cleared += [entry.item for entry in plan.cleared]
        return plan.trials

    def run(self, trials: list[Trial]) -> None:
        while trials:
            trial = trials.pop(0)
            items = [entry.item for entry in trial.suspects]
            self.trials_run.append(items)
            batch = Batch(trial.suspects, 0.0, rest=trial.rest)
            if self.killers & set(items):
                self.deaths += 1
                batch.error = WorkerCrashed("died", ran=True)
                plan = self.recovery.plan(batch)
                assert plan is not None
            else:
                plan = self.recovery.ended(batch, [(e, "ok", False) for e in trial.suspects])
            trials += self.take(plan)


def _search(killer: int, n: int = 16) -> Search:
    stats = BatchStats()
    search = Search(Recovery("m", True, stats, _flat(), lambda: SWAP_S), {killer})
    plan = search.recovery.plan(_crashed(_entries(range(n))))
    assert plan is not None
    search.run(search.take(plan))
    return search


def test_a_crashed_batch_of_16_with_the_killer_last_takes_four_tests() -> None:
    search = _search(killer=13)
    # 8 run and are answered; 4 of the other 8; then one at a time from 4.
    assert search.trials_run == [list(range(8)), [8, 9, 10, 11], [12], [13]]
    assert search.deaths == 1  # the killer alone; every trial before it ran
    assert search.cleared == [14, 15]  # never run apart: back to the queue
    assert search.answered.pop(13).startswith("model 'm': this item crashed")
    assert search.answered == dict.fromkeys([*range(13)], "ok")


def test_a_crashed_batch_of_16_with_the_killer_first_clears_each_other_half() -> None:
    search = _search(killer=0)
    assert search.trials_run == [list(range(8)), [0, 1, 2, 3], [0]]
    assert search.deaths == 3
    # Each crashed trial cleared the rest of its suspects: 15 good items in
    # three groups back to the queue, none of them run in a trial.
    assert search.cleared == [*range(8, 16), 4, 5, 6, 7, 1, 2, 3]
    assert list(search.answered) == [0]
    assert search.answered[0].startswith("model 'm': this item crashed")


@pytest.mark.parametrize("killer", range(16))
def test_wherever_the_killer_sits_only_it_fails_and_each_good_item_ends_once(killer: int) -> None:
    search = _search(killer)
    ok = {item for item, outcome in search.answered.items() if outcome == "ok"}
    assert set(search.answered) - ok == {killer}
    # Each good item is either answered by a trial that ran or cleared to the
    # queue, never both, never twice.
    assert ok.isdisjoint(search.cleared) and len(set(search.cleared)) == len(search.cleared)
    assert sorted(ok | set(search.cleared)) == [i for i in range(16) if i != killer]
    # 16 -> 8 -> 4 (one trial a level), then at most 4 one at a time.
    assert len(search.trials_run) <= 6
    assert search.trials_run[-1] == [killer]  # condemned only by a crash alone


def test_a_cleared_item_in_a_second_crash_is_a_suspect_of_that_crash_alone() -> None:
    # A good item cleared by the first crash rides with a second killer: that
    # batch's crash is searched on its own, and the good item, now in two
    # crashed batches, is still answered once it runs.
    stats = BatchStats()
    recovery = Recovery("m", True, stats, _flat(), lambda: SWAP_S)
    good, second = _entries([1, 2])
    good.crashes = 1  # its first crash's trial cleared it
    search = Search(recovery, {2})
    plan = recovery.plan(_crashed([good, second]))
    assert plan is not None
    assert [e.crashes for e in (good, second)] == [2, 1]
    search.run(search.take(plan))
    assert search.trials_run == [[1], [2]]  # the second killer must crash alone too
    assert search.answered[1] == "ok"
    assert search.answered[2].startswith("model 'm': this item crashed")


def test_a_trial_that_never_ran_runs_again_as_the_same_trial() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    suspects, rest = _entries(range(4)), _entries(range(4, 8))
    unrun = Batch(suspects, 0.0, error=WorkerCrashed("died first", ran=False), rest=rest)
    plan = recovery.plan(unrun)
    assert plan is not None and not plan.cleared and not plan.outcomes
    (trial,) = plan.trials
    assert trial.suspects == suspects and trial.rest == rest


def test_an_ordinary_batch_that_never_ran_goes_back_to_the_queue_not_alone() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    entries = _entries(range(5))
    plan = recovery.plan(Batch(entries, 0.0, error=WorkerCrashed("died first", ran=False)))
    assert plan is not None
    assert plan.cleared == entries and not plan.trials and not plan.retries
    assert all(e.reruns == 1 and e.crashes == 0 for e in entries)


def test_a_trial_that_fails_without_a_crash_leaves_the_culprit_among_the_rest() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    suspects, rest = _entries([0]), _entries([1, 2])
    batch = Batch(suspects, 0.0, error=ModelFailure("bad"), rest=rest)
    assert recovery.plan(batch) is None  # a lone item's own failure: answered as usual
    plan = recovery.ended(batch, [(suspects[0], ModelFailure("bad"), True)])
    assert [(e.item, failed) for e, _, failed in plan.outcomes] == [(0, True)]
    (trial,) = plan.trials
    assert [e.item for e in trial.suspects + trial.rest] == [1, 2]


def _behind(entries: list[Pending], rest: list[Pending] | None = None) -> Batch:
    """Launched behind the batch its CUDA worker was running when it crashed."""
    crash = WorkerCrashed("died", ran=True, behind=True)
    return Batch(entries, 0.0, error=crash, rest=rest)


def test_a_lone_item_crashed_behind_a_killer_twice_is_searched_and_never_failed() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    (innocent,) = _entries([1])
    for _ in range(3):  # behind a killer's trial again and again
        plan = recovery.plan(_behind([innocent]))
        assert plan is not None and not plan.outcomes and not plan.cleared
        (trial,) = plan.trials
        assert trial.suspects == [innocent] and trial.rest == []
        assert innocent.crashes == 0  # a suspect, not counted against it
    # Its own trial runs alone and answers it.
    search = Search(recovery, killers=set())
    search.run([Trial([innocent])])
    assert search.answered == {1: "ok"}


def test_a_killer_crashed_behind_is_counted_only_when_its_own_trial_crashes() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    (killer,) = _entries([7])
    plan = recovery.plan(_behind([killer]))
    assert plan is not None and killer.crashes == 0
    search = Search(recovery, killers={7})
    search.run(search.take(plan))
    assert search.trials_run == [[7], [7]]  # alone: once more, then condemned
    assert killer.crashes == 2
    assert search.answered[7].startswith("model 'm': this item crashed")


def test_a_batch_crashed_behind_is_searched_without_counting_the_crash() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    entries = _entries(range(4))
    plan = recovery.plan(_behind(entries))
    assert plan is not None and not plan.outcomes and not plan.cleared
    (trial,) = plan.trials
    assert trial.suspects + trial.rest == entries
    assert all(e.crashes == 0 for e in entries)
    # Without splitting, the whole batch fails as any crashed batch does.
    unsplit = Recovery("m", False, BatchStats(), _flat(), lambda: SWAP_S)
    assert unsplit.plan(_behind(entries)) is None


def test_a_trial_crashed_behind_runs_again_as_the_same_trial_and_clears_nothing() -> None:
    recovery = Recovery("m", True, BatchStats(), _flat(), lambda: SWAP_S)
    suspects, rest = _entries(range(2)), _entries(range(2, 6))
    plan = recovery.plan(_behind(suspects, rest))
    assert plan is not None and not plan.cleared and not plan.outcomes
    (trial,) = plan.trials
    assert trial.suspects == suspects and trial.rest == rest
    assert all(e.crashes == 0 for e in suspects + rest)


def test_reruns_run_a_poisoned_batchs_parts_first_and_trials_every_other_batch() -> None:
    reruns = Reruns()
    part, suspects, rest = _entries([1]), _entries([2]), _entries([3])
    reruns.add(Plan(retries=[part], trials=[Trial(suspects, rest)]))
    assert reruns.first(ahead=True) == ([], None)  # each goes alone, on an idle instance
    assert reruns.first(ahead=False) == (part, None)
    assert reruns.first(ahead=True) == ([], None)  # nothing behind a trial's turn either
    assert reruns.first(ahead=False) == (suspects, rest)
    reruns.tried_last = True
    reruns.add(Plan(trials=[Trial(rest)]))
    assert reruns.first(ahead=False) is None  # the queue's turn
    assert reruns.instead(ahead=False) == (rest, [])  # unless it has nothing due
    assert not reruns
