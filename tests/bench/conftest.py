"""Fixtures for the bench tests: a toy repository (fast to load) and fake targets."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from tensorserve_bench.items import FeatureSpec, Item
from tensorserve_bench.targets import Counters, RequestFailed

from tests.helpers import write_toy_model

# Two int64 token features in, one out: a cheap stand-in for a tagger.
ECHO_TOKENS: dict[str, Any] = {
    "max_batch_size": 8,
    "device": "cpu",
    "warmup": {"enabled": False},
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "inputs": {"tokens": {"dtype": "int64", "shape": [-1]}, "token_mask": {"dtype": "int64", "shape": [-1]}},
    "outputs": {"doubled": {"dtype": "int64", "shape": [-1]}},
}

ECHO_MODEL = """
import torch
from torch import nn


class Model(nn.Module):
    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return tokens * 2 * token_mask
"""


@pytest.fixture
def echo_repository(tmp_path: Path) -> Path:
    """A repository with one cheap model, ``echo``: doubled = 2 * tokens * token_mask."""
    write_toy_model(tmp_path / "repo", "echo", ECHO_MODEL, **ECHO_TOKENS)
    return tmp_path / "repo"


class FakeTarget:
    """Answers every request after ``delay`` seconds; fails every ``fail_every``-th
    and refuses (a 503, to retry later) every ``refuse_every``-th, at once."""

    kind = "fake"
    model = "fake"

    def __init__(self, specs: Sequence[FeatureSpec], delay: float = 0.0, fail_every: int = 0,
                 refuse_every: int = 0):
        self.specs = list(specs)
        self.parameters: dict[str, Any] = {}
        self.delay = delay
        self.fail_every = fail_every
        self.refuse_every = refuse_every
        self.sent: list[list[Item]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def open(self) -> None:
        pass

    def encode(self, items: Sequence[Item]) -> list[Item]:
        return list(items)

    async def send(self, payload: list[Item]) -> None:
        import asyncio

        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.sent.append(payload)
            if self.refuse_every and len(self.sent) % self.refuse_every == 0:
                raise RequestFailed("HTTP 503 would_miss_target: retry later", refused=True)
            await asyncio.sleep(self.delay)
            if self.fail_every and len(self.sent) % self.fail_every == 0:
                raise RuntimeError("synthetic failure")
        finally:
            self.in_flight -= 1

    async def counters(self) -> Counters:
        items = sum(len(p) for p in self.sent)
        return Counters(batches=len(self.sent), batch_items=items, histogram={"1": len(self.sent)})

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    async def aclose(self) -> None:
        pass


@pytest.fixture
def fake_target() -> type[FakeTarget]:
    return FakeTarget


@pytest.fixture
def token_specs() -> list[FeatureSpec]:
    return [FeatureSpec("input_ids", "int64", (-1,)), FeatureSpec("attention_mask", "int64", (-1,))]
