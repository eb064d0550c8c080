"""The ceiling of benchmarks/gpu_fill.py: what a model's forward alone does
on one device, with nothing of a server around it.

The model is loaded as the server loads it (the repository's loader, then
``on_device``: the same weights, the same dtype, the same ``compile``; on
CUDA the same bucketed graphs where ``compile`` gives the server graphs,
decided by the same timing, so that a served model replaying graphs is
held to a ceiling that replays them too), the
items are sorted by length and cut into full batches of ``max_batch_size``,
each padded to its own longest item and put on the device before the clock
starts. On a GPU, whole passes over those batches run back to back on one
stream for about ``seconds``, timed by CUDA events (the GPU's own time for
the passes, launch gaps included); on a CPU the batches run in a seeded
shuffled order for ``seconds`` of wall clock (a pass may take longer), on
one intra-op thread as a model worker runs.
Nothing is copied to or from the host inside the timed loop: that work is
the server's, and the ceiling is what the device allows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Ceiling:
    model: str
    items_per_s: float
    batches: int  # batches a pass over the items
    batch_size: int  # max_batch_size: every batch but the last is full
    batches_run: int  # timed
    seconds: float  # timed
    padded_share: float  # padded positions / all positions of the sorted batches
    timer: str  # "cuda events" or "wall clock"
    forward: str  # "cuda graphs" or "eager": what the timed loop ran

    def as_json(self) -> dict[str, Any]:
        return {"model": self.model, "items_per_s": round(self.items_per_s, 1),
                "batches": self.batches, "batch_size": self.batch_size, "batches_run": self.batches_run,
                "seconds": round(self.seconds, 3), "padded_share": round(self.padded_share, 4),
                "timer": self.timer, "forward": self.forward}  # fmt: skip


@dataclass(frozen=True)
class Loaded:
    """A model as the server loads it: its module on the device, its config."""

    module: Any
    config: Any  # ModelConfig
    batch_size: int  # max_batch_size


def load_forward(repository: Path, name: str, device: str) -> Loaded:
    """The model ``name`` on ``device`` as the server loads it."""
    import torch

    from tensorserve.repository.loader import discover, load_model, read_config
    from tensorserve.runtime.executor import on_device

    source = discover(repository)[name]
    config = read_config(source, {"device": device})
    loaded = load_model(source, None, config)
    module = on_device(loaded.module, config, torch.device(device))
    return Loaded(module, config, int(config.max_batch_size))


def as_served(loaded: Loaded, device: Any, stream: Any, name: str) -> tuple[Any, str]:
    """The forward the server's instance would run on ``stream``: the
    module, or its bucketed CUDA graphs where the config gives the server
    graphs (``compile = "auto"`` decided by the server's own timing)."""
    from tensorserve.runtime.graphs import CudaGraphs, GraphedForward, graph_switch

    switch = graph_switch(loaded.config, device, name)
    if switch is None:
        return loaded.module, "eager"
    graphed = GraphedForward(loaded.module, switch, CudaGraphs(stream), device)
    if not switch.decide(lambda: graphed.time_eager(stream)):
        return loaded.module, "eager"
    names = [spec.name for spec in loaded.config.input]

    def forward(*tensors: Any) -> Any:
        return graphed(**dict(zip(names, tensors)))

    return forward, "cuda graphs"


def sorted_batches(ids: Sequence[np.ndarray], batch_size: int) -> tuple[list[np.ndarray], float]:
    """Right-padded id batches of the items sorted by length, and the share
    of padded positions among all positions."""
    order = sorted(ids, key=len)
    batches, padded, total = [], 0, 0
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(c) for c in chunk)
        batch = np.zeros((len(chunk), width), dtype=np.int64)
        for row, c in enumerate(chunk):
            batch[row, : len(c)] = c
        batches.append(batch)
        padded += batch.size - sum(len(c) for c in chunk)
        total += batch.size
    return batches, padded / total if total else 0.0


def measure(loaded: Loaded, ids: Sequence[np.ndarray], device: str, seconds: float,
            name: str) -> Ceiling:  # fmt: skip
    """Items/s of the model over full length-sorted batches of ``ids``."""
    import torch

    batch_size, forward, ran = loaded.batch_size, loaded.module, "eager"
    host, padded_share = sorted_batches(ids, batch_size)
    torch_device = torch.device(device)
    batches = [(torch.from_numpy(b).to(torch_device), torch.from_numpy((b != 0).astype(np.int64))
                .to(torch_device)) for b in host]  # fmt: skip
    items = sum(len(b) for b in host)  # a pass
    cuda = torch_device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(torch_device)  # the copies above ran on the default stream

    def one_pass() -> None:
        for input_ids, mask in batches:
            forward(input_ids, mask)

    with torch.inference_mode():
        if cuda:
            stream = torch.cuda.Stream(torch_device)
            with torch.cuda.stream(stream):
                forward, ran = as_served(loaded, torch_device, stream, name)
                one_pass()  # warm-up: allocator, kernels' first launches, lazy init
                stream.synchronize()
                started = time.perf_counter()
                one_pass()
                stream.synchronize()
                passes = max(1, round(seconds / max(time.perf_counter() - started, 1e-6)))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(passes):
                    one_pass()
                end.record(stream)
                end.synchronize()
                took = start.elapsed_time(end) / 1000
            done, run = items * passes, len(batches) * passes
        else:
            # One intra-op thread, as a model worker runs: torch's threads spin-wait,
            # and on a shared small CPU that costs them 5x (seen on 2 busy cores).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            # A pass can take seconds on a small CPU: batches in a seeded shuffled
            # order, so the time budget may end a pass half way and still be fair.
            order = np.random.default_rng(0).permutation(len(batches))
            forward(*batches[order[0]])  # warm-up
            done, k, started = 0, 0, time.perf_counter()
            while k == 0 or time.perf_counter() - started < seconds:
                input_ids, mask = batches[order[k % len(order)]]
                forward(input_ids, mask)
                done, k = done + len(input_ids), k + 1
            took, run = time.perf_counter() - started, k
            torch.set_num_threads(threads)
    return Ceiling(name, done / took, len(batches), batch_size, run, took,
                   padded_share, "cuda events" if cuda else "wall clock", ran)  # fmt: skip
