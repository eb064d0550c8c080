"""The learnt padded-volume budget (``max_batch_tokens = "auto"``): what it
learns from batch costs, how the policies keep to it, how it is configured
and reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import pytest

from tensorserve.batching.budget import LearntBudget
from tensorserve.batching.policy import FifoPolicy, LengthAwarePolicy, Waiting, budget_report, make_policy
from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig

# Seconds per batch of ``size`` items of ``longest`` tokens (all real).
Cost = Callable[[int, int], float]


def cache_bound(size: int, longest: int) -> float:
    """A transformer on a CPU: a launch cost, then every element costs, and
    a batch past 1024 elements costs more per element (it outgrows the
    caches), as the bundled tagger measured."""
    volume = size * longest
    return 2e-3 + 6e-6 * volume + 6e-6 * max(0, volume - 1024)


def per_step(size: int, longest: int) -> float:
    """A recurrent model: each of ``longest`` steps costs the same whatever the batch size."""
    return 1e-3 + 5e-5 * longest + 1e-7 * size * longest


def teach(budget: LearntBudget, cost: Cost, batches: int = 400, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        size, longest = int(rng.integers(1, 33)), int(rng.integers(8, 129))
        budget.observe(size * longest, size * longest, cost(size, longest))


def test_no_budget_until_two_buckets_are_measured() -> None:
    budget = LearntBudget()
    for _ in range(50):  # one bucket only, however many batches
        budget.observe(1000, 1000, cache_bound(10, 100))
    assert budget.learnt is None and budget.limit() is None
    for _ in range(LearntBudget.MIN_BATCHES):
        budget.observe(4000, 4000, cache_bound(40, 100))
    assert budget.learnt == 1024, "bucket 513..1024 costs less per element than 2049..4096"


def test_a_model_dearer_per_element_in_big_batches_learns_a_budget_at_its_cheapest_bucket() -> None:
    budget = LearntBudget()
    teach(budget, cache_bound)
    assert budget.learnt == 1024
    costs = budget.costs()
    assert min(costs, key=costs.__getitem__) == 1024
    assert costs[512] > 1.2 * costs[1024], "smaller batches pay the launch cost over fewer elements"


def test_the_smallest_bucket_nearly_as_cheap_as_the_cheapest_wins() -> None:
    budget = LearntBudget()
    for volume, per_element in ((512, 10e-6), (1024, 7.5e-6), (2048, 7e-6), (4096, 9e-6)):
        for _ in range(LearntBudget.MIN_BATCHES):
            budget.observe(volume, volume, per_element * volume)
    assert budget.learnt == 1024, "7.5 us is within 20% of 7 us; 10 us is not"


def test_a_recurrent_model_cheaper_per_item_in_big_batches_learns_no_budget() -> None:
    budget = LearntBudget()
    teach(budget, per_step)
    assert budget.learnt is None


def test_every_few_batches_one_bucket_over_the_budget_is_explored() -> None:
    budget = LearntBudget()
    teach(budget, cache_bound)
    limits = [budget.limit() for _ in range(4 * LearntBudget.EXPLORE_EVERY)]
    assert limits.count(2048) == 4
    assert set(limits) == {1024, 2048}


def test_the_budget_climbs_back_when_bigger_batches_got_cheaper() -> None:
    budget = LearntBudget()
    teach(budget, cache_bound)
    assert budget.learnt == 1024
    # The machine got quieter: big batches now cost only their elements.
    teach(budget, lambda size, longest: 2e-3 + 6e-6 * size * longest, batches=600, seed=1)
    assert budget.learnt is None or budget.learnt > 1024


@pytest.mark.parametrize("policy_cls", [FifoPolicy, LengthAwarePolicy])
def test_policies_keep_to_the_learnt_budget_but_when_exploring(policy_cls: Any) -> None:
    budget = LearntBudget()
    teach(budget, cache_bound)
    policy = policy_cls(budget=budget)
    rng = np.random.default_rng(5)
    sizes = []
    for _ in range(2 * LearntBudget.EXPLORE_EVERY):
        volumes = rng.integers(8, 129, size=64).tolist()
        chosen = policy.select([Waiting(v, False) for v in volumes], 32)
        sizes.append(len(chosen) * max(volumes[i] for i in chosen))
    assert max(sizes) <= 2048
    assert sum(s > 1024 for s in sizes) <= 2, "only the exploring batches go over 1024"


def test_a_fixed_budget_wins_over_learning_and_zero_means_none() -> None:
    assert make_policy("length_aware", 512).budget is None
    assert make_policy("length_aware", 512).max_batch_tokens == 512
    assert make_policy("fifo", "auto").budget is not None
    none = make_policy("length_aware", 0)
    assert none.budget is None and none.max_batch_tokens is None
    assert budget_report(none) == {"mode": "none", "max_batch_tokens": None}
    assert budget_report(make_policy("fifo", 512)) == {"mode": "fixed", "max_batch_tokens": 512}


def config(**batching: Any) -> ModelConfig:
    return ModelConfig.model_validate({
        "dynamic_batching": batching,
        "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    })


def test_the_default_budget_is_learnt_and_a_bad_one_is_refused_by_name() -> None:
    assert config().dynamic_batching.max_batch_tokens == "auto"
    assert config(max_batch_tokens=0).dynamic_batching.max_batch_tokens == 0
    for bad in (-1, "big", 1.5):
        with pytest.raises((ConfigError, ValueError), match="max_batch_tokens") as caught:
            config(max_batch_tokens=bad)
        assert "must be 'auto', 0 (no budget) or a whole number >= 1" in str(caught.value)


async def test_the_stats_endpoint_reports_the_learnt_budget(server_url: str) -> None:
    """The suite's real server: the embedder ships no budget, so it learns one."""
    async with aiohttp.ClientSession(base_url=server_url) as session:
        stats = await (await session.get("/v2/models/embedder/stats")).json()
        tagger = await (await session.get("/v2/models/tagger/stats")).json()
    assert stats["batching"]["budget"]["mode"] == "learnt"
    assert set(stats["batching"]["budget"]) == {"mode", "max_batch_tokens", "us_per_element"}
    assert tagger["batching"]["budget"] == {"mode": "fixed", "max_batch_tokens": 1024}
