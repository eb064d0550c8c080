"""Helpers shared by every peer server (imported inside each peer's own venv).

Only depends on torch, numpy and safetensors, which ``setup.sh`` installs into
every peer venv.  Responsibilities:

* load the *shared* tagger (``<model_dir>/1/model.py`` imported by file path,
  ``Model(**config.toml[parameters])``, weights from ``1/model.safetensors``
  via safetensors - never pickle), in eval mode with a fixed thread count;
* run a padded batch under ``torch.inference_mode`` and un-pad it;
* count executed batches and flush the counters to a JSON stats file that the
  runner reads after the warm-up and after the measured window
  (``targets.counters_from_stats_files``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tomllib
import torch

VERSION = "1"


def configure_torch(threads: int) -> None:
    """Same CPU threading for every peer: ``threads`` intra-op (0: torch's
    default, one per core), 1 inter-op."""
    if int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set / parallel work started
        pass


def model_parameters(model_dir: Path) -> dict[str, Any]:
    with open(Path(model_dir) / "config.toml", "rb") as f:
        return dict(tomllib.load(f).get("parameters", {}))


def model_config(model_dir: Path) -> dict[str, Any]:
    with open(Path(model_dir) / "config.toml", "rb") as f:
        return tomllib.load(f)


def load_tagger(model_dir: str | os.PathLike[str], threads: int = 2) -> torch.nn.Module:
    """Build the shared tagger module and load its safetensors weights."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    configure_torch(threads)
    model_py = model_dir / VERSION / "model.py"
    spec = importlib.util.spec_from_file_location(f"_peer_model_{uuid.uuid4().hex}", model_py)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {model_py}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.Model(**model_parameters(model_dir))
    state = load_file(str(model_dir / VERSION / "model.safetensors"), device="cpu")
    model.load_state_dict(state, strict=True)
    model.float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def run_batch(model: torch.nn.Module, input_ids: np.ndarray | torch.Tensor,
              attention_mask: np.ndarray | torch.Tensor) -> np.ndarray:
    """Run an already rectangular [B, T] batch; returns logits [B, T, C] float32."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64)
    mask = torch.as_tensor(attention_mask, dtype=torch.int64)
    with torch.inference_mode():
        out = model(ids, mask)
    return out.float().numpy()


def pad_and_run(model: torch.nn.Module, items: Sequence[tuple[np.ndarray, np.ndarray]],
                pad_value: int = 0) -> list[np.ndarray]:
    """Right-pad variable-length (ids, mask) items to the batch max, run, un-pad."""
    lengths = [int(ids.shape[0]) for ids, _ in items]
    t = max(lengths)
    ids = np.full((len(items), t), pad_value, dtype=np.int64)
    mask = np.zeros((len(items), t), dtype=np.int64)
    for i, (x, m) in enumerate(items):
        ids[i, : lengths[i]] = x
        mask[i, : lengths[i]] = m
    out = run_batch(model, ids, mask)
    return [out[i, : lengths[i]] for i in range(len(items))]


class BatchStats:
    """Counts executed batches; a daemon thread flushes them to a JSON file.

    The file holds cumulative counters ``{"batches", "items", "hist", "pid"}``
    (and a wall-clock ``time`` stamp, for people reading the file); the runner
    reads it before and after the measured window and reports
    ``d(items) / d(batches)`` as the mean executed batch size.
    """

    def __init__(self, path: str | os.PathLike[str] | None, interval: float = 0.1) -> None:
        self.path = Path(path) if path else None
        self.batches = 0
        self.items = 0
        self.hist: dict[int, int] = {}
        self._lock = threading.Lock()
        self._dirty = True
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.flush()
            t = threading.Thread(target=self._loop, args=(interval,), daemon=True,
                                 name="peer-batch-stats")
            t.start()

    def record(self, batch_size: int) -> None:
        with self._lock:
            self.batches += 1
            self.items += int(batch_size)
            self.hist[int(batch_size)] = self.hist.get(int(batch_size), 0) + 1
            self._dirty = True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"batches": self.batches, "items": self.items,
                    "hist": {str(k): v for k, v in sorted(self.hist.items())},
                    "pid": os.getpid(), "time": time.time()}

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            dirty, self._dirty = self._dirty, False
        if not dirty:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self.path)

    def _loop(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            try:
                self.flush()
            except OSError:
                pass
