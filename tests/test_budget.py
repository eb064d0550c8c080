"""The learnt padded-volume budget (``max_batch_tokens = "auto"``): what it
learns from batch costs, how the policies keep to it, how it is configured
and reported."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import pytest

from tensorserve.batching.budget import LearntBudget
from tensorserve.batching.policy import (
    FifoPolicy,
    LengthAwarePolicy,
    Waiting,
    budget_report,
    make_policy,
)
from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig
from tests.conftest import REPOSITORY

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


def serve(
    policy: FifoPolicy | LengthAwarePolicy, cost: Cost, batches: int, lengths: tuple[int, int], seed: int = 0
) -> list[tuple[int | None, int, int]]:
    """A closed loop as the batcher runs it: 64 items wait, the policy picks a
    batch, the batch "runs" at ``cost`` and teaches the budget what it cost.
    Returns (the budget it was formed under, its size, its padded volume)
    for every batch."""
    assert policy.budget is not None
    rng = np.random.default_rng(seed)
    waiting = rng.integers(*lengths, size=64).tolist()
    formed = []
    for _ in range(batches):
        limit = policy.budget.limit()
        chosen = policy.select(Waiting(waiting), 32)
        size, longest = len(chosen), max(waiting[i] for i in chosen)
        formed.append((limit, size, size * longest))
        policy.budget.observe(size * longest, sum(waiting[i] for i in chosen), cost(size, longest))
        for i in sorted(chosen, reverse=True):
            del waiting[i]
        waiting += rng.integers(*lengths, size=size).tolist()
    return formed


def test_after_every_few_batches_the_next_explores_around_the_budget() -> None:
    budget = LearntBudget()
    teach(budget, cache_bound)
    limits = []
    for _ in range(4 * LearntBudget.EXPLORE_EVERY):  # each kind of exploring once
        budget.observe(1000, 1000, cache_bound(10, 100))
        limits.append(budget.limit())
        assert budget.limit() == limits[-1], "reading the budget changes nothing"
    assert budget.learnt == 1024
    per_kind = {limit: limits.count(limit) for limit in set(limits)}
    assert per_kind == {1024: len(limits) - 4, 2048: 2, 512: 1, None: 1}


def test_a_server_whose_batches_are_all_full_still_learns_a_budget() -> None:
    """64 callers always waiting, batches of 32 that cost more per element
    than smaller ones: exploring under the one bucket it sees finds them."""
    policy = LengthAwarePolicy(budget=LearntBudget())
    formed = serve(policy, cache_bound, 3000, (8, 129))
    assert {size for _, size, _ in formed[:16]} == {32}
    assert policy.budget is not None and policy.budget.learnt == 1024


def test_the_budget_climbs_back_when_bigger_batches_got_cheaper() -> None:
    """Through the policy, as served: only the batches it forms teach it."""
    policy = LengthAwarePolicy(budget=LearntBudget())
    serve(policy, cache_bound, 3000, (8, 129))
    assert policy.budget is not None and policy.budget.learnt == 1024
    # The machine got quieter: big batches now cost only their elements.
    serve(policy, lambda size, longest: 2e-3 + 6e-6 * size * longest, 1500, (8, 129), seed=1)
    assert policy.budget.learnt is None or policy.budget.learnt > 1024


@pytest.mark.parametrize("policy_cls", [FifoPolicy, LengthAwarePolicy])
def test_long_items_after_short_ones_are_batched_again(policy_cls: Any) -> None:
    """Short items teach a budget of 1024; then items of 1100-2000 steps come
    to a recurrent model, which a lone long item costs the most per element.
    Even two of them are over twice the old budget, so only the batches with
    no budget measure them together; the old buckets are forgotten, and the
    batches grow again."""
    policy = policy_cls(budget=LearntBudget())
    serve(policy, cache_bound, 3000, (8, 129))
    assert policy.budget.learnt == 1024
    formed = serve(policy, per_step, 2000, (1100, 2001), seed=1)
    late = formed[-200:]
    assert policy.budget.learnt is None
    assert sum(size for _, size, _ in late) / len(late) > 16


def test_a_burst_after_a_quiet_spell_of_lone_items_is_batched_at_once() -> None:
    """Lone items teach a recurrent model's budget that a short one is
    nearly as cheap per element as a long one; the first batches of a burst,
    cheaper still per element, undo that within a few batches."""
    budget = LearntBudget()
    rng = np.random.default_rng(0)
    for _ in range(2000):
        length = int(rng.integers(8, 129))
        budget.observe(length, length, per_step(1, length))
    assert budget.learnt is not None and budget.learnt <= 128
    policy = LengthAwarePolicy(budget=budget)
    formed = serve(policy, per_step, 50, (8, 129))
    assert sum(size for _, size, _ in formed) / len(formed) > 16
    assert policy.budget.learnt is None


@pytest.mark.parametrize("policy_cls", [FifoPolicy, LengthAwarePolicy])
def test_policies_keep_to_the_learnt_budget_but_when_exploring(policy_cls: Any) -> None:
    policy = policy_cls(budget=LearntBudget())
    serve(policy, cache_bound, 3000, (8, 129))
    formed = serve(policy, cache_bound, 16 * LearntBudget.EXPLORE_EVERY, (8, 129), seed=3)
    for limit, size, padded in formed:
        assert limit is None or size == 1 or padded <= limit
    explored = [padded for limit, _, padded in formed if limit != 1024]
    assert sum(padded > 1024 for _, _, padded in formed) == sum(p > 1024 for p in explored) > 0
    assert {limit for limit, _, _ in formed} == {1024, 2048, 512, None}


def test_observing_from_several_threads_at_once_loses_nothing() -> None:
    """Batches finish on the finisher, model threads and the event loop."""
    budget = LearntBudget()
    volumes = [2**b for b in range(4, 13)]

    def finish_batches(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            volume = int(rng.choice(volumes))
            budget.observe(volume, volume, cache_bound(1, volume))
            budget.limit(), budget.costs()

    threads = [threading.Thread(target=finish_batches, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert budget.learnt == 1024
    assert sorted(budget.costs()) == volumes


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
    assert config(max_batch_tokens=None).dynamic_batching.max_batch_tokens == 0  # from_function's "none"
    for bad in (-1, "big", "AUTO", 1.5, True):
        with pytest.raises((ConfigError, ValueError), match="max_batch_tokens") as caught:
            config(max_batch_tokens=bad)
        assert "must be 'auto', 0 (no budget) or a whole number >= 1" in str(caught.value)


async def test_the_stats_endpoint_reports_the_learnt_budget(server_url: str) -> None:
    """The suite's real server: every bundled model ships "auto", so on this
    CPU each learns its budget, the tagger too (it once shipped 1024)."""
    async with aiohttp.ClientSession(base_url=server_url) as session:
        stats = await (await session.get("/v2/models/embedder/stats")).json()
        tagger = await (await session.get("/v2/models/tagger/stats")).json()
    assert stats["batching"]["budget"]["mode"] == "learnt"
    assert set(stats["batching"]["budget"]) == {"mode", "max_batch_tokens", "us_per_element"}
    assert tagger["batching"]["budget"]["mode"] == "learnt"


def test_the_server_wide_setting_can_say_auto_or_a_number_but_not_yes() -> None:
    import argparse

    from tensorserve.cli import add_serve_parser, settings_from_args
    from tensorserve.settings import Settings

    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers(dest="command"))
    for flag, expected in (("auto", "auto"), ("0", 0), ("512", 512)):
        args = parser.parse_args(["--max-batch-tokens", flag])
        assert settings_from_args(args).model_overrides()["max_batch_tokens"] == expected
    for bad in (True, "lots", -1, "-1"):
        with pytest.raises(ValueError, match="max_batch_tokens") as caught:
            Settings(max_batch_tokens=bad)
        assert f"must be 'auto', 0 (no budget) or a whole number >= 1, got {bad!r}" in str(caught.value)


def test_warm_up_teaches_the_budget_nothing() -> None:
    """A model's first runs are slow: the budget learns from real traffic only."""
    from tensorserve.serving.model import ServedModel

    with ServedModel.from_repository(REPOSITORY, "embedder", isolation="thread") as model:
        assert model.config.warmup.enabled
        assert model.batcher.options.policy.budget.costs() == {}
        model.infer_many_sync([model.warmup_items()[0][0]], timeout=60)
        assert model.batcher.options.policy.budget.costs() != {}
