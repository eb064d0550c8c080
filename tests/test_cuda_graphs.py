"""Issue 50's bucketed CUDA graphs with real captures on cuda:0 (skipped
where there is no CUDA device; tests/test_graphs.py covers the rest on the
CPU): the tagger's rows equal eager's, each bucket is captured at most
once, a forward that syncs falls back to eager with one log line, and auto
logs its decision once per model."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import torch
from tensorserve_bench.tolerance import tolerance

from tensorserve import ServedModel
from tensorserve.repository.config import parse_config
from tensorserve.runtime.executor import ThreadExecutor, free_device_bytes
from tensorserve.runtime.graph_buckets import Bucket
from tensorserve.runtime.graphs import GraphedForward
from tests.conftest import REPOSITORY

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
rng = np.random.default_rng(50)
LOGGER = "tensorserve.runtime.graphs"


def token_items(n: int) -> list[dict[str, np.ndarray]]:
    return [
        {"input_ids": rng.integers(1, 4096, size=int(k), dtype=np.int64),
         "attention_mask": np.ones(int(k), np.int64)}
        for k in rng.integers(1, 200, size=n)
    ]  # fmt: skip


def tagger(compile: str, instances: int = 1) -> ServedModel:
    return ServedModel.from_repository(
        REPOSITORY, "tagger", device="cuda", compile=compile, isolation="thread",
        instance_count=instances,
    )  # fmt: skip


@pytest.mark.parametrize("instances", [1, 2])
def test_the_tagger_through_real_graphs_gives_eagers_rows(
    instances: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    captured: list[Bucket] = []
    capture = GraphedForward._capture

    def recording(self: GraphedForward, bucket: Bucket) -> Any:
        captured.append(bucket)
        return capture(self, bucket)

    monkeypatch.setattr(GraphedForward, "_capture", recording)
    items = token_items(96)
    with tagger("off") as eager:
        expected = eager.infer_many_sync(items)
    with tagger("reduce-overhead", instances) as graphed:
        graphed.warmup()
        results = graphed.infer_many_sync(items)
        forwards = list(graphed.executor._forwards.values())  # type: ignore[union-attr]
    assert forwards and all(f.switch.on for f in forwards)
    graphs = [bucket for f in forwards for bucket in f.graphs]
    assert len(captured) == len(graphs)  # each bucket an instance used: one capture
    assert all(len(set(f.graphs)) == len(f.graphs) for f in forwards)
    for want, got in zip(expected, results):  # float32's bound (tensorserve_bench.tolerance)
        assert got["logits"].shape == want["logits"].shape
        bound = tolerance("float32", float(np.abs(want["logits"]).max()))
        assert float(np.abs(got["logits"] - want["logits"]).max()) <= bound


def test_a_forward_that_syncs_falls_back_to_eager_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def syncs(x: torch.Tensor) -> torch.Tensor:
        scale = float(x.abs().max())  # reads the device on the host: no capture
        return x * 2 + 0 * scale

    spec = {"name": "x", "dtype": "float32", "shape": [-1], "max_length": 64}
    with caplog.at_level(logging.INFO, logger=LOGGER), ServedModel.from_function(
        syncs, inputs=[spec], outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        device="cuda", compile="reduce-overhead", max_batch_size=8,
    ) as model:  # fmt: skip
        items = [{"x": rng.normal(size=n).astype(np.float32)} for n in (3, 9, 5, 17)]
        results = model.infer_many_sync(items) + model.infer_many_sync(items)
    for item, result in zip(items * 2, results):
        np.testing.assert_allclose(result["y"], item["x"] * 2, rtol=1e-6)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "runs eager from now on" in lines[0]


def test_auto_times_the_tagger_once_and_logs_both_timings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER), tagger("auto", instances=2) as model:
        model.warmup()
    lines = [r.getMessage() for r in caplog.records if "compile = 'auto'" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "GPU time" in lines[0] and "wall time" in lines[0]


TOY = {
    "max_batch_size": 8,
    "compile": "reduce-overhead",
    "input": [{"name": "x", "dtype": "float32", "shape": [-1], "max_length": 64}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
}


def test_two_instances_capturing_at_once_both_keep_their_graphs() -> None:
    """Each capture empties the caches; two at once used to trip torch's
    captures_underway assert and turn graphs off for the model."""
    weight = torch.randn(64, 64, device="cuda:0")

    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ weight[: x.shape[1], : x.shape[1]]) + x

    config = parse_config(TOY, "two")
    executor = ThreadExecutor(model, config, torch.device("cuda", 0), instance_count=2, name="two")
    start = threading.Barrier(2, timeout=30)
    batches = [torch.randn(3, 20), torch.randn(5, 30)]
    executed: dict[int, Any] = {}

    def run(instance: int) -> None:
        executor.start_instance(instance)
        start.wait()  # both instances capture their first bucket at once
        executed[instance] = executor.collect(executor.launch({"x": batches[instance]}, instance))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    forwards = list(executor._forwards.values())
    assert len(forwards) == 2 and forwards[0].switch.on
    assert not forwards[0].switch.eager_buckets
    assert all(len(f.graphs) == 1 and f.backend.reserved_bytes > 0 for f in forwards)
    for instance, batch in enumerate(batches):
        assert executed[instance].captured  # its time is the capture's
        want = model(batch.cuda()).cpu().numpy()
        np.testing.assert_allclose(executed[instance].batched["y"], want, atol=1e-4, rtol=1e-4)
    held = sum(f.backend.reserved_bytes for f in forwards)  # the pools' free blocks are no batch's
    assert executor.free_memory_bytes() == free_device_bytes(torch.device("cuda", 0), held)


def test_a_capture_that_fails_at_one_bucket_leaves_the_others_graphed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool is left usable (endAllocateToPool): the next bucket captures."""

    def picky(x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and x.shape[1] == 16:
            raise RuntimeError("something of this bucket's own")
        return x * 2

    config = parse_config(TOY, "picky")
    executor = ThreadExecutor(picky, config, torch.device("cuda", 0), name="picky")
    executor.start_instance(0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for length in (12, 12, 5):  # bucket 16 fails once, then eager; bucket 8 captures
            x = torch.randn(2, length)
            out = executor.collect(executor.launch({"x": x}, 0))
            np.testing.assert_allclose(out.batched["y"], (x * 2).numpy(), rtol=1e-6)
    (forward,) = executor._forwards.values()
    assert forward.switch.on and list(forward.graphs) == [Bucket(2, (8,))]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "bucket at batch 2, lengths [16] runs eager" in lines[0]
