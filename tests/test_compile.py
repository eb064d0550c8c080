"""``compile`` wraps the model in torch.compile; warm-up compiles before ready."""

from __future__ import annotations

import numpy as np
import torch

from tensorserve import ServedModel


def test_a_compiled_model_gives_the_uncompiled_results() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x * 2, dim=1)

    common = dict(
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
        max_batch_size=4,
        pad_to_multiple_of=8,  # few shape buckets: few compilations
    )
    compiled = ServedModel.from_function(fn, compile="default", warmup={"lengths": [8]}, **common)
    assert compiled.fn is not fn
    rng = np.random.default_rng(0)
    items = [{"x": rng.normal(size=n).astype(np.float32)} for n in (3, 8, 5, 1)]
    with compiled:
        compiled.warmup()
        results = compiled.infer_many_sync(items)
    for item, result in zip(items, results):
        np.testing.assert_allclose(result["y"], np.cumsum(item["x"] * 2), rtol=1e-5, atol=1e-5)
