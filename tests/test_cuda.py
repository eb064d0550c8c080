"""The CUDA path: pinned host batches, non_blocking copies, one stream per
instance. These run where a GPU exists and skip cleanly where none does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tensorserve import ServedModel
from tests.conftest import REPOSITORY

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
rng = np.random.default_rng(7)


def token_items(n: int) -> list[dict[str, np.ndarray]]:
    lengths = rng.integers(1, 120, size=n)
    return [
        {"input_ids": rng.integers(1, 4096, size=int(k), dtype=np.int64),
         "attention_mask": np.ones(int(k), np.int64)}
        for k in lengths
    ]


@pytest.mark.parametrize("instances", [1, 2])
def test_padded_cuda_batches_match_per_item_cpu_results(instances: int) -> None:
    items = token_items(48)
    with ServedModel.from_repository(REPOSITORY, "tagger", device="cpu", max_batch_size=1) as cpu:
        expected = [cpu.infer_sync(item)["logits"] for item in items]
    with ServedModel.from_repository(
        REPOSITORY, "tagger", device="cuda", instance_count=instances
    ) as gpu:
        assert gpu.device.type == "cuda"
        results = gpu.infer_many_sync(items)
        assert gpu.stats.snapshot(0)["avg_batch_size"] > 1
    for want, got in zip(expected, results):
        assert got["logits"].shape == want.shape
        np.testing.assert_allclose(got["logits"], want, atol=2e-3, rtol=2e-3)


def test_batches_are_assembled_in_pinned_memory_for_cuda() -> None:
    with ServedModel.from_repository(REPOSITORY, "image_filter", device="cuda") as model:
        pinned: list[bool] = []
        launch = model.executor.launch

        def recording(features: dict[str, torch.Tensor], *args: Any) -> Any:
            pinned.extend(t.is_pinned() for t in features.values())
            return launch(features, *args)

        model.executor.launch = recording  # type: ignore[method-assign]
        images = [rng.normal(size=shape).astype(np.float32) for shape in ((5, 7), (3, 9), (6, 4))]
        outs = model.infer_many_sync([{"image": image} for image in images])
        assert [out["filtered"].shape for out in outs] == [(5, 7), (3, 9), (6, 4)]
        assert pinned and all(pinned)
