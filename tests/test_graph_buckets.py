"""The pure half of issue 50's CUDA graphs: buckets, eligibility, the mode a
config gets on each device, and the auto rule from made-up timings."""

from __future__ import annotations

from typing import Any

import pytest

from tensorserve.repository.config import ModelConfig, load_config, parse_config
from tensorserve.repository.platforms import platform_problem
from tensorserve.runtime.graph_buckets import (
    Bucket,
    ForwardTimings,
    GraphMode,
    graph_mode,
    graph_plan,
    ladder,
    launch_bound,
    plan_problem,
)
from tests.conftest import REPOSITORY


def bundled(name: str, **update: Any) -> ModelConfig:
    return load_config(REPOSITORY / name / "config.toml").model_copy(update=update)


def toy(**fields: Any) -> ModelConfig:
    data: dict[str, Any] = {
        "max_batch_size": 8,
        "input": [{"name": "x", "dtype": "float32", "shape": [-1, 4], "max_length": 100}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}],
    }
    data.update(fields)
    return parse_config(data, "toy")


def test_ladders_are_powers_of_two_then_the_limit() -> None:
    assert ladder(32) == (1, 2, 4, 8, 16, 32)
    assert ladder(24) == (1, 2, 4, 8, 16, 24)
    assert ladder(1) == (1,)
    assert ladder(512, 8) == (8, 16, 32, 64, 128, 256, 512)
    assert ladder(100, 8) == (8, 16, 32, 64, 100)


def test_a_padded_batch_falls_into_the_bucket_above_it_on_each_axis() -> None:
    plan = graph_plan(bundled("tagger"))
    assert plan.batch_sizes == (1, 2, 4, 8, 16, 32)
    shapes = {"input_ids": (3, 37), "attention_mask": (3, 37)}
    assert plan.bucket(shapes) == Bucket(4, (64, 64))
    assert plan.bucket({"input_ids": (32, 512), "attention_mask": (32, 512)}) == Bucket(
        32, (512, 512)
    )
    assert plan.bucket({"input_ids": (1, 1), "attention_mask": (1, 1)}) == Bucket(1, (8, 8))
    assert plan.bucket_shape(0, Bucket(4, (64, 64))) == (4, 64)
    assert plan.representative() == Bucket(32, (64, 64))  # a full batch, a middle length


def test_shapes_outside_the_buckets_have_none_and_run_eager() -> None:
    plan = graph_plan(bundled("tagger"))
    assert plan.bucket({"input_ids": (33, 8), "attention_mask": (33, 8)}) is None  # > max batch
    assert plan.bucket({"input_ids": (2, 600), "attention_mask": (2, 600)}) is None  # > max_length
    assert plan.bucket({"input_ids": (2, 8), "attention_mask": (3, 8)}) is None  # rows disagree
    assert plan.bucket({"input_ids": (2, 8)}) is None  # an input missing
    fixed = graph_plan(toy())
    assert fixed.bucket({"x": (2, 9, 4)}) == Bucket(2, (16,))
    assert fixed.bucket({"x": (2, 9, 5)}) is None  # a fixed axis is not as declared


def test_outputs_know_the_input_whose_length_they_follow() -> None:
    plan = graph_plan(bundled("tagger"))
    (logits,) = plan.outputs
    assert (logits.variable_axis, logits.source) == (0, "input_ids")
    pooled = graph_plan(bundled("embedder", request_parameter=[]))
    assert [(o.variable_axis, o.source) for o in pooled.outputs] == [(None, None)]
    ids, mask = plan.inputs
    assert (ids.pad_value, mask.pad_value, ids.warmup_value) == (0, 0, 1)


def test_outputs_are_cut_back_to_the_padded_batchs_rows_and_length() -> None:
    plan = graph_plan(bundled("tagger"))
    shapes = {"input_ids": (3, 37), "attention_mask": (3, 37)}
    cut = plan.output_cut(plan.outputs[0], Bucket(4, (64, 64)), shapes)
    assert cut.expected == ((0, 4), (1, 64))  # logits [4, 64, 9] from the graph
    assert cut.keep == ((0, 3), (1, 37))  # [3, 37, 9] to un-pad, as eager gives
    pooled = graph_plan(bundled("embedder", request_parameter=[]))
    cut = pooled.output_cut(pooled.outputs[0], Bucket(4, (64, 64)), shapes)
    assert (cut.expected, cut.keep) == (((0, 4),), ((0, 3),))  # [B, D]: rows only


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (lambda: bundled("embedder"), "request parameters"),
        (lambda: bundled("image_filter"), "2 variable axes"),
        (lambda: bundled("tokenizer"), "bytes"),
        (lambda: toy(max_batch_size=0), "no batch axis"),
        (lambda: toy(platform="onnxruntime_onnx"), "not a model.py"),
    ],
)
def test_models_graphs_cannot_replay_are_refused_with_a_reason(config: Any, problem: str) -> None:
    reason = plan_problem(config())
    assert reason is not None and problem in reason


def test_the_bundled_tagger_and_a_fixed_shape_model_are_eligible() -> None:
    assert plan_problem(bundled("tagger")) is None
    assert plan_problem(bundled("embedder", request_parameter=[])) is None
    assert plan_problem(toy()) is None


def test_each_compile_setting_on_each_device() -> None:
    tagger = bundled("tagger")
    assert tagger.compile == "auto"  # the default
    assert graph_mode(tagger, "cpu") == GraphMode("eager")  # auto on a CPU: off, quietly
    assert graph_mode(tagger, "cuda") == GraphMode("measure")
    forced = tagger.model_copy(update={"compile": "reduce-overhead"})
    assert graph_mode(forced, "cuda") == GraphMode("graphs")
    on_cpu = graph_mode(forced, "cpu")
    assert on_cpu.kind == "eager" and on_cpu.why is not None and "CUDA" in on_cpu.why
    for mode in ("off", "default", "max-autotune"):
        assert graph_mode(tagger.model_copy(update={"compile": mode}), "cuda") == GraphMode("eager")
    embedder = graph_mode(bundled("embedder"), "cuda")
    assert embedder.kind == "eager" and embedder.why is not None
    assert "request parameters" in embedder.why


def test_auto_is_accepted_on_every_platform_and_other_modes_need_a_model_py() -> None:
    common: dict[str, Any] = {
        "onnxruntime": False, "transformers": False, "text_input": False,
        "request_parameters": False, "bytes_tensors": [], "ensemble_scheduling": False,
    }  # fmt: skip
    assert platform_problem("onnxruntime_onnx", compile="auto", **common) is None
    refused = platform_problem("onnxruntime_onnx", compile="reduce-overhead", **common)
    assert refused is not None and "model.py" in refused


@pytest.mark.parametrize(
    ("gpu_ms", "wall_ms", "graphs"),
    [
        (1.0, 5.0, True),  # the GPU idled 4 ms of 5 waiting on launches
        (3.0, 4.0, False),  # 1.39 x 3 ms of padded replay > 4 ms eager
        (9.5, 10.0, False),  # compute-bound: the GPU was busy all along
        (2.0, 3.0, True),
    ],
)
def test_auto_picks_graphs_only_where_the_forward_is_launch_bound(
    gpu_ms: float, wall_ms: float, graphs: bool
) -> None:
    assert launch_bound(ForwardTimings(gpu_ms / 1e3, wall_ms / 1e3)) is graphs


def test_without_a_padding_allowance_the_rule_is_gpu_time_under_wall_time() -> None:
    assert launch_bound(ForwardTimings(0.0039, 0.004), padding=1.0)
    assert not launch_bound(ForwardTimings(0.004, 0.004), padding=1.0)
