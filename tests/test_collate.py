"""Padding and un-padding are pure functions: tested without an event loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorserve.batching.collate import Collator, pad, padded_shape, unpad
from tensorserve.errors import ModelFailure
from tensorserve.repository.config import InputSpec, ModelConfig, OutputSpec

rng = np.random.default_rng(0)


def spec(name: str, shape: list[int], dtype: str = "float32", pad_value: float = 0) -> InputSpec:
    return InputSpec(name=name, dtype=dtype, shape=shape, pad_value=pad_value)


def test_each_feature_is_padded_with_its_own_pad_value() -> None:
    inputs = [spec("ids", [-1], "int64", pad_value=7), spec("mask", [-1], "int64", pad_value=0)]
    items = [
        {"ids": np.array([1, 2, 3]), "mask": np.array([1, 1, 1])},
        {"ids": np.array([4]), "mask": np.array([1])},
    ]
    batch = pad(items, inputs)
    assert batch.features["ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch.features["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.extents["ids"].tolist() == [[3], [1]]
    assert (batch.real_elements, batch.padded_elements) == (8, 12)


def test_fixed_axes_are_kept_and_variable_axes_padded() -> None:
    inputs = [spec("frames", [-1, 4], pad_value=-1.0)]
    items = [{"frames": rng.normal(size=(n, 4)).astype(np.float32)} for n in (2, 5, 3)]
    batch = pad(items, inputs)
    assert tuple(batch.features["frames"].shape) == (3, 5, 4)
    row = batch.features["frames"][0].numpy()
    np.testing.assert_array_equal(row[:2], items[0]["frames"])
    assert (row[2:] == -1.0).all()


def test_two_variable_axes_round_trip() -> None:
    inputs = [spec("image", [-1, -1])]
    outputs = [OutputSpec(name="out", dtype="float32", shape=[-1, -1], unpad_like="image")]
    items = [{"image": rng.normal(size=shape).astype(np.float32)} for shape in [(3, 7), (6, 2), (1, 1)]]
    batch = pad(items, inputs)
    assert tuple(batch.features["image"].shape) == (3, 6, 7)
    doubled = {"out": batch.features["image"].numpy() * 2}
    results = unpad(doubled, batch, outputs, {"out": "image"})
    for item, result in zip(items, results):
        np.testing.assert_array_equal(result["out"], item["image"] * 2)


def test_uniform_items_take_the_stack_path() -> None:
    inputs = [spec("x", [-1])]
    items = [{"x": np.full(4, i, np.float32)} for i in range(3)]
    batch = pad(items, inputs)
    assert batch.features["x"].tolist() == [[i] * 4 for i in range(3)]
    assert batch.real_elements == batch.padded_elements == 12


def test_pad_to_multiple_of_rounds_variable_axes_up() -> None:
    inputs = [spec("x", [-1, 3])]
    batch = pad([{"x": np.ones((5, 3), np.float32)}], inputs, pad_to_multiple_of=8)
    assert tuple(batch.features["x"].shape) == (1, 8, 3)
    assert batch.features["x"][0, 5:].abs().sum() == 0


def test_rounding_up_never_passes_max_length() -> None:
    """A model sized to max_length (a positional table of 500) must never see
    501: 497 tokens round up to 500, not to 504."""
    inputs = [InputSpec(name="x", dtype="float32", shape=[-1], max_length=500)]
    assert padded_shape([497], inputs[0], 8) == [500]
    assert padded_shape([490], inputs[0], 8) == [496]
    batch = pad([{"x": np.ones(497, np.float32)}], inputs, pad_to_multiple_of=8)
    assert tuple(batch.features["x"].shape) == (1, 500)


def test_bfloat16_features_pad_with_the_right_bit_pattern() -> None:
    inputs = [spec("x", [-1], "bfloat16", pad_value=1.5)]
    item = torch.tensor([0.25, -2.0], dtype=torch.bfloat16).view(torch.uint16).numpy()
    batch = pad([{"x": item}, {"x": item[:1]}], inputs)
    tensor = batch.features["x"]
    assert tensor.dtype == torch.bfloat16
    assert tensor.float().tolist() == [[0.25, -2.0], [0.25, 1.5]]


def test_fixed_outputs_are_returned_whole_and_outputs_follow_their_source() -> None:
    inputs = [spec("a", [-1]), spec("b", [-1])]
    outputs = [
        OutputSpec(name="pooled", dtype="float32", shape=[2]),
        OutputSpec(name="per_b", dtype="float32", shape=[-1, 2], unpad_like="b"),
    ]
    items = [{"a": np.ones(2, np.float32), "b": np.ones(5, np.float32)},
             {"a": np.ones(4, np.float32), "b": np.ones(1, np.float32)}]
    batch = pad(items, inputs)
    model_out = {"pooled": np.arange(4, dtype=np.float32).reshape(2, 2),
                 "per_b": np.zeros((2, 5, 2), np.float32)}
    results = unpad(model_out, batch, outputs, {"pooled": None, "per_b": "b"})
    assert [r["per_b"].shape for r in results] == [(5, 2), (1, 2)]
    assert results[1]["pooled"].tolist() == [2.0, 3.0]


def test_output_shorter_than_its_source_fails_with_a_sentence() -> None:
    inputs = [spec("x", [-1])]
    outputs = [OutputSpec(name="y", dtype="float32", shape=[-1], unpad_like="x")]
    batch = pad([{"x": np.ones(6, np.float32)}, {"x": np.ones(2, np.float32)}], inputs)
    with pytest.raises(ModelFailure, match="output 'y' is shorter than input 'x'"):
        unpad({"y": np.zeros((2, 3), np.float32)}, batch, outputs, {"y": "x"})


def test_output_with_wrong_batch_size_fails_with_a_sentence() -> None:
    inputs = [spec("x", [-1])]
    outputs = [OutputSpec(name="y", dtype="float32", shape=[-1], unpad_like="x")]
    batch = pad([{"x": np.ones(2, np.float32)}] * 3, inputs)
    with pytest.raises(ModelFailure, match=r"expected a batch of 3 items"):
        unpad({"y": np.zeros((2, 2), np.float32)}, batch, outputs, {"y": "x"})


def test_a_batch_of_one_matches_the_general_path() -> None:
    inputs = [spec("image", [-1, -1], pad_value=3.0), spec("x", [-1], "bfloat16")]
    bits = torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16).view(torch.uint16).numpy()
    item = {"image": rng.normal(size=(4, 6)).astype(np.float32), "x": bits}
    alone = pad([item], inputs)
    pair = pad([item, item], inputs)
    for name in ("image", "x"):
        assert alone.features[name].dtype == pair.features[name].dtype
        assert torch.equal(alone.features[name][0], pair.features[name][0])
        assert alone.features[name].shape[0] == 1
    assert alone.extents["image"].tolist() == [[4, 6]]
    assert alone.real_elements == alone.padded_elements == 27


def collator(inputs: list[dict], pad_to_multiple_of: int | None = None) -> Collator:
    return Collator(ModelConfig.model_validate({
        "input": inputs,
        "output": [{"name": "y", "dtype": "float32", "shape": [2]}],
        "dynamic_batching": {"pad_to_multiple_of": pad_to_multiple_of},
    }))


def test_the_counted_size_is_the_rounded_up_size() -> None:
    """Items of length 5 padded to a multiple of 8 take 8 per row: the
    element cap and the direct path (padded_elements) and the budget (volume)
    count 8, as pad allocates 8."""
    counting = collator([{"name": "x", "dtype": "float32", "shape": [-1, 3]}], pad_to_multiple_of=8)
    items = [{"x": np.ones((5, 3), np.float32)}] * 2
    assert counting.padded_elements(items) == 2 * 8 * 3 == counting.pad(items).padded_elements
    assert counting.volumes(items[:1]) == [8]
    assert collator([{"name": "x", "dtype": "float32", "shape": [-1, 3]}]).volumes(items[:1]) == [5]


@pytest.mark.parametrize(
    ("shape", "multiple", "expected"),
    [([-1], None, [7, 3]), ([-1], 8, [8, 8]), ([-1, 3], None, [7, 3]), ([4, -1, -1], None, [49, 9])],
)
def test_an_items_volume_is_its_variable_extents_rounded_up(
    shape: list[int], multiple: int | None, expected: list[int]
) -> None:
    """``volumes`` (admission's one call for a request's items), on its
    shortcut (one variable axis, no rounding) and off it."""
    counting = collator([{"name": "x", "dtype": "float32", "shape": shape}], pad_to_multiple_of=multiple)
    items = [{"x": np.ones([n if d == -1 else d for d in shape], np.float32)} for n in (7, 3)]
    assert counting.volumes(items) == expected


def test_the_largest_batch_is_every_item_at_its_limit_rounding_never_past_it() -> None:
    limits = collator(
        [{"name": "ids", "dtype": "int64", "shape": [-1], "max_length": 100},
         {"name": "image", "dtype": "float32", "shape": [3, -1, -1], "max_length": 10}],
        pad_to_multiple_of=64,
    )  # fmt: skip
    batch = ModelConfig.model_fields["max_batch_size"].default  # the collator's config's
    assert limits.largest_batch_elements == batch * (100 + 3 * 10 * 10)
    full = {"ids": np.ones(100, np.int64), "image": np.ones((3, 10, 10), np.float32)}
    assert limits.padded_elements([full] * batch) == limits.largest_batch_elements


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[dict], list[dict[str, np.ndarray]], int | None]:
    """Inputs of random ranks with fixed and variable axes, items of random
    extents, and a random multiple (or none)."""
    specs = [
        {"name": f"in{i}", "dtype": "float32",
         "shape": draw(st.lists(st.sampled_from([-1, -1, 1, 3]), min_size=1, max_size=3))}
        for i in range(draw(st.integers(1, 3)))
    ]
    items = [
        {spec["name"]: np.zeros(
            [draw(st.integers(0, 9)) if dim == -1 else dim for dim in spec["shape"]], np.float32)
         for spec in specs}
        for _ in range(draw(st.integers(1, 5)))
    ]
    return specs, items, draw(st.none() | st.integers(1, 16))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_padded_elements_is_what_pad_allocates(batch: tuple[list[dict], list[dict], int | None]) -> None:
    specs, items, multiple = batch
    counting = collator(specs, multiple)
    padded = counting.pad(items)
    assert counting.padded_elements(items) == padded.padded_elements
    assert padded.padded_elements == sum(t.numel() for t in padded.features.values())
    primary = counting.primary
    if primary is not None:  # an item's volume: its variable extents as padded alone
        alone = counting.pad(items[:1]).features[primary.name].shape[1:]
        assert counting.volumes(items[:1]) == [math.prod(alone[a] for a in primary.variable_axes)]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=2, max_size=6),
    other=st.lists(st.integers(0, 9), min_size=6, max_size=6),
    shared=st.booleans(),
    multiple=st.none() | st.integers(1, 4),
)
def test_one_dimensional_features_pad_as_row_by_row(
    lengths: list[int], other: list[int], shared: bool, multiple: int | None
) -> None:
    """1-D features take one mask (shared by those of equal lengths): each
    must still equal a row-by-row copy with its own pad value, with its own
    extents, whether the next feature's lengths match or not."""
    inputs = [
        spec("ids", [-1], "int64", pad_value=7),
        spec("mask", [-1], "int64", pad_value=0),
        spec("fixed", [3], "int64", pad_value=5),
    ]
    second = lengths if shared else other[: len(lengths)]
    items = [
        {"ids": np.arange(1, n + 1), "mask": np.full(m, 2), "fixed": np.array([i, i, i])}
        for i, (n, m) in enumerate(zip(lengths, second))
    ]
    batch = pad(items, inputs, pad_to_multiple_of=multiple)
    for spec_, counts in ((inputs[0], lengths), (inputs[1], second)):
        width = padded_shape([max(counts)], spec_, multiple)[0]
        expected = np.full((len(items), width), spec_.pad_value, np.int64)
        for row, item in zip(expected, items):
            row[: len(item[spec_.name])] = item[spec_.name]
        np.testing.assert_array_equal(batch.features[spec_.name].numpy(), expected)
        assert batch.extents[spec_.name].tolist() == [[n] for n in counts]
    np.testing.assert_array_equal(batch.features["fixed"].numpy(), [[i] * 3 for i in range(len(items))])
    assert batch.extents["fixed"].shape == (len(items), 0)
    assert batch.real_elements == sum(lengths) + sum(second) + 3 * len(items)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_the_padded_length_is_the_longest_items_variable_extent(
    batch: tuple[list[dict], list[dict], int | None],
) -> None:
    """What the stats and spans report as the length a batch is padded to:
    the largest product of an item's variable axes, over every feature."""
    specs, items, multiple = batch
    counting = collator(specs, multiple)
    expected = [
        math.prod(item[s.name].shape[a] for a in s.variable_axes)
        for s in counting.inputs if s.variable_axes for item in items
    ]  # fmt: skip
    assert counting.pad(items).longest == max(expected, default=None)
