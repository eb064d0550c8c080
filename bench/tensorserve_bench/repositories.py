"""The model repositories benchmarks serve: toy models written into a
temporary repository, and cached copies of the bundled models.

    write_model        any model folder: config.toml text and model.py
    write_xy_model     rows of 4 floats in (``x``), the same out (``y``): the
                       reliability benchmarks' toy (soaks, worker crash)
    write_zeros_model  the tagger's contract, no compute (front-end toys)
    write_flat_model   the tagger's contract, a flat time per batch
    cached_copy        a bundled model made again (a bigger variant, or with
                       nothing tuned), only when its source changed

A toy's config brings its own forward and batching settings; these add the
contract (inputs and outputs) and no warm-up.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path


def write_model(
    repository: str | Path, name: str, config: str, model_py: str, version: int = 1
) -> Path:
    """``repository/name`` with the config.toml text ``config`` and ``model_py``
    as version ``version`` (both dedented; no weights)."""
    folder = Path(repository, name)
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(textwrap.dedent(config))
    (folder / str(version) / "model.py").write_text(textwrap.dedent(model_py))
    return folder


# ---------------------------------------------------------------------- x -> y
XY_CONTRACT = """
[warmup]
enabled = false
[[input]]
name = "x"
dtype = "float32"
shape = [-1, 4]
[[output]]
name = "y"
dtype = "float32"
shape = [-1, 4]
"""


def write_xy_model(repository: str | Path, name: str, model_py: str, settings: str) -> Path:
    """``settings`` (config.toml's top-level keys and tables) with the x -> y
    contract, and ``model_py``."""
    return write_model(repository, name, settings + XY_CONTRACT, model_py)


# ---------------------------------------------------------------------- front-end toys
# The tagger's contract (token ids and their mask in, 9 logits per token out),
# for models that cost nothing or a fixed time: what the server does around
# the model is then all there is to measure (benchmarks/frontend.py).
TOKEN_CONTRACT = """
[warmup]
enabled = false
[[input]]
name = "input_ids"
dtype = "int64"
shape = [-1]
pad_value = 0
[[input]]
name = "attention_mask"
dtype = "int64"
shape = [-1]
pad_value = 0
[[output]]
name = "logits"
dtype = "float32"
shape = [-1, 9]
"""

# device "cpu" (unless a flat model is asked for on "cuda"): the toys stand for
# a model, not for a host-to-device copy, so they cost the same on any
# machine. max_batch_tokens 0: no padded-volume budget, so a batch may hold
# max_batch_size items whatever their lengths (the learnt budget would size
# batches by a cost these models do not have).
FRONTEND_SETTINGS = """
max_batch_size = {max_batch_size}
device = "{device}"
[dynamic_batching]
max_batch_tokens = 0
"""

ZEROS_MODEL = '''
import torch
from torch import nn


class Model(nn.Module):
    """No compute: zeros of the logits' shape, [batch, T, 9]."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*input_ids.shape, 9))
'''

FLAT_MODEL = '''
import time

import torch
from torch import nn


class Model(nn.Module):
    """A GPU-like model: a flat batch time whatever the batch size, spent in
    time.sleep, which releases the GIL and uses no CPU; then zeros."""

    def __init__(self, flat_ms: float = 5.0) -> None:
        super().__init__()
        self.flat_s = float(flat_ms) / 1000

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        time.sleep(self.flat_s)
        return torch.zeros((*input_ids.shape, 9))
'''

# The flat model on a GPU: what a GPU model does to the server, exactly. The
# device is busy for flat_ms a batch whatever its size (torch.cuda._sleep spins
# the GPU for a count of its clock cycles); the host only queues the work, so the
# executor overlaps two batches and no CPU thread pool runs (the CPU flat model's
# torch.zeros wakes the intra-op threads, which on 16 cores spun on 4-9 cores).
FLAT_CUDA_MODEL = '''
import torch
from torch import nn


class Model(nn.Module):
    """A flat flat_ms per batch on the GPU, then zeros there."""

    def __init__(self, flat_ms: float = 5.0) -> None:
        super().__init__()
        self.flat_ms = float(flat_ms)
        self.cycles = 0  # the GPU's clock cycles in flat_ms: measured on the first batch

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if not self.cycles:
            self.cycles = self._calibrate()
        torch.cuda._sleep(self.cycles)
        return torch.zeros((*input_ids.shape, 9), device=input_ids.device)

    def _calibrate(self) -> int:
        probe = 20_000_000  # ~10 ms at 2 GHz
        torch.cuda._sleep(5 * probe)  # the clock up from idle first
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        cycles = int(probe * self.flat_ms / start.elapsed_time(end))
        print(f"flat model: {cycles} GPU cycles a batch for {self.flat_ms} ms", flush=True)
        return cycles
'''


def write_token_model(repository: str | Path, name: str, model_py: str, settings: str) -> Path:
    """``settings`` (``[parameters]`` included) with the tagger's token
    contract, and ``model_py``."""
    return write_model(repository, name, settings + TOKEN_CONTRACT, model_py)


def write_zeros_model(
    repository: str | Path, name: str = "zeros", max_batch_size: int = 64
) -> Path:
    """The model-free case: its forward returns zeros, no warm-up."""
    settings = FRONTEND_SETTINGS.format(max_batch_size=max_batch_size, device="cpu")
    return write_token_model(repository, name, ZEROS_MODEL, settings)


def write_flat_model(
    repository: str | Path,
    name: str = "flat",
    max_batch_size: int = 64,
    flat_ms: float = 5.0,
    device: str = "cpu",
) -> Path:
    """A flat ``flat_ms`` per batch of up to ``max_batch_size`` items: it allows
    ``max_batch_size / flat_ms`` items per millisecond (64 / 5 ms: 12,800/s).
    ``device`` "cpu": a sleep on the host; "cuda": the GPU kept busy."""
    settings = FRONTEND_SETTINGS.format(max_batch_size=max_batch_size, device=device)
    settings += f"[parameters]\nflat_ms = {float(flat_ms)!r}\n"
    model = FLAT_CUDA_MODEL if device.startswith("cuda") else FLAT_MODEL
    return write_token_model(repository, name, model, settings)


# ---------------------------------------------------------------------- copies of bundled models
# What a model's config.toml tunes by hand; without them tensorserve's defaults decide.
TUNED_KEYS = ("isolation", "max_batch_tokens")


def cached_copy(
    source: str | Path,
    dest: str | Path,
    build: Callable[[Path, Path], object] | None = None,
    *,
    key: str = "",
    without: Sequence[str] = (),
) -> Path:
    """``dest``: the model folder ``source`` made again by ``build(source, dest)``
    (default: a plain copy; a benchmark passes ``make_variant`` of
    ``scripts/generate_example_weights.py`` for a bigger variant, and says how
    in ``key``), its config.toml without the lines that set a ``without`` key.
    Made again only when the source's config.toml, model.py or weights, ``key``
    or ``without`` changed: a stamp of them is kept in ``dest``."""
    source, dest = Path(source), Path(dest)
    weights = source / "1" / "model.safetensors"
    stamp = json.dumps(
        {
            "config": (source / "config.toml").read_text(),
            "model": (source / "1" / "model.py").read_text(),
            "weights": [weights.stat().st_size, weights.stat().st_mtime_ns]
            if weights.exists()
            else None,
            "key": key,
            "without": list(without),
        }
    )
    stamp_file = dest / ".source-stamp"
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    if build is None:
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        build(source, dest)
    config = dest / "config.toml"
    lines = config.read_text().splitlines(keepends=True)
    config.write_text("".join(line for line in lines if not line.startswith(tuple(without))))
    stamp_file.write_text(stamp)
    return dest
