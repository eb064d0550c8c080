from __future__ import annotations

import numpy as np
from tensorserve_bench.items import (
    FeatureSpec,
    ItemFactory,
    specs_from_config,
    specs_from_metadata,
    vocab_limit,
)
from tensorserve_bench.lengths import from_values, uniform

TOKENS = [
    FeatureSpec("input_ids", "int64", (-1,), max_length=100),
    FeatureSpec("attention_mask", "int64", (-1,), max_length=100),
]


def test_features_share_the_item_length_and_masks_are_ones() -> None:
    items, lengths = ItemFactory(TOKENS, uniform(8, 128), seed=0).make(200)
    for item, row in zip(items, lengths):
        assert item["input_ids"].shape == item["attention_mask"].shape == (row[0],)
        assert (item["attention_mask"] == 1).all()
        assert item["input_ids"].dtype == np.int64
        assert ((item["input_ids"] >= 1) & (item["input_ids"] < 1000)).all()


def test_lengths_are_clipped_to_max_length() -> None:
    _, lengths = ItemFactory(TOKENS, uniform(90, 200), seed=0).make(100)
    assert lengths.max() == 100 and lengths.min() >= 90


def test_same_seed_same_items() -> None:
    a, _ = ItemFactory(TOKENS, uniform(1, 50), seed=3).make(5)
    b, _ = ItemFactory(TOKENS, uniform(1, 50), seed=3).make(5)
    assert all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(a, b))


def test_every_variable_axis_gets_a_length_and_floats_are_normal() -> None:
    image = [FeatureSpec("image", "float32", (-1, -1))]
    items, lengths = ItemFactory(image, from_values([4, 9]), seed=0).make(50)
    assert lengths.shape == (50, 2)
    for item, row in zip(items, lengths):
        assert item["image"].shape == tuple(row) and item["image"].dtype == np.float32
    values = np.concatenate([item["image"].ravel() for item in items])
    assert abs(values.mean()) < 0.2 and 0.8 < values.std() < 1.2


def test_fixed_axes_are_kept() -> None:
    spec = [FeatureSpec("frames", "float16", (-1, 3))]
    items, _ = ItemFactory(spec, uniform(2, 2), seed=0).make(1)
    assert items[0]["frames"].shape == (2, 3)


def test_specs_from_config_and_metadata_agree() -> None:
    config = {"input": [{"name": "input_ids", "dtype": "int64", "shape": [-1], "max_length": 512}]}
    metadata = {
        "max_batch_size": 32,
        "inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}],
    }
    assert specs_from_config(config) == [FeatureSpec("input_ids", "int64", (-1,), 512)]
    assert specs_from_metadata(metadata) == [FeatureSpec("input_ids", "int64", (-1,))]


def test_ids_stay_below_the_vocab() -> None:
    assert vocab_limit({"vocab_size": 50}, 1000) == 50
    assert vocab_limit({}, 1000) == 1000


def test_small_dtypes_bools_and_bfloat16() -> None:
    specs = [
        FeatureSpec("ids", "uint8", (-1,)),
        FeatureSpec("flags", "bool", (-1,)),
        FeatureSpec("pad_mask", "bool", (-1,)),
        FeatureSpec("weights", "bfloat16", (-1,)),
    ]
    items, _ = ItemFactory(specs, uniform(200, 200), seed=0).make(1)
    item = items[0]
    assert item["ids"].dtype == np.uint8 and item["ids"].max() <= 255 and item["ids"].min() >= 1
    assert item["flags"].dtype == np.bool_ and 0 < item["flags"].sum() < 200
    assert item["pad_mask"].all()
    assert item["weights"].dtype == np.uint16  # bfloat16 bit patterns
