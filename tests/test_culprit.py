"""How recovery searches a crashed batch for the item that kills workers:
halves when a forward costs the same whatever its size (a GPU), one at a
time when it costs per item, and always one at a time while a worker restart
costs more than the forwards halving would save (batching/culprit.py, and
Recovery.plan reading the learnt cost model and the measured restart)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tensorserve.batching import culprit
from tensorserve.batching.admission import Pending
from tensorserve.batching.policy import BatchCostModel
from tensorserve.batching.recovery import Recovery
from tensorserve.batching.results import Batch
from tensorserve.batching.stats import BatchStats
from tensorserve.errors import WorkerCrashed

SWAP_S = 0.035  # a standby worker taking over (docs/reliability.md)
MODEL_LOAD_S = 4.5  # a worker started afresh


def flat(size: int) -> float:
    return 0.1  # 100 ms whatever the batch


def per_item(size: int) -> float:
    return 0.01 * size


def test_the_expected_cost_of_a_search_of_one_or_two_suspects() -> None:
    # A lone suspect must crash alone: one forward and one restart. Two: trial
    # one (a forward); half the time it crashes (a restart, and it is
    # condemned), half the time the other must still crash alone.
    assert culprit.expected_seconds(1, flat, SWAP_S) == pytest.approx(0.1 + SWAP_S)
    assert culprit.expected_seconds(2, flat, SWAP_S) == pytest.approx(
        0.1 + 0.5 * SWAP_S + 0.5 * (0.1 + SWAP_S)
    )


@pytest.mark.parametrize(("n", "size"), [(5, 2), (8, 4), (16, 8), (64, 32)])
def test_a_flat_cost_tests_half_the_suspects(n: int, size: int) -> None:
    assert culprit.next_trial(n, flat, SWAP_S) == size
    assert culprit.choose(n, flat, SWAP_S) == "halves"


def test_a_flat_cost_tests_the_last_four_one_at_a_time() -> None:
    # One at a time stops at the culprit: 0.285 s expected against 0.303 s for
    # a half of 2, which needs one more trial whichever way it goes.
    assert culprit.next_trial(4, flat, SWAP_S) == 1
    assert culprit.expected_seconds(4, flat, SWAP_S) == pytest.approx(0.285, abs=1e-3)


@pytest.mark.parametrize("n", [2, 3, 8, 16, 64])
def test_a_cost_per_item_tests_one_item_at_a_time(n: int) -> None:
    assert culprit.next_trial(n, per_item, SWAP_S) == 1
    assert culprit.choose(n, per_item, 0.0) == "singles"


def test_a_restart_that_costs_a_model_load_tests_one_item_at_a_time() -> None:
    # Each halving risks a restart; at 4.5 s a forward of 100 ms is nothing.
    assert culprit.next_trial(16, flat, MODEL_LOAD_S) == 1
    assert culprit.next_trial(16, flat, 0.0) == 8


# ------------------------------------------------------------------ Recovery.plan
def _entries(n: int, volume: int = 8) -> list[Pending]:
    return [Pending(i, volume, Future(), None, 0.0, None) for i in range(n)]


def _taught(seconds: object) -> BatchCostModel:
    """A cost model taught batches of 1..16 items of 8 elements."""
    model = BatchCostModel()
    for _ in range(4):
        for size in range(1, 17):
            model.observe(size, 8, seconds(size))  # type: ignore[operator]
    return model


def _crash(recovery: Recovery, n: int) -> tuple[int, int]:
    """A crashed batch of ``n``: the sizes of its first trial and of the rest."""
    entries = _entries(n)
    batch = Batch(entries, 0.0, error=WorkerCrashed("died", ran=True))
    plan = recovery.plan(batch)
    assert plan is not None and not plan.outcomes and not plan.retries and not plan.cleared
    (trial,) = plan.trials
    assert [e.item for e in [*trial.suspects, *trial.rest]] == list(range(n))
    assert all(e.crashes == 1 for e in entries)
    return len(trial.suspects), len(trial.rest)


def test_recovery_tests_half_of_a_crashed_batch_of_a_flat_cost_model() -> None:
    stats = BatchStats()
    recovery = Recovery("m", True, stats, _taught(lambda size: 0.1), lambda: SWAP_S)
    assert _crash(recovery, 16) == (8, 8)
    assert stats.recoveries == {"halves": 1}


def test_recovery_tests_one_item_at_a_time_for_a_cost_per_item() -> None:
    stats = BatchStats()
    recovery = Recovery("m", True, stats, _taught(lambda size: 0.001 * size), lambda: SWAP_S)
    assert _crash(recovery, 16) == (1, 15)
    assert stats.recoveries == {"singles": 1}


@pytest.mark.parametrize("case", ["no cost model", "nothing learnt", "no restart measured"])
def test_recovery_tests_one_at_a_time_until_both_costs_are_known(case: str) -> None:
    cost = {"no cost model": None, "nothing learnt": BatchCostModel()}.get(
        case, _taught(lambda size: 0.1)
    )
    restart = None if case == "no restart measured" else SWAP_S
    stats = BatchStats()
    assert _crash(Recovery("m", True, stats, cost, lambda: restart), 16) == (1, 15)
    assert stats.recoveries == {"singles": 1}
