"""The toy model the reliability benchmarks serve (soak.py, soak_overload.py,
worker_crash.py): rows of 4 floats in (``x``) and the same shape out (``y``),
no warm-up. Each benchmark brings its own forward and batching settings.

The front-end toys (frontend.py) take the tagger's inputs and give its
output: ``zeros`` (no compute) and ``flat`` (a fixed time per batch)."""

from __future__ import annotations

from pathlib import Path

INPUTS_AND_OUTPUTS = """
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


def write_toy_model(repository: str | Path, name: str, model_py: str, settings: str) -> Path:
    """``repository/name`` with ``settings`` (config.toml's top-level keys and
    tables) and the x -> y contract, and ``model_py`` as version 1."""
    folder = Path(repository, name)
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(settings + INPUTS_AND_OUTPUTS)
    (folder / "1" / "model.py").write_text(model_py)
    return folder


# ---------------------------------------------------------------------- front-end toys
# The tagger's contract (token ids and their mask in, 9 logits per token out),
# for models that cost nothing or a fixed time: what the server does around
# the model is then all there is to measure (benchmarks/frontend.py).
TOKENS_IN_LOGITS_OUT = """
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

# device "cpu": the toys stand for a model, not for a host-to-device copy, so
# they cost the same on any machine. max_batch_tokens 0: no padded-volume
# budget, so a batch may hold max_batch_size items whatever their lengths
# (the learnt budget would size batches by a cost these models do not have).
FRONTEND_SETTINGS = """
max_batch_size = {max_batch_size}
device = "cpu"
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


def write_token_model(repository: str | Path, name: str, model_py: str, settings: str) -> Path:
    """``repository/name`` with ``settings`` (config.toml's top-level keys and
    tables, ``[parameters]`` included) and the tagger's token contract, and
    ``model_py`` as version 1."""
    folder = Path(repository, name)
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(settings + TOKENS_IN_LOGITS_OUT)
    (folder / "1" / "model.py").write_text(model_py)
    return folder


def write_zeros_model(
    repository: str | Path, name: str = "zeros", max_batch_size: int = 64
) -> Path:
    """The model-free case: its forward returns zeros, no warm-up."""
    settings = FRONTEND_SETTINGS.format(max_batch_size=max_batch_size)
    return write_token_model(repository, name, ZEROS_MODEL, settings)


def write_flat_model(
    repository: str | Path, name: str = "flat", max_batch_size: int = 64, flat_ms: float = 5.0
) -> Path:
    """A flat ``flat_ms`` per batch of up to ``max_batch_size`` items: it allows
    ``max_batch_size / flat_ms`` items per millisecond (64 / 5 ms: 12,800/s)."""
    settings = FRONTEND_SETTINGS.format(max_batch_size=max_batch_size)
    settings += f"[parameters]\nflat_ms = {float(flat_ms)!r}\n"
    return write_token_model(repository, name, FLAT_MODEL, settings)
