"""Packed batches (issue #54), the pure parts: the config's refusals, packing
and the batch inputs of every kind, un-packing, and the budget in summed
tokens. No event loop, no threads (tests/test_packed_server.py serves them)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tensorserve.batching.collate import Collator
from tensorserve.batching.packing import PackedCollator, make_collator, pack, unpack
from tensorserve.batching.policy import Waiting, make_policy
from tensorserve.errors import ConfigError, ModelFailure
from tensorserve.repository.config import parse_config

KINDS = [
    "BATCH_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE",
    "BATCH_ITEM_SHAPE_FLATTEN",
]


def _config(**fields: Any) -> Any:
    data = {
        "input": [{"name": "x", "dtype": "float32", "shape": [-1, 2], "allow_ragged_batch": True}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1, 2]}],
        "batch_input": [
            {"kind": kind, "target_name": kind.lower(), "source_input": ["x"]} for kind in KINDS
        ],
        **fields,
    }
    return parse_config(data, "m/config.toml")


# ---------------------------------------------------------------------- refusals at load
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"input": [{"name": "x", "dtype": "float32", "shape": [4], "allow_ragged_batch": True}],
             "output": [{"name": "y", "dtype": "float32", "shape": [4]}], "batch_input": []},
            (
                "m/config.toml: input 'x': allow_ragged_batch = true concatenates items along their "
                "one variable (-1) axis, but shape [4] has 0"
            ),
        ),
        (
            {"input": [{"name": "x", "dtype": "float32", "shape": [-1, -1],
                        "allow_ragged_batch": True}],
             "output": [{"name": "y", "dtype": "float32", "shape": [-1]}], "batch_input": []},
            (
                "m/config.toml: input 'x': allow_ragged_batch = true concatenates items along their "
                "one variable (-1) axis, but shape [-1, -1] has 2"
            ),
        ),
        (
            {"max_batch_size": 0, "batch_input": []},
            (
                "m/config.toml: input 'x': allow_ragged_batch = true packs batches of items; it "
                "needs max_batch_size >= 1"
            ),
        ),
        (
            {"batch_input": [{"kind": "BATCH_ELEMENT_COUNT", "target_name": "x",
                              "source_input": ["x"]}]},
            "m/config.toml: batch_input 'x': target_name is already the name of input 'x'",
        ),
        (
            {"input": [{"name": "x", "dtype": "float32", "shape": [-1, 2]}],
             "batch_input": [{"kind": "BATCH_ELEMENT_COUNT", "target_name": "n",
                              "source_input": ["x"]}]},
            (
                "m/config.toml: batch_input 'n': source_input 'x' is not an input with "
                "allow_ragged_batch = true"
            ),
        ),
        (
            {"batch_output": [{"kind": "BATCH_SCATTER_WITH_INPUT_SHAPE", "target_name": ["z"],
                               "source_input": ["x"]}]},
            "m/config.toml: batch_output: target_name 'z' is not a declared output",
        ),
        (
            {"batch_input": [{"kind": "BATCH_ROW_COUNT", "target_name": "n",
                              "source_input": ["x"]}]},
            (
                "m/config.toml: batch_input[0].kind: Input should be 'BATCH_ELEMENT_COUNT', "
                "'BATCH_ACCUMULATED_ELEMENT_COUNT', 'BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO', "
                "'BATCH_MAX_ELEMENT_COUNT_AS_SHAPE', 'BATCH_ITEM_SHAPE' or 'BATCH_ITEM_SHAPE_FLATTEN'"
            ),
        ),
    ],
)  # fmt: skip
def test_a_packing_config_that_cannot_work_is_refused_in_one_sentence(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(**fields)
    assert str(caught.value) == message


def test_batch_output_splits_like_unpad_like_and_a_padded_model_keeps_its_collator() -> None:
    config = _config(
        output=[{"name": "y", "dtype": "float32", "shape": [-1, 2]},
                {"name": "z", "dtype": "float32", "shape": [-1]}],
        input=[{"name": "x", "dtype": "float32", "shape": [-1, 2], "allow_ragged_batch": True},
               {"name": "m", "dtype": "int64", "shape": [-1]}],
        batch_output=[{"kind": "BATCH_SCATTER_WITH_INPUT_SHAPE", "target_name": ["z"],
                       "source_input": ["x"]}],
    )  # fmt: skip
    # z would follow the first variable input (x) anyway; it is named here on purpose.
    assert config.packed and config.unpad_source(config.output[1]) == "x"
    assert type(make_collator(config)) is PackedCollator
    padded = parse_config(
        {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
         "output": [{"name": "y", "dtype": "float32", "shape": [-1]}]}, "p",
    )  # fmt: skip
    assert not padded.packed and type(make_collator(padded)) is Collator


# ---------------------------------------------------------------------- packing
def test_items_are_concatenated_along_their_variable_axis_with_no_batch_dimension() -> None:
    config = _config()
    first = np.arange(10, dtype=np.float32).reshape(5, 2)
    second = -np.arange(6, dtype=np.float32).reshape(3, 2)
    batch = pack([{"x": first}, {"x": second}], config.input, config.batch_input)
    np.testing.assert_array_equal(batch.features["x"].numpy(), np.concatenate([first, second]))
    assert batch.extents["x"].tolist() == [[5], [3]]
    assert (batch.real_elements, batch.padded_elements, batch.longest, batch.size) == (16, 16, 5, 2)
    # Counts are elements, as in Triton: a [5, 2] item counts 10.
    values = {k: batch.features[k.lower()] for k in KINDS}
    assert values["BATCH_ELEMENT_COUNT"].tolist() == [10, 6]
    assert values["BATCH_ACCUMULATED_ELEMENT_COUNT"].tolist() == [10, 16]
    assert values["BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"].tolist() == [0, 10, 16]
    assert values["BATCH_MAX_ELEMENT_COUNT_AS_SHAPE"].shape == (10,)
    assert values["BATCH_ITEM_SHAPE"].tolist() == [[5, 2], [3, 2]]
    assert values["BATCH_ITEM_SHAPE_FLATTEN"].tolist() == [5, 2, 3, 2]
    assert {v.dtype for v in values.values()} == {torch.int32}  # data_type's default


def test_a_ragged_input_packs_beside_a_padded_one_and_bytes_pack_too() -> None:
    config = parse_config(
        {"input": [{"name": "ids", "dtype": "int64", "shape": [-1], "allow_ragged_batch": True},
                   {"name": "mask", "dtype": "int64", "shape": [-1], "pad_value": 7},
                   {"name": "text", "dtype": "bytes", "shape": [-1], "allow_ragged_batch": True}],
         "output": [{"name": "y", "dtype": "int64", "shape": [-1]}],
         "batch_input": [{"kind": "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
                          "target_name": "cu", "data_type": "int64", "source_input": ["text"]}]},
        "m",
    )  # fmt: skip
    items = [
        {"ids": np.array([1, 2, 3]), "mask": np.array([1]), "text": np.array([b"a"], object)},
        {"ids": np.array([4]), "mask": np.array([1, 1]), "text": np.array([b"b", b"c"], object)},
    ]
    batch = make_collator(config).pad(items)
    assert batch.features["ids"].tolist() == [1, 2, 3, 4]
    assert batch.features["mask"].tolist() == [[1, 7], [1, 1]]  # padded as ever
    assert batch.features["text"].tolist() == [b"a", b"b", b"c"]
    assert (batch.features["cu"].tolist(), batch.features["cu"].dtype) == ([0, 1, 3], torch.int64)


# ---------------------------------------------------------------------- un-packing
def test_each_caller_gets_its_own_rows_of_a_packed_output_and_fixed_outputs_by_row() -> None:
    config = _config(
        output=[{"name": "y", "dtype": "float32", "shape": [-1, 2]},
                {"name": "n", "dtype": "int32", "shape": [1]}],
    )  # fmt: skip
    collator = make_collator(config)
    items = [{"x": np.full((n, 2), n, np.float32)} for n in (2, 4, 1)]
    batch = collator.pad(items)
    outputs = {
        "y": batch.features["x"].numpy() * 10,
        "n": batch.features["batch_element_count"].numpy()[:, None],
    }
    results = collator.unpad(outputs, batch)
    for item, result in zip(items, results):
        np.testing.assert_array_equal(result["y"], item["x"] * 10)
        assert result["n"].tolist() == [item["x"].size]


def test_a_packed_output_of_the_wrong_total_names_the_output() -> None:
    config = _config()
    with pytest.raises(ModelFailure) as caught:
        unpack(config.output[0], np.zeros((7, 2), np.float32), [5, 3], "x")
    assert caught.value.message == (
        "output 'y' has shape [7, 2]; packed like input 'x' it must be [8, 2]: axis 0 the "
        "sum of the batch's 2 lengths"
    )


def test_a_packed_output_cuts_along_a_variable_axis_that_is_not_the_first() -> None:
    config = parse_config(
        {"input": [{"name": "x", "dtype": "float32", "shape": [3, -1], "allow_ragged_batch": True}],
         "output": [{"name": "y", "dtype": "float32", "shape": [3, -1]}]}, "m",
    )  # fmt: skip
    items = [{"x": np.arange(3 * n, dtype=np.float32).reshape(3, n)} for n in (2, 5)]
    collator = make_collator(config)
    batch = collator.pad(items)
    assert tuple(batch.features["x"].shape) == (3, 7)
    for item, result in zip(items, collator.unpad({"y": batch.features["x"].numpy()}, batch)):
        np.testing.assert_array_equal(result["y"], item["x"])


# ---------------------------------------------------------------------- the budget
@pytest.mark.parametrize(
    ("policy", "padded_choice"),
    [("fifo", [0, 1]), ("length_aware", list(range(1, 11)))],  # 2 x 100; 10 x 10
)
def test_a_packed_budget_counts_summed_lengths_not_batch_times_longest(
    policy: str, padded_choice: list[int]
) -> None:
    # 100 + 10 * 10 = 200 tokens packed; padded, the same batch is 11 x 100 = 1100.
    waiting = Waiting([100] + [10] * 10)
    packed = make_policy(policy, 200, packed=True).select(waiting, 32)
    assert sorted(packed) == list(range(11))
    assert sorted(make_policy(policy, 200).select(waiting, 32)) == padded_choice
    assert sorted(make_policy(policy, 199, packed=True).select(waiting, 32)) != list(range(11))


def test_the_volumes_and_the_memory_count_of_a_packed_batch_are_its_real_elements() -> None:
    collator = make_collator(_config())
    items = [{"x": np.zeros((n, 2), np.float32)} for n in (5, 1, 3)]
    assert collator.volumes(items) == [5, 1, 3]
    assert collator.padded_elements(items) == 18  # not 3 x 5 x 2
