"""Invariants of the batch-formation policies (pure code, random queues)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorserve.batching.policy import BatchCostModel, FifoPolicy, LengthAwarePolicy, Waiting

POLICIES = [FifoPolicy, LengthAwarePolicy]


def queue(volumes: list[int], overdue_first: bool = False) -> Waiting:
    return Waiting(volumes, overdue_first)


@pytest.mark.parametrize("policy_cls", POLICIES)
@pytest.mark.parametrize("seed", range(20))
def test_selection_is_a_valid_nonempty_subset(policy_cls: type, seed: int) -> None:
    rng = np.random.default_rng(seed)
    waiting = queue(rng.integers(1, 200, size=rng.integers(1, 100)).tolist(), overdue_first=bool(seed % 2))
    chosen = policy_cls().select(waiting, 16)
    assert chosen, "a non-empty queue must yield a batch"
    assert len(chosen) == len(set(chosen)) <= 16
    assert all(0 <= i < len(waiting) for i in chosen)


@pytest.mark.parametrize("policy_cls", POLICIES)
@pytest.mark.parametrize("seed", range(20))
def test_an_overdue_oldest_item_is_always_in_the_batch(policy_cls: type, seed: int) -> None:
    rng = np.random.default_rng(seed)
    volumes = rng.integers(1, 200, size=64).tolist()
    volumes[0] = 10_000  # the longest item, which length-aware batching would leave last
    assert 0 in policy_cls().select(queue(volumes, overdue_first=True), 8)


@pytest.mark.parametrize("policy_cls", POLICIES)
@pytest.mark.parametrize("seed", range(20))
def test_padded_volume_budget_is_respected(policy_cls: type, seed: int) -> None:
    rng = np.random.default_rng(seed)
    volumes = rng.integers(1, 300, size=50).tolist()
    budget = 1024
    chosen = policy_cls(max_batch_tokens=budget).select(queue(volumes, bool(seed % 2)), 32)
    picked = [volumes[i] for i in chosen]
    assert len(picked) == 1 or len(picked) * max(picked) <= budget


def test_a_lone_item_over_budget_still_runs() -> None:
    for policy in (FifoPolicy(max_batch_tokens=10), LengthAwarePolicy(max_batch_tokens=10)):
        assert policy.select(queue([500, 600]), 8) in ([0], [1])


def test_length_aware_groups_similar_lengths() -> None:
    rng = np.random.default_rng(1)
    volumes = rng.permutation([8] * 16 + [128] * 16).tolist()
    chosen = LengthAwarePolicy().select(queue(volumes), 16)
    assert len({volumes[i] for i in chosen}) == 1
    fifo = FifoPolicy().select(queue(volumes), 16)
    assert fifo == list(range(16))


def test_length_aware_wastes_less_padding_than_fifo_on_random_queues() -> None:
    rng = np.random.default_rng(2)
    def waste(volumes: list[int], chosen: list[int]) -> int:
        picked = [volumes[i] for i in chosen]
        return len(picked) * max(picked) - sum(picked)
    fifo_total = aware_total = 0
    for _ in range(50):
        volumes = rng.integers(8, 129, size=96).tolist()
        fifo_total += waste(volumes, FifoPolicy().select(queue(volumes), 32))
        aware_total += waste(volumes, LengthAwarePolicy().select(queue(volumes), 32))
    assert aware_total < fifo_total / 2


def test_the_cost_model_learns_fixed_per_element_and_per_step_cost() -> None:
    cost = BatchCostModel()
    assert not cost.fitted  # nothing learnt: the policy prefers full batches
    rng = np.random.default_rng(3)
    for _ in range(60):
        size, longest = int(rng.integers(1, 33)), int(rng.integers(8, 129))
        cost.observe(size, longest, 0.002 + 1e-5 * size * longest + 3e-4 * longest)
    assert cost.coefficients == pytest.approx((0.002, 1e-5, 3e-4), rel=1e-3)


def learnt(fixed: float, per_element: float, per_step: float) -> BatchCostModel:
    cost = BatchCostModel()
    for size, longest in ((1, 8), (32, 128), (8, 64), (16, 16), (4, 100), (32, 8)):
        cost.observe(size, longest, fixed + per_element * size * longest + per_step * longest)
    return cost


def test_when_every_padded_element_costs_length_aware_splits_a_mixed_queue() -> None:
    volumes = [8] * 8 + [128] * 8
    chosen = LengthAwarePolicy(cost=learnt(0, 1e-5, 0)).select(queue(volumes), 32)
    assert len({volumes[i] for i in chosen}) == 1, "padding short items to 128 only costs"


@pytest.mark.parametrize("cost", [learnt(0.05, 1e-7, 0), learnt(0, 1e-8, 1e-3)], ids=["launch", "steps"])
def test_when_batches_cost_per_launch_or_per_step_length_aware_fills_the_batch(cost: BatchCostModel) -> None:
    volumes = [8] * 8 + [128] * 8
    assert len(LengthAwarePolicy(cost=cost).select(queue(volumes), 32)) == 16


def _select_run_by_run(policy: LengthAwarePolicy, waiting: Waiting, max_batch_size: int) -> list[int]:
    """The length-aware choice as it was first written: one size at a time,
    the best run of each, the best of those. The grid version must agree."""
    n = len(waiting)
    if n <= 1:
        return list(range(n))
    volumes = np.array(waiting.volumes, dtype=np.int64)
    order = np.argsort(volumes, kind="stable")
    ranked = volumes[order].astype(np.float64)
    prefix = np.concatenate(([0.0], np.cumsum(ranked)))
    forced = int(np.flatnonzero(order == 0)[0]) if waiting.oldest_overdue else None
    limit = policy.max_batch_tokens
    best: tuple[float, float, int, int] | None = None
    for size in range(1, min(max_batch_size, n) + 1):
        first = 0 if forced is None else max(0, forced - size + 1)
        last = n - size if forced is None else min(forced, n - size)
        starts = np.arange(first, last + 1)
        padded = size * ranked[starts + size - 1]
        if limit and size > 1:
            fits = padded <= limit
            if not fits.any():
                break
            starts, padded = starts[fits], padded[fits]
        real = prefix[starts + size] - prefix[starts]
        if policy.cost.fitted:
            scores = real / np.maximum(policy.cost.cost(size, ranked[starts + size - 1]), 1e-12)
        else:
            scores = size * 1e18 - (padded - real)
        i = int(np.argmax(scores))
        candidate = (float(scores[i]), -size, int(starts[i]), size)
        if best is None or candidate[:2] > best[:2]:
            best = candidate
    assert best is not None
    return sorted(int(i) for i in order[best[2] : best[2] + best[3]])


@given(
    volumes=st.lists(st.integers(1, 400), min_size=1, max_size=300),  # past one block
    max_batch_size=st.integers(1, 64),
    overdue=st.booleans(),
    budget=st.sampled_from([None, 64, 500, 4000]),
    learnt=st.sampled_from(
        [None, (1e-3, 1e-6, 0.0), (0.0, 1e-6, 1e-5), (2e-3, 0.0, 1e-4), (5e-3, 0.0, 0.0), (5e-3, 1e-9, 0.0)]
    ),
)
@settings(max_examples=300, deadline=None)
def test_the_grid_choice_is_the_run_by_run_choice(
    volumes: list[int], max_batch_size: int, overdue: bool, budget: int | None,
    learnt: tuple[float, float, float] | None,
) -> None:
    policy = LengthAwarePolicy(budget)
    policy.cost.coefficients = learnt
    waiting = queue(volumes, overdue_first=overdue)
    assert policy.select(waiting, max_batch_size) == _select_run_by_run(policy, waiting, max_batch_size)


def test_a_flat_cost_takes_every_waiting_item_that_fits() -> None:
    policy = LengthAwarePolicy(cost=learnt(5e-3, 0.0, 0.0))
    volumes = [8, 120, 33, 64, 9, 100]
    assert policy.select(queue(volumes), 64) == list(range(6))
    assert policy.select(queue(volumes), 4) == [1, 2, 3, 5], "the longest four: the most real work"


def test_a_flat_cost_chooses_without_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain-Python shortcut (no numpy call: ~250 us a batch after an idle
    wait) serves a flat cost, overdue item or not, and chooses as the grid does."""
    policy = LengthAwarePolicy(cost=learnt(5e-3, 0.0, 0.0))
    volumes = [8, 120, 33, 64, 9, 100, 70, 12]
    cases = [(queue(volumes), 4), (queue(volumes, overdue_first=True), 4), (queue(volumes), 64)]
    expected = [_select_run_by_run(policy, waiting, most) for waiting, most in cases]
    assert expected == [[1, 3, 5, 6], [0, 2, 4, 7], list(range(8))]  # the longest; with the oldest
    monkeypatch.setattr(np, "fromiter", None)  # the grid's first call
    assert [policy.select(waiting, most) for waiting, most in cases] == expected


@pytest.mark.parametrize(
    ("volumes", "most", "learnt"),
    [
        ([6 * 10**15] + [1] * 199, 200, None),  # a waste past the unfitted score's 1e18 a size
        ([0, 2 * 10**18], 2, None),
        ([8741871538103465, 5133356893680477, 8741871538103465], 1, (5e-3, 0.0, 0.0)),  # > 2**53
    ],
)
def test_volumes_past_float_precision_are_chosen_as_the_grid_does(
    volumes: list[int], most: int, learnt: tuple[float, float, float] | None
) -> None:
    """The plain-Python shortcut sums exactly; the grid in float64: where they
    could differ (sums past 2**53), the grid decides."""
    policy = LengthAwarePolicy()
    policy.cost.coefficients = learnt
    waiting = queue(volumes)
    assert policy.select(waiting, most) == _select_run_by_run(policy, waiting, most)
