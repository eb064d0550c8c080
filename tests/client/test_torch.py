"""torch tensors in, numpy out (or torch out when asked)."""

from __future__ import annotations

import numpy as np
import pytest
from tensorserve_client import AsyncClient, Client
from tensorserve_client._tensors import decode_tensor, encode_feature

from tests.client.helpers import tokens

torch = pytest.importorskip("torch")


def test_torch_tensors_in_numpy_out(client: Client) -> None:
    item = tokens(12, seed=5)
    from_numpy = client.infer("tagger", item)
    from_torch = client.infer("tagger", {k: torch.from_numpy(v) for k, v in item.items()})
    assert isinstance(from_torch["logits"], np.ndarray)
    np.testing.assert_allclose(from_torch["logits"], from_numpy["logits"], rtol=1e-5, atol=1e-5)


def test_non_contiguous_tensors_are_sent_by_value(client: Client) -> None:
    image = torch.arange(60, dtype=torch.float32).reshape(6, 10) / 60
    strided = image.t()  # a transposed view, not C-contiguous
    out = client.infer("image_filter", {"image": strided})
    want = client.infer("image_filter", {"image": np.ascontiguousarray(strided.numpy())})
    np.testing.assert_allclose(out["filtered"], want["filtered"], rtol=1e-6)
    assert out["filtered"].shape == (10, 6)


async def test_return_torch_gives_writable_tensors(server_url: str) -> None:
    async with AsyncClient(server_url) as client:
        out = await client.infer("embedder", tokens(7), return_torch=True)
    embedding = out["embedding"]
    assert isinstance(embedding, torch.Tensor) and embedding.dtype == torch.float32
    assert embedding.shape == (64,)
    embedding.mul_(2)  # writable: no copy-on-write surprises, no torch warning


def test_bfloat16_tensors_round_trip_as_bit_patterns() -> None:
    tensor = torch.tensor([1.0, -2.5, 0.15625], dtype=torch.bfloat16)
    wire = encode_feature(tensor, "x")
    assert isinstance(wire, dict) and wire["dtype"] == "bfloat16"
    wire = {**wire, "data": bytes(wire["data"])}
    back = decode_tensor(wire, "y", return_torch=True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)
    np.testing.assert_array_equal(
        decode_tensor(wire, "y", return_torch=False), [1.0, -2.5, 0.15625]
    )
