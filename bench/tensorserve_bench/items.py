"""Synthetic items shaped like a model's inputs.

Every variable axis gets a length from a ``LengthDistribution``; the k-th
variable axis of every feature shares the item's k-th length, so features
that pad together (``input_ids`` and ``attention_mask``) stay aligned.
Integer features hold random ids in a small range, except features whose name
says they are a mask, which hold ones; float features hold standard normal
values. Everything comes from one seeded generator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve_bench.lengths import LengthDistribution

VARIABLE = -1
Item = dict[str, np.ndarray]


@dataclass(frozen=True)
class FeatureSpec:
    """One model input as the benchmark needs it (shape without the batch dim)."""

    name: str
    dtype: str  # numpy-style name, or "bfloat16"
    shape: tuple[int, ...]  # -1 marks a variable axis
    max_length: int | None = None

    @property
    def variable_axes(self) -> int:
        return sum(1 for d in self.shape if d == VARIABLE)

    @property
    def is_mask(self) -> bool:
        return "mask" in self.name.lower()


def specs_from_config(config: Mapping[str, Any]) -> list[FeatureSpec]:
    """From a config.toml dump (``ModelConfig.model_dump()`` or ``GET .../config``)."""
    return [
        FeatureSpec(s["name"], s["dtype"], tuple(s["shape"]), s.get("max_length"))
        for s in config["input"]
    ]


def specs_from_metadata(metadata: Mapping[str, Any]) -> list[FeatureSpec]:
    """From KServe v2 model metadata, whose shapes lead with the batch dim when
    the model batches."""
    from tensorserve.tensors.dtypes import BY_V2

    batching = int(metadata.get("max_batch_size", 0)) >= 1  # Triton: only 0 has no batch dim
    specs = []
    for s in metadata["inputs"]:
        shape = tuple(s["shape"][1:] if batching else s["shape"])
        dtype = s.get("dtype") or BY_V2[s["datatype"]].name
        specs.append(FeatureSpec(s["name"], dtype, shape))
    return specs


def vocab_limit(parameters: Mapping[str, Any], default: int) -> int:
    """Ids stay below the model's ``vocab_size`` parameter when it declares one."""
    vocab = parameters.get("vocab_size")
    return min(default, int(vocab)) if isinstance(vocab, int) and vocab > 1 else default


class ItemFactory:
    """Seeded generator of items for ``specs``.

    ``id_range`` is the half-open range of integer ids (default 1..999, clear
    of the usual pad id 0).
    """

    def __init__(
        self,
        specs: Sequence[FeatureSpec],
        lengths: LengthDistribution,
        *,
        seed: int = 0,
        id_range: tuple[int, int] = (1, 1000),
    ) -> None:
        if not specs:
            raise ValueError("a model needs at least one input to benchmark")
        if id_range[1] <= id_range[0]:
            raise ValueError(f"empty id range {id_range}")
        self.specs = list(specs)
        self.lengths = lengths
        self.id_range = id_range
        self.rng = np.random.default_rng(seed)
        self.variable_axes = max(s.variable_axes for s in self.specs)
        limits = [s.max_length for s in self.specs if s.max_length and s.variable_axes]
        self.max_length = min(limits) if limits else None

    def sample_lengths(self, count: int) -> np.ndarray:
        """``[count, variable_axes]`` lengths, clipped to the inputs' max_length."""
        drawn = self.lengths.sample(self.rng, count * max(1, self.variable_axes))
        drawn = drawn.reshape(count, max(1, self.variable_axes))
        if self.max_length is not None:
            drawn = np.minimum(drawn, self.max_length)
        return drawn

    def make(self, count: int) -> tuple[list[Item], np.ndarray]:
        """``count`` items and their ``[count, variable_axes]`` lengths."""
        lengths = self.sample_lengths(count)
        items = [self._item(row) for row in lengths]
        return items, lengths

    def _item(self, lengths: np.ndarray) -> Item:
        item = {}
        for spec in self.specs:
            axis_lengths = iter(lengths)
            shape = tuple(int(next(axis_lengths)) if d == VARIABLE else d for d in spec.shape)
            item[spec.name] = self._values(spec, shape)
        return item

    def _values(self, spec: FeatureSpec, shape: tuple[int, ...]) -> np.ndarray:
        if spec.dtype == "bfloat16":
            # bfloat16 travels as the top 16 bits of the float32 pattern
            values = self.rng.standard_normal(shape, dtype=np.float32)
            return (values.view(np.uint32) >> 16).astype(np.uint16)
        dtype = np.dtype(spec.dtype)
        if spec.is_mask:
            return np.ones(shape, dtype=dtype)
        if dtype.kind == "b":
            return self.rng.integers(0, 2, size=shape).astype(dtype)
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            low = max(self.id_range[0], int(info.min))
            high = min(self.id_range[1], int(info.max) + 1)
            return self.rng.integers(low, high, size=shape).astype(dtype)
        return self.rng.standard_normal(shape).astype(dtype)


def length_summary(lengths: np.ndarray) -> dict[str, float]:
    """min / max / mean of the first variable axis over the generated items."""
    first = lengths[:, 0] if lengths.ndim == 2 and lengths.size else np.zeros(1)
    return {"min": int(first.min()), "max": int(first.max()), "mean": float(first.mean())}
