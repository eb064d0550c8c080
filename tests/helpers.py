"""Small helpers shared by the tests: native-protocol encoding and temporary
model repositories with toy models."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

MSGPACK = {"Content-Type": "application/msgpack"}


def tensor(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": array.tobytes()}


def from_wire(t: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(t["data"], dtype=t["dtype"]).reshape(t["shape"])


def body(items: list[dict[str, Any]], **extra: Any) -> bytes:
    wire_items = [
        {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in item.items()} for item in items
    ]
    return msgpack.packb({"items": wire_items, **extra})


def token_item(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "input_ids": rng.integers(1, 4096, size=length, dtype=np.int64),
        "attention_mask": np.ones(length, dtype=np.int64),
    }


def write_model(repo: Path, name: str, config: str, model_py: str, version: int = 1) -> Path:
    """A model folder with the given config.toml and model.py (no weights)."""
    folder = repo / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(textwrap.dedent(config))
    (folder / str(version) / "model.py").write_text(textwrap.dedent(model_py))
    return folder


ECHO_CONFIG = """
    max_batch_size = 8
    [dynamic_batching]
    max_queue_delay_ms = 2.0
    [[input]]
    name = "x"
    dtype = "float32"
    shape = [-1, 4]
    [[output]]
    name = "y"
    dtype = "float32"
    shape = [-1, 4]
"""

# Raises for any batch holding the value 13: a "poison" item.
POISON_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            return x * 2
"""
