"""The CUDA path: pinned host batches, non_blocking copies, one stream per
instance. These run where a GPU exists and skip cleanly where none does."""

from __future__ import annotations

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
        batch = model.batcher.collator.pad(
            [{"image": rng.normal(size=(5, 7)).astype(np.float32)},
             {"image": rng.normal(size=(3, 9)).astype(np.float32)}]
        )
        assert all(t.is_pinned() for t in batch.features.values())
        image = rng.normal(size=(6, 4)).astype(np.float32)
        out = model.infer_sync({"image": image})
        assert out["filtered"].shape == (6, 4)
