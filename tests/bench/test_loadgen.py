from __future__ import annotations

import math

import pytest
from tensorserve_bench.lengths import uniform
from tensorserve_bench.loadgen import run_point
from tensorserve_bench.summaries import percentiles_ms
from tensorserve_bench.sweep import Variant, build_pool, run_bench
from tensorserve_bench.targets import InProcessTarget


async def test_closed_loop_keeps_concurrency_requests_in_flight(fake_target, token_specs) -> None:
    target = fake_target(token_specs, delay=0.005)
    pool, _ = build_pool(target, uniform(4, 8), items_per_request=2, pool_items=20)
    point = await run_point(target, pool, concurrency=3, duration=0.3, warmup=0.05)
    assert target.max_in_flight == 3
    assert point.requests > 10 and point.items == 2 * point.requests
    assert point.errors == 0 and point.concurrency == 3 and point.rate is None
    assert point.items_per_s == pytest.approx(point.items / point.elapsed_s)
    assert 5 <= point.latency_ms["p50"] <= point.latency_ms["p99"] <= point.latency_ms["max"]
    # the counters' difference covers the measured window only
    assert point.batches == point.requests and point.avg_batch_size == 2.0


async def test_failures_are_counted_and_sampled_not_raised(fake_target, token_specs) -> None:
    target = fake_target(token_specs, delay=0.001, fail_every=3)
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    point = await run_point(target, pool, concurrency=2, duration=0.2, warmup=0)
    assert point.errors > 0 and point.requests > 0
    assert point.error_samples[0] == "RuntimeError: synthetic failure"


async def test_open_loop_offers_the_rate_whatever_the_latency(fake_target, token_specs) -> None:
    target = fake_target(token_specs, delay=0.05)  # 50 ms each: a closed loop of 1 gets 20/s
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    point = await run_point(target, pool, mode="open", rate=200, duration=0.5, warmup=0, seed=1)
    assert 50 < point.requests < 160  # Poisson around 100
    assert target.max_in_flight > 5
    assert point.latency_ms["p50"] >= 50 and point.rate == 200 and point.concurrency is None


async def test_refusals_are_counted_apart_from_errors_with_how_fast_they_came_back(
    fake_target, token_specs
) -> None:
    target = fake_target(token_specs, delay=0.02, refuse_every=4)  # refused at once, served in 20 ms
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    point = await run_point(target, pool, mode="open", rate=300, duration=0.4, warmup=0, seed=3)
    sent = len(target.sent)
    assert point.refused == sent // 4 and point.errors == 0 and point.requests == sent - sent // 4
    assert point.refusal_latency_ms["p99"] < 20 <= point.latency_ms["p50"]
    # How late the generator sent is reported (well under a second on any machine).
    assert 0 <= point.late_ms["p50"] <= point.late_ms["p99"] < 0.5e3


async def test_an_open_loop_phase_runs_with_the_garbage_collector_paused(
    fake_target, token_specs
) -> None:
    import gc

    seen: list[bool] = []

    class Watching(fake_target):  # type: ignore[misc, valid-type]
        async def send(self, payload):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            await super().send(payload)

    target = Watching(token_specs, delay=0.001)
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    await run_point(target, pool, mode="open", rate=200, duration=0.1, warmup=0, seed=1)
    assert seen and not any(seen)
    assert gc.isenabled()


async def test_open_loop_drops_beyond_max_outstanding(fake_target, token_specs) -> None:
    target = fake_target(token_specs, delay=0.2)
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    point = await run_point(
        target, pool, mode="open", rate=500, duration=0.2, warmup=0, max_outstanding=5
    )
    assert target.max_in_flight == 5 and point.dropped > 0


async def test_pool_items_come_from_the_lengths_file(fake_target, token_specs, tmp_path) -> None:
    from tensorserve_bench.lengths import parse_lengths

    path = tmp_path / "lengths.txt"
    path.write_text("5\n23\n61\n")
    target = fake_target(token_specs)
    pool, summary = build_pool(target, parse_lengths(str(path)), items_per_request=3, pool_items=30)
    lengths = {item["input_ids"].shape[0] for request in pool for item in request.payload}
    assert lengths == {5, 23, 61}
    assert (summary["min"], summary["max"]) == (5, 61) and str(path) in summary["distribution"]


async def test_progress_adds_up_to_the_planned_time(fake_target, token_specs) -> None:
    target = fake_target(token_specs, delay=0.001)
    pool, _ = build_pool(target, uniform(4, 8), pool_items=10)
    ticks: list[float] = []
    await run_point(
        target,
        pool,
        concurrency=1,
        duration=0.6,
        warmup=0.1,
        progress=lambda seconds, status: ticks.append(seconds),
    )
    assert len(ticks) >= 2 and sum(ticks) == pytest.approx(0.7)


def test_latency_summaries_use_the_servers_percentile() -> None:
    stats = percentiles_ms([i / 1000 for i in reversed(range(1, 101))])
    # Nearest rank (tensorserve.percentiles): a latency a request had, not 50.5.
    assert stats["p50"] == pytest.approx(50.0) and stats["p99"] == pytest.approx(99.0)
    assert stats["max"] == 100.0 and stats["mean"] == pytest.approx(50.5)
    assert math.isnan(percentiles_ms([])["p50"])


async def test_run_point_refuses_bad_settings(fake_target, token_specs) -> None:
    target = fake_target(token_specs)
    pool, _ = build_pool(target, uniform(4, 8), pool_items=2)
    with pytest.raises(ValueError, match="rate"):
        await run_point(target, pool, mode="open", duration=1)
    with pytest.raises(ValueError):
        await run_point(target, pool, concurrency=0, duration=1)


async def test_in_process_variants_get_their_overrides(echo_repository) -> None:
    result = await run_bench(
        lambda v: InProcessTarget(str(echo_repository), "echo", overrides=v.overrides),
        lengths=uniform(2, 30),
        variants=[Variant("fifo", {"policy": "fifo"}), Variant("small", {"max_batch_size": 2})],
        concurrency=[4],
        duration=0.3,
        warmup=0.05,
        pool_items=32,
    )
    assert [p.variant for p in result.points] == ["fifo", "small"]
    configs = {t["variant"]: t["config"] for t in result.targets}
    assert configs["fifo"]["policy"] == "fifo" and configs["small"]["max_batch_size"] == 2
    for point in result.points:
        assert point.items > 0 and point.errors == 0 and point.padding_efficiency_exact
        assert 0 < point.padding_efficiency <= 1
        assert sum(point.batch_size_histogram.values()) == point.batches
    assert max(int(b) for b in result.points[1].batch_size_histogram) <= 2
