from __future__ import annotations

import pytest
from tensorserve_bench.targets import BatchingDelta, Counters, counters_from_snapshot


def test_delta_uses_raw_element_counts_when_present() -> None:
    before = Counters(10, 40, 0, 1000, 2000, 0.5, {"4": 10})
    after = Counters(15, 100, 0, 1900, 3000, 0.63, {"4": 12, "16": 3})
    delta = BatchingDelta.between(before, after)
    assert (delta.batches, delta.items, delta.avg_batch_size) == (5, 60, 12.0)
    assert delta.padding_efficiency == pytest.approx(0.9) and delta.padding_efficiency_exact
    assert delta.histogram == {"4": 2, "16": 3}


def test_delta_without_raw_counts_is_exact_only_from_a_fresh_start() -> None:
    fresh = BatchingDelta.between(Counters(), Counters(4, 8, padding_efficiency=0.8))
    assert fresh.padding_efficiency == 0.8 and fresh.padding_efficiency_exact
    later = BatchingDelta.between(
        Counters(4, 8, padding_efficiency=0.8), Counters(6, 12, padding_efficiency=0.7)
    )
    assert later.padding_efficiency == 0.7 and not later.padding_efficiency_exact


def test_counters_from_a_stats_snapshot() -> None:
    snapshot = {
        "total_batches": 4,
        "avg_batch_size": 2.5,
        "padding_efficiency": 0.75,
        "failed_items": 1,
        "batch_size_histogram": {"2": 2, "4": 2},
    }
    counters = counters_from_snapshot(snapshot)
    assert counters.batch_items == 10 and counters.real_elements is None
    assert counters.histogram == {"2": 2, "4": 2}
    exact = counters_from_snapshot({**snapshot, "real_elements": 3, "padded_elements": 4})
    assert (exact.real_elements, exact.padded_elements) == (3, 4)


def test_model_time_per_batch_comes_from_the_summed_seconds_between_two_reads() -> None:
    before = counters_from_snapshot({"total_batches": 10, "batch_items": 20, "batch_seconds": 0.5})
    after = counters_from_snapshot({"total_batches": 14, "batch_items": 30, "batch_seconds": 0.58})
    assert BatchingDelta.between(before, after).avg_batch_ms == pytest.approx(20.0)
    # A server that does not report it (or a window with no batches): unknown.
    assert BatchingDelta.between(Counters(), Counters(3, 3)).avg_batch_ms is None
    assert BatchingDelta.between(after, after).avg_batch_ms is None



def test_a_server_that_counts_no_padding_gives_no_efficiency_and_its_cpu_is_differenced() -> None:
    """A peer's counters: batch sizes only, plus the CPU of the server's
    process tree read by the target that started it."""
    before = Counters(10, 40, padding_efficiency=None, server_cpu_s=3.0)
    after = Counters(15, 100, padding_efficiency=None, histogram={"12": 5}, server_cpu_s=4.5)
    delta = BatchingDelta.between(before, after)
    assert delta.avg_batch_size == 12.0
    assert delta.padding_efficiency is None and not delta.padding_efficiency_exact
    assert delta.server_cpu_s == pytest.approx(1.5)
    assert BatchingDelta.between(Counters(), Counters(3, 3)).server_cpu_s is None


THREADS_MODEL = """
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return torch.full_like(tokens, torch.get_num_threads())  # the model thread's setting
"""


async def test_in_process_target_takes_the_servers_thread_setting(echo_repository) -> None:
    import numpy as np
    from tensorserve_bench.targets import InProcessTarget

    from tensorserve.runtime.device import default_intra_op_threads

    threads = default_intra_op_threads() + 1  # not what the model thread would get anyway
    (echo_repository / "echo" / "1" / "model.py").write_text(THREADS_MODEL)
    item = {"tokens": np.ones(3, np.int64), "token_mask": np.ones(3, np.int64)}
    # As a variant's override (what --variant t2:intra_op_threads=2 gives) or
    # as the keyword: a server setting, not a config.toml field.
    repository = str(echo_repository)
    for target in (
        InProcessTarget(
            repository, "echo", overrides={"intra_op_threads": threads, "policy": "fifo"}
        ),
        InProcessTarget(repository, "echo", overrides={"policy": "fifo"}, intra_op_threads=threads),
    ):
        assert target.overrides == {"policy": "fifo"}
        await target.open()
        try:
            assert target.served is not None
            [outputs] = await target.served.infer_many([item])
            assert outputs["doubled"].tolist() == [threads] * 3
            assert target.served.config.dynamic_batching.policy == "fifo"
            assert target.describe()["intra_op_threads"] == threads
        finally:
            await target.aclose()


@pytest.mark.parametrize(
    ("status", "code", "refused"),
    [(503, "server_busy", True), (503, "would_miss_target", True),
     (503, "model_not_ready", False), (500, "model_failure", False), (429, "server_busy", False)],
)
async def test_only_load_shedding_counts_as_a_refusal(status: int, code: str, refused: bool) -> None:
    import json

    from tensorserve_bench.targets import HttpTarget, RequestFailed

    class Answering:  # the raw pool's part that send uses
        async def send(self, payload: bytes) -> tuple[int, bytes]:
            return status, json.dumps({"error": "no", "code": code}).encode()

    target = HttpTarget("http://127.0.0.1:1", "m")
    target._raw = Answering()  # type: ignore[assignment]
    with pytest.raises(RequestFailed) as failed:
        await target.send(b"")
    assert failed.value.refused is refused
    assert f"HTTP {status} {code}" in str(failed.value)
