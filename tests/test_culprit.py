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


def test_the_arithmetic_of_both_searches_for_a_flat_cost() -> None:
    # 16 items, 100 ms a forward, 35 ms a restart: halves twice (two forwards
    # and one restart each), then the crashed 4 one at a time (four forwards,
    # one restart), against 16 forwards and one restart.
    assert culprit.best_seconds(16, flat, SWAP_S) == pytest.approx(2 * (0.2 + SWAP_S) + 0.4 + SWAP_S)
    assert culprit.singles_seconds(16, flat, SWAP_S) == pytest.approx(1.6 + SWAP_S)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_a_flat_cost_halves(n: int) -> None:
    assert culprit.choose(n, flat, SWAP_S) == "halves"


@pytest.mark.parametrize("n", [2, 3, 8, 16, 64])
def test_a_cost_per_item_runs_the_items_one_at_a_time(n: int) -> None:
    assert culprit.choose(n, per_item, SWAP_S) == "singles"
    assert culprit.choose(n, per_item, 0.0) == "singles"


def test_a_restart_that_costs_a_model_load_runs_one_at_a_time_even_for_a_flat_cost() -> None:
    assert culprit.choose(16, flat, MODEL_LOAD_S) == "singles"
    # The break-even for 16, near R = 0.6 s: halves once, then the crashed 8
    # one at a time, cost 0.2 + R + 0.8 + R = 1.0 s + 2R; singles 1.6 s + R.
    assert culprit.choose(16, flat, 0.59) == "halves"
    assert culprit.choose(16, flat, 0.61) == "singles"


def test_a_tie_kills_fewer_workers() -> None:
    # Two items: halves are singles with the same cost; four: halves run as
    # many forwards as singles and kill one worker more.
    assert culprit.choose(2, flat, SWAP_S) == "singles"
    assert culprit.choose(4, flat, SWAP_S) == "singles"
    assert culprit.choose(4, flat, 0.0) == "singles"


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


def _crash(recovery: Recovery, n: int) -> list[int]:
    entries = _entries(n)
    batch = Batch(entries, 0.0, error=WorkerCrashed("died", ran=True))
    plan = recovery.plan(batch)
    assert plan is not None and not plan.outcomes
    assert sorted(e.item for part in plan.retries for e in part) == list(range(n))
    assert all(e.crashes == 1 for e in entries)
    return [len(part) for part in plan.retries]


def test_recovery_halves_a_crashed_batch_of_a_flat_cost_model() -> None:
    stats = BatchStats()
    recovery = Recovery("m", True, stats, _taught(lambda size: 0.1), lambda: SWAP_S)
    assert _crash(recovery, 16) == [8, 8]
    assert stats.recoveries == {"halves": 1}


def test_recovery_runs_one_at_a_time_for_a_cost_per_item() -> None:
    stats = BatchStats()
    recovery = Recovery("m", True, stats, _taught(lambda size: 0.001 * size), lambda: SWAP_S)
    assert _crash(recovery, 16) == [1] * 16
    assert stats.recoveries == {"singles": 1}


@pytest.mark.parametrize("case", ["no cost model", "nothing learnt", "no restart measured"])
def test_recovery_runs_one_at_a_time_until_both_costs_are_known(case: str) -> None:
    cost = {"no cost model": None, "nothing learnt": BatchCostModel()}.get(
        case, _taught(lambda size: 0.1)
    )
    restart = None if case == "no restart measured" else SWAP_S
    stats = BatchStats()
    assert _crash(Recovery("m", True, stats, cost, lambda: restart), 16) == [1] * 16
    assert stats.recoveries == {"singles": 1}
