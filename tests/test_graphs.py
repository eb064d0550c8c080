"""Issue 50's bucketed CUDA graphs, everything but the capture itself, on the
CPU: a batch padded up to its bucket and its outputs sliced back give every
row what the model gives it alone, captures happen once per bucket, and a
capture that fails or an output of the wrong shape leaves the model eager
with one log line. The capture backend is injected: here a "replay" calls
the model again over the bucket's static buffers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tensorserve.batching.collate import pad, unpad
from tensorserve.repository.config import ModelConfig, load_config, parse_config
from tensorserve.repository.loader import discover, load_model, read_config
from tensorserve.runtime.executor import ThreadExecutor, on_device
from tensorserve.runtime.graph_buckets import Bucket, ForwardTimings, graph_plan
from tensorserve.runtime.graphs import GraphedForward, GraphSwitch, Replay
from tests.conftest import REPOSITORY

rng = np.random.default_rng(50)
CPU = torch.device("cpu")


class EagerCapture:
    """A capture backend that "replays" by calling the forward again over
    the same static buffers, counting its captures."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, forward: Callable[[], Any]) -> Replay:
        self.captures += 1
        forward()  # as CudaGraphs does: one run before the capture
        return forward


class FailingCapture:
    def capture(self, forward: Callable[[], Any]) -> Replay:
        raise RuntimeError("operation not permitted when stream is capturing")


def bundled(name: str, **update: Any) -> tuple[ModelConfig, torch.nn.Module]:
    source = discover(REPOSITORY)[name]
    module = load_model(source, None, read_config(source), intra_op_threads=1).module
    assert isinstance(module, torch.nn.Module)
    config = load_config(REPOSITORY / name / "config.toml").model_copy(update=update)
    return config, module.eval()


def token_items(lengths: list[int]) -> list[dict[str, np.ndarray]]:
    return [
        {"input_ids": rng.integers(1, 4096, size=n, dtype=np.int64),
         "attention_mask": np.ones(n, np.int64)}
        for n in lengths
    ]  # fmt: skip


def graphed(config: ModelConfig, model: Any, backend: Any, label: str = "toy") -> GraphedForward:
    switch = GraphSwitch(label, graph_plan(config), measure_first=False)
    return GraphedForward(model, switch, backend, CPU)


def through(forward: Callable[..., Any], config: ModelConfig, items: list[Any]) -> list[Any]:
    """collate.pad -> forward -> collate.unpad, as the executor runs a batch."""
    batch = pad(items, config.input)
    with torch.inference_mode():
        out = forward(**batch.features)
    named = out if isinstance(out, dict) else {config.output[0].name: out}
    host = {name: t.contiguous().numpy() for name, t in named.items()}
    sources = {o.name: config.unpad_source(o) for o in config.output}
    return unpad(host, batch, config.output, sources)


@pytest.mark.parametrize(
    ("name", "update"), [("tagger", {}), ("embedder", {"request_parameter": []})]
)
def test_rows_through_bucket_padding_equal_each_item_run_alone(
    name: str, update: dict[str, Any]
) -> None:
    """The tagger's per-token logits (they follow the length) and the
    embedder's pooled vectors (they do not) through the bucket path."""
    config, model = bundled(name, **update)
    backend = EagerCapture()
    forward = graphed(config, model, backend)
    lengths = [5, 37, 12]  # bucket (4, 64): one all-pad row, 27+ pad columns
    items = token_items(lengths)
    got = through(forward, config, items)
    alone = [through(model, config, [item])[0] for item in items]
    output = config.output[0].name
    for want, row in zip(alone, got):
        assert row[output].shape == want[output].shape
        np.testing.assert_allclose(row[output], want[output], atol=1e-4, rtol=1e-4)
    assert list(forward.graphs) == [Bucket(4, (64, 64))]
    assert backend.captures == 1


def test_each_bucket_is_captured_once_and_reused() -> None:
    config, model = bundled("tagger")
    backend = EagerCapture()
    forward = graphed(config, model, backend)
    for lengths in ([3, 9], [16, 10], [2, 4, 7], [9, 30, 1]):
        through(forward, config, token_items(lengths))
    # (2, 16), (2, 16), (4, 8), (4, 32): three buckets, three captures
    assert set(forward.graphs) == {Bucket(2, (16, 16)), Bucket(4, (8, 8)), Bucket(4, (32, 32))}
    assert backend.captures == 3


def test_padding_rows_and_positions_hold_the_pad_values_not_a_previous_batch() -> None:
    config = parse_config({
        "max_batch_size": 4,
        "input": [
            {"name": "ids", "dtype": "int64", "shape": [-1], "pad_value": -1, "max_length": 64},
            {"name": "mask", "dtype": "int64", "shape": [-1], "pad_value": 0, "max_length": 64},
        ],
        "output": [{"name": "seen", "dtype": "int64", "shape": [-1]}],
    }, "toy")  # fmt: skip
    seen: list[torch.Tensor] = []

    def model(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seen.append(ids.clone())
        return ids * 10 + mask

    forward = graphed(config, model, EagerCapture())
    big = [{"ids": np.arange(7) + 1, "mask": np.ones(7, np.int64)}] * 3
    small = [{"ids": np.array([5, 6]), "mask": np.ones(2, np.int64)}] * 2
    through(forward, config, big)  # bucket (4, 8)
    rows = through(forward, config, small)  # (2, 2) padded: bucket (2, 8)
    through(forward, config, small[:1] * 3)  # bucket (4, 8) again, over the big batch's values
    assert [r["seen"].tolist() for r in rows] == [[51, 61], [51, 61]]
    last = seen[-1]
    assert last.shape == (4, 8)
    assert last[:3, :2].tolist() == [[5, 6]] * 3
    assert (last[:3, 2:] == -1).all() and (last[3] == -1).all()  # pad values, no 7s left


def test_a_capture_that_fails_runs_the_model_eager_for_good_with_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, model = bundled("tagger")
    forward = graphed(config, model, FailingCapture(), label="tagger")
    items = token_items([4, 9])
    with caplog.at_level(logging.INFO, logger="tensorserve.runtime.graphs"):
        got = through(forward, config, items)
        through(forward, config, token_items([30, 31, 2]))  # another bucket: no new try
    want = through(model, config, items)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["logits"], b["logits"], atol=1e-5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "'tagger'" in lines[0] and "eager" in lines[0]
    assert "RuntimeError: operation not permitted when stream is capturing" in lines[0]
    assert not forward.switch.on and not forward.graphs


def test_an_output_that_does_not_follow_the_bucket_turns_graphs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config({
        "max_batch_size": 4,
        "input": [{"name": "x", "dtype": "float32", "shape": [-1], "max_length": 64}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    }, "toy")  # fmt: skip

    def model(x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] * 2  # a length of its own, not its input's

    forward = graphed(config, model, EagerCapture())
    items = [{"x": np.ones(3, np.float32)}, {"x": np.full(2, 3.0, np.float32)}]
    with caplog.at_level(logging.WARNING, logger="tensorserve.runtime.graphs"):
        rows = through(forward, config, items)
    assert [r["y"].tolist() for r in rows] == [[2.0, 2.0, 2.0], [6.0, 6.0]]  # eager's answer
    assert not forward.switch.on
    (line,) = [r.getMessage() for r in caplog.records]
    assert "output 'y' has shape [2, 3] at batch 2, lengths [8]" in line


def test_a_forward_that_returns_something_else_turns_graphs_off() -> None:
    config = parse_config({
        "max_batch_size": 4,
        "input": [{"name": "x", "dtype": "float32", "shape": [2]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [2]}],
    }, "toy")  # fmt: skip
    forward = graphed(config, lambda x: [row for row in x], EagerCapture())
    out = forward(x=torch.ones(3, 2))
    assert isinstance(out, list) and len(out) == 3  # the eager per-item list, as ever
    assert forward.switch.off_reason is not None and "list" in forward.switch.off_reason


def test_off_never_replays_and_a_shape_past_the_buckets_runs_eager() -> None:
    config, model = bundled("tagger")
    backend = EagerCapture()
    forward = graphed(config, model, backend)
    ids = torch.ones(2, 600, dtype=torch.int64)  # past max_length: the model's own error
    with pytest.raises(ValueError, match="exceeds max_len"), torch.inference_mode():
        forward(input_ids=ids, attention_mask=ids)
    assert backend.captures == 0 and forward.switch.on


def test_reduce_overhead_on_the_cpu_runs_eager_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, model = bundled("tagger", compile="reduce-overhead")
    with caplog.at_level(logging.INFO, logger="tensorserve.runtime.graphs"):
        fn = on_device(model, config, CPU)
        executor = ThreadExecutor(fn, config, CPU, name="tagger")
    assert fn is model  # not torch.compile'd: the server's own graphs, CUDA-only
    assert executor._graphs is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("model 'tagger': compile = 'reduce-overhead' runs eager on cpu")
    executor.start_instance(0)
    batch = pad(token_items([3, 5]), config.input)
    executed = executor.collect(executor.launch(batch.features, 0))
    assert executed.batched is not None and executed.batched["logits"].shape == (2, 5, 9)


def test_auto_and_off_on_the_cpu_are_eager_and_quiet(caplog: pytest.LogCaptureFixture) -> None:
    for mode in ("auto", "off"):
        config, model = bundled("tagger", compile=mode)
        with caplog.at_level(logging.INFO, logger="tensorserve.runtime.graphs"):
            assert on_device(model, config, CPU) is model
            assert ThreadExecutor(model, config, CPU)._graphs is None
    assert not caplog.records


def test_out_of_memory_while_capturing_is_the_batchs_and_graphs_stay_on() -> None:
    """The executor splits the batch; the bucket is tried again later."""

    class OutOfMemory:
        def capture(self, forward: Callable[[], Any]) -> Replay:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    config, model = bundled("tagger")
    forward = graphed(config, model, OutOfMemory())
    batch = pad(token_items([3, 4]), config.input)
    with pytest.raises(torch.OutOfMemoryError), torch.inference_mode():
        forward(**batch.features)
    assert forward.switch.on and not forward.graphs


def test_the_executor_runs_an_instances_graphed_forward_and_unpads_as_ever() -> None:
    """launch -> GraphedForward -> named outputs -> host, through the
    executor's own path (on CUDA start_instance installs the forward)."""
    config, model = bundled("tagger")
    executor = ThreadExecutor(model, config, CPU, name="tagger")
    backend = EagerCapture()
    executor._forwards[0] = graphed(config, model, backend)
    executor.start_instance(0)
    items = token_items([6, 19, 3])
    batch = pad(items, config.input)
    executed = executor.collect(executor.launch(batch.features, 0))
    assert executed.batched is not None
    assert executed.batched["logits"].shape == (3, 19, 9)  # the padded batch's, not (4, 32, 9)
    rows = unpad(executed.batched, batch, config.output, {"logits": "input_ids"})
    for item, row in zip(items, rows):
        (want,) = through(model, config, [item])
        np.testing.assert_allclose(row["logits"], want["logits"], atol=1e-4, rtol=1e-4)
    assert backend.captures == 1


def test_auto_times_once_for_all_instances_and_logs_both_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config, _ = bundled("tagger")
    switch = GraphSwitch("tagger", graph_plan(config), measure_first=True)
    assert not switch.on  # eager until timed
    timings = [ForwardTimings(gpu_s=0.0008, wall_s=0.0042)]
    with caplog.at_level(logging.INFO, logger="tensorserve.runtime.graphs"):
        assert switch.decide(timings.pop)  # a second timing would raise IndexError
        assert switch.decide(timings.pop)
    assert switch.on
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (
        "model 'tagger': compile = 'auto' chose CUDA graphs: GPU time 0.800 ms, wall time "
        "4.200 ms per batch at batch 32"
    )
    compute_bound = GraphSwitch("tagger", graph_plan(config), measure_first=True)
    assert not compute_bound.decide(lambda: ForwardTimings(gpu_s=0.0049, wall_s=0.005))
    assert not compute_bound.on


def test_a_timing_that_fails_leaves_the_model_eager(caplog: pytest.LogCaptureFixture) -> None:
    config, _ = bundled("tagger")
    switch = GraphSwitch("tagger", graph_plan(config), measure_first=True)

    def fails() -> Any:
        raise RuntimeError("CUDA out of memory")

    with caplog.at_level(logging.INFO, logger="tensorserve.runtime.graphs"):
        assert not switch.decide(fails)
    assert not switch.on
    (line,) = [r.getMessage() for r in caplog.records]
    assert "runs eager: timing its forward failed: RuntimeError: CUDA out of memory" in line
