"""The soak's one toy model: ``y = 2x`` on rows of 4 floats, with what a
forward costs chosen by ``cost``, that misbehaves on marker values in an
item's first element (``requests.bad_body`` writes them) and whose "memory"
holds a padded batch of at most ``MEMORY_ELEMENTS`` elements."""

from __future__ import annotations

from pathlib import Path

from tensorserve_bench.repositories import write_xy_model

NAME = "soak"
ROUTE = f"/v2/models/{NAME}/infer"
MEMORY_ELEMENTS = 4096
MAX_BATCH_SIZE = 16
# The first element of an item that makes the model misbehave.
POISON, KILL, SLOW = 13, 7, 55
MODEL = """
import os
import time
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        first = x[:, 0, 0]
        if (first == {poison}).any():
            raise RuntimeError("poison value {poison} in batch")
        if (first == {kill}).any():
            os._exit(7)  # kills the worker (process isolation only)
        if (first == {slow}).any():
            time.sleep(0.02)  # slow: the caller's 5 ms deadline passes
        if x.numel() > {memory}:
            raise torch.OutOfMemoryError(f"tried to allocate {{x.numel()}} elements")
        time.sleep({cost})
        return x * 2
"""
# What a forward costs, by kind of model: "cpu" pays per row (a model on a
# CPU), "flat" the same 100 ms whatever the batch (a GPU-like model: the
# cost of a batch is its launch, not its rows), "light" 2 ms (queues form
# under a flood, and the flood still ends in seconds).
COSTS = {"cpu": "0.001 + 0.00002 * x.shape[0]", "flat": "0.1", "light": "0.002"}


def write_soak_model(
    repository: str | Path,
    *,
    isolation: str,
    cost: str,
    max_queue_delay_ms: float = 2.0,
    max_queue_size: int | None = None,
) -> Path:
    """The soak model in ``repository``, run in ``isolation`` (thread or
    process), each forward costing ``COSTS[cost]``."""
    model = MODEL.format(
        poison=POISON, kill=KILL, slow=SLOW, memory=MEMORY_ELEMENTS, cost=COSTS[cost]
    )
    settings = (
        f'max_batch_size = {MAX_BATCH_SIZE}\nisolation = "{isolation}"\n'
        f"[dynamic_batching]\nmax_queue_delay_ms = {max_queue_delay_ms}\n"
    )
    if max_queue_size is not None:
        settings += f"max_queue_size = {max_queue_size}\n"
    return write_xy_model(repository, NAME, model, settings)
